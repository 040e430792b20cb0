"""Causal depthwise 1-D convolution over the time axis, with packed-document masking.

x `[b, t, c]` (channels last, as the mixers produce it), weight `[c, w]`, bias `[c]`,
seq_idx `[b, t]` (document id per position; taps never reach into an earlier document),
initial_states `[b, w-1, c]` (the inputs before position 0: context parallelism's halo, in the
document initial_seq_idx `[b, w-1]` says when seq_idx is given).

``causal_depthwise_conv1d`` takes, in order, the first path that can run:
1. causal-conv1d's CUDA kernel (what Megatron runs), when ``titan_hybrid.ops.kernels.use_kernel``
   says so and the kernel takes the sizes (channels a multiple of 8, width 2..4);
2. our Triton kernels (titan_hybrid.ops.conv_triton) for CUDA tensors: bias, SiLU, documents and
   the halo in one pass each way, on any torch with triton;
3. ``causal_depthwise_conv1d_torch``, the reference and the CPU path.
The kernels' forward and backward are ``torch.library`` custom ops, so
``torch.compile(fullgraph=True)`` passes through them. Every path returns channels-last output
(``stride(-1) == 1``), which the SSD and gated-delta kernels read without a copy.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from titan_hybrid.compat import kernel_packages
from titan_hybrid.ops.custom_ops import kernel_op
from titan_hybrid.ops.kernels import KERNEL_DTYPES, use_kernel

if importlib.util.find_spec("triton") is not None:
    from titan_hybrid.ops.conv_triton import causal_depthwise_conv1d_triton
else:  # a CPU-only torch without triton: the torch path everywhere
    causal_depthwise_conv1d_triton = None

ACTIVATIONS = (None, "silu", "swish")


def causal_depthwise_conv1d(
    x_BTC: torch.Tensor,
    weight_CW: torch.Tensor,
    bias_C: torch.Tensor | None = None,
    *,
    seq_idx: torch.Tensor | None = None,
    activation: str | None = None,
    initial_states: torch.Tensor | None = None,
    initial_seq_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation '{activation}' is not 'silu' or None")
    channels, width = weight_CW.shape
    if initial_states is None and channels % 8 == 0 and 2 <= width <= 4 \
            and use_kernel(x_BTC, "causal_conv1d"):
        # The kernel's channels-last layout is [b, c, t] with stride 1 over c. A slice of
        # in_proj's output would come back channels-first (the kernel allocates its output like
        # its input only when that is dense), so it is made dense here.
        out_BCT = _conv_fwd(x_BTC.contiguous().transpose(1, 2), weight_CW.contiguous(),
                            None if bias_C is None else bias_C.contiguous(),
                            None if seq_idx is None else seq_idx.to(torch.int32).contiguous(),
                            activation is not None)
        return out_BCT.transpose(1, 2)
    if causal_depthwise_conv1d_triton is not None and x_BTC.is_cuda \
            and x_BTC.dtype in KERNEL_DTYPES:
        return causal_depthwise_conv1d_triton(
            x_BTC, weight_CW, bias_C, seq_idx=seq_idx, activation=activation,
            initial_states=initial_states, initial_seq_idx=initial_seq_idx)
    return causal_depthwise_conv1d_torch(x_BTC, weight_CW, bias_C, seq_idx=seq_idx,
                                         activation=activation, initial_states=initial_states,
                                         initial_seq_idx=initial_seq_idx)


def causal_depthwise_conv1d_torch(x_BTC, weight_CW, bias_C=None, *, seq_idx=None,
                                  activation=None, initial_states=None, initial_seq_idx=None):
    """Channels-last in and out. The weights may be fp32 while x is bf16 (data parallelism keeps
    a mixer's conv in fp32 with its SSM parameters): the arithmetic is in x's dtype, as in a
    bf16 layer. The halo rows (initial_states) are prepended and their outputs dropped."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation '{activation}' is not 'silu' or None")
    if initial_states is not None:
        halo = initial_states.shape[1]
        if seq_idx is not None:
            halo_ids = seq_idx[:, :1].expand(-1, halo) if initial_seq_idx is None \
                else initial_seq_idx
            seq_idx = torch.cat((halo_ids.to(seq_idx.dtype), seq_idx), 1)
        return causal_depthwise_conv1d_torch(
            torch.cat((initial_states.to(x_BTC.dtype), x_BTC), 1), weight_CW, bias_C,
            seq_idx=seq_idx, activation=activation)[:, halo:]
    weight_CW = weight_CW.to(x_BTC.dtype)
    bias_C = None if bias_C is None else bias_C.to(x_BTC.dtype)
    (channels, width), length = weight_CW.shape, x_BTC.shape[1]
    if seq_idx is None:
        # A 1 x width conv2d over [b, c, 1, t] viewed from channels-last memory: it reads x where
        # it lies and writes channels-last, where conv1d copies x to [b, c, t] and returns
        # channels-first. The causal padding comes first, so the output needs no slice (whose
        # backward would be another copy). Measured on CPU: forward + backward in 0.06x conv1d's
        # time in fp32, 1.8x in bf16, with as many copies.
        x_BTC = F.pad(x_BTC, (0, 0, width - 1, 0))
        out = F.conv2d(x_BTC.transpose(1, 2).unsqueeze(2), weight_CW[:, None, None, :], bias_C,
                       groups=channels)
        out = out.squeeze(2).transpose(1, 2)
    else:
        # Sum of shifted, weighted copies: tap s reads position t - s only in the same document.
        out = x_BTC * weight_CW[:, width - 1]
        if bias_C is not None:
            out = out + bias_C
        for shift in range(1, min(width, length)):
            same_doc = (seq_idx[:, shift:] == seq_idx[:, :-shift]).unsqueeze(-1)
            out[:, shift:].addcmul_(x_BTC[:, :-shift] * same_doc, weight_CW[:, width - 1 - shift])
    return F.silu(out) if activation is not None else out


# ---- causal-conv1d's kernel as torch.library custom ops (opaque to torch.compile). Its forward
# and backward functions (causal_conv1d.cpp_functions, what its own CausalConv1dFn calls;
# through titan_hybrid.compat.kernel_packages, checked on causal-conv1d 1.7.0) are used
# directly. x and dout are [b, c, t] views of channels-last tensors. A custom op cannot return
# None: an absent bias gradient is an empty tensor.

@kernel_op("causal_conv1d_fwd")
def _conv_fwd(x_BCT: torch.Tensor, weight_CW: torch.Tensor, bias_C: torch.Tensor | None,
              seq_idx_BT: torch.Tensor | None, silu: bool) -> torch.Tensor:
    return kernel_packages.causal_conv1d_fwd(x_BCT, weight_CW, bias_C, seq_idx_BT, None, None,
                                             silu)


@_conv_fwd.register_fake
def _(x_BCT, weight_CW, bias_C, seq_idx_BT, silu):
    return torch.empty_like(x_BCT)


@kernel_op("causal_conv1d_bwd")
def _conv_bwd(dout_BCT: torch.Tensor, x_BCT: torch.Tensor, weight_CW: torch.Tensor,
              bias_C: torch.Tensor | None, seq_idx_BT: torch.Tensor | None,
              silu: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dweight, dbias, _ = kernel_packages.causal_conv1d_bwd(
        x_BCT, weight_CW, bias_C, dout_BCT, seq_idx_BT, None, None, None, False, silu)
    return dx, dweight, x_BCT.new_empty(0) if dbias is None else dbias


@_conv_bwd.register_fake
def _(dout_BCT, x_BCT, weight_CW, bias_C, seq_idx_BT, silu):
    dbias = x_BCT.new_empty(0) if bias_C is None else torch.empty_like(bias_C)
    return torch.empty_like(x_BCT), torch.empty_like(weight_CW), dbias


def _conv_setup_context(ctx, inputs, output):
    x_BCT, weight_CW, bias_C, seq_idx_BT, ctx.silu = inputs
    ctx.save_for_backward(x_BCT, weight_CW, bias_C, seq_idx_BT)


def _conv_backward(ctx, dout_BCT):
    x_BCT, weight_CW, bias_C, seq_idx_BT = ctx.saved_tensors
    # The kernel reads dout in x's channels-last layout (a no-op when it already is).
    dout_BCT = dout_BCT.transpose(1, 2).contiguous().transpose(1, 2)
    dx, dweight, dbias = _conv_bwd(dout_BCT, x_BCT, weight_CW, bias_C, seq_idx_BT, ctx.silu)
    return dx, dweight, None if bias_C is None else dbias, None, None


_conv_fwd.register_autograd(_conv_backward, setup_context=_conv_setup_context)

"""Mamba2's core on the GPU kernels as one custom op pair: causal conv + SiLU over [x | B | C],
SSD scan, gated RMS norm, from in_proj's output [z | xBC | dt] to out_proj's input.

Run as separate ops, the backward assembles two gradients from pieces: the conv output's
(dx, dB, dC from the scan: a `cat` of [b, t, conv channels]) and in_proj's output's (dz from
the norm, dxBC from the conv, ddt from the scan: a `cat` of [b, t, in_proj rows], 169 MB a
layer at nemotron_h_1b's 2 x 4096). Here the backward allocates each gradient once and every
kernel writes its piece in place, through the launchers' output arguments: mamba_ssm's norm
(dz), SSD (dx, dB, dC, ddt; titan_hybrid.ops.ssd_backward, which also reuses the forward's
states) and the conv's (ours, or causal-conv1d's).

The layer (titan_hybrid.model.mamba) calls it when mamba_ssm's kernels run and the conv has a
kernel (CUDA, or `force_kernels()` in tests) and no context-parallel wrapper owns its conv and
scan; otherwise it runs the ops one by one. The kernels and their arithmetic are the same
either way.
"""

from __future__ import annotations

import torch

from titan_hybrid.compat import kernel_packages as kp
from titan_hybrid.ops import conv_triton
from titan_hybrid.ops.custom_ops import kernel_op
from titan_hybrid.ops.kernels import use_kernel
from titan_hybrid.ops.ssd_backward import ssd_backward


def _uses_causal_conv1d(xbc_BTC: torch.Tensor, weight_CW: torch.Tensor) -> bool:
    channels, width = weight_CW.shape
    return channels % 8 == 0 and 2 <= width <= 4 and use_kernel(xbc_BTC, "causal_conv1d")


def _split(zxbcdt, heads, head_dim, conv_channels):
    d_inner = heads * head_dim
    return zxbcdt.split([d_inner, conv_channels, heads], -1)


def split_xbc(xbc_BTC, heads, head_dim, state_size):
    """The conv output's x [B, T, H, P], B and C [B, T, G, N]."""
    d_inner = heads * head_dim
    group_state = (xbc_BTC.shape[-1] - d_inner) // 2
    x, B, C = xbc_BTC.split([d_inner, group_state, group_state], -1)
    return (x.unflatten(-1, (heads, head_dim)), B.unflatten(-1, (-1, state_size)),
            C.unflatten(-1, (-1, state_size)))


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


@kernel_op("mamba2_core_fwd", saved_by_selective_ac=True)
def _core_fwd(zxbcdt: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor,
              A: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor,
              seq_idx: torch.Tensor | None, head_dim: int, state_size: int, chunk_size: int,
              dt_min: float, dt_max: float, norm_group_size: int, norm_eps: float,
              causal_conv1d: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                            torch.Tensor, torch.Tensor, torch.Tensor,
                                            torch.Tensor]:
    """(out [b, t, d_inner], then for the backward: the conv output, the scan output y, the
    norm's rstd, dt_chunked, dA_cumsum, states)."""
    heads = A.shape[0]
    z, xbc, dt = _split(zxbcdt, heads, head_dim, conv_weight.shape[0])
    if causal_conv1d:  # its layout is [b, c, t] with channel stride 1, from dense memory
        xbc_act = kp.causal_conv1d_fwd(xbc.contiguous().transpose(1, 2), conv_weight, conv_bias,
                                       seq_idx, None, None, True).transpose(1, 2)
    else:
        xbc_act = conv_triton.conv_forward(xbc, conv_weight, conv_bias, seq_idx, None, None, True)
    x, B, C = split_xbc(xbc_act, heads, head_dim, state_size)
    y, _, dt_chunked, dA_cumsum, states, _ = kp.ssd_scan_fwd(
        x, dt, A, B, C, chunk_size, D=D, z=None, dt_bias=dt_bias, initial_states=None,
        seq_idx=seq_idx, dt_softplus=True, dt_limit=(dt_min, dt_max))
    y = y.flatten(-2)
    out, _, rstd = kp.gated_rms_norm_fwd(_rows(y), norm_weight, None, norm_eps, z=_rows(z),
                                         group_size=norm_group_size, norm_before_gate=False,
                                         is_rms_norm=True)
    return out.view(y.shape), xbc_act, y, rstd, dt_chunked, dA_cumsum, states


@_core_fwd.register_fake
def _(zxbcdt, conv_weight, conv_bias, A, D, dt_bias, norm_weight, seq_idx, head_dim,
      state_size, chunk_size, dt_min, dt_max, norm_group_size, norm_eps, causal_conv1d):
    b, t, _ = zxbcdt.shape
    heads, chunks = A.shape[0], -(-t // chunk_size)
    d_inner = heads * head_dim
    chunked = zxbcdt.new_empty(b, heads, chunks, chunk_size, dtype=torch.float32)
    xbc_act = zxbcdt.new_empty(b, t, conv_weight.shape[0])
    return (zxbcdt.new_empty(b, t, d_inner), xbc_act, zxbcdt.new_empty(b, t, d_inner),
            zxbcdt.new_empty(b * t * d_inner // norm_group_size, dtype=torch.float32), chunked,
            torch.empty_like(chunked), xbc_act.new_empty(b, chunks, heads, head_dim, state_size))


@kernel_op("mamba2_core_bwd")
def _core_bwd(dout: torch.Tensor, zxbcdt: torch.Tensor, conv_weight: torch.Tensor,
              conv_bias: torch.Tensor, A: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
              norm_weight: torch.Tensor, seq_idx: torch.Tensor | None, xbc_act: torch.Tensor,
              y: torch.Tensor, rstd: torch.Tensor, dt_chunked: torch.Tensor,
              dA_cumsum: torch.Tensor, states: torch.Tensor, head_dim: int, state_size: int,
              chunk_size: int, dt_min: float, dt_max: float, norm_group_size: int,
              norm_eps: float, causal_conv1d: bool) -> list[torch.Tensor]:
    """Gradients of (zxbcdt, conv_weight, conv_bias, A, D, dt_bias, norm_weight)."""
    heads = A.shape[0]
    z, xbc, dt = _split(zxbcdt, heads, head_dim, conv_weight.shape[0])
    dzxbcdt = torch.empty_like(zxbcdt)
    dz, dxbc, ddt = _split(dzxbcdt, heads, head_dim, conv_weight.shape[0])
    dy, dnorm_weight, _, _ = kp.gated_rms_norm_bwd(
        _rows(dout.contiguous()), _rows(y), norm_weight, None, norm_eps, None, rstd, z=_rows(z),
        group_size=norm_group_size, norm_before_gate=False, is_rms_norm=True, dz=_rows(dz))
    dxbc_act = torch.empty_like(xbc_act)
    x, B, C = split_xbc(xbc_act, heads, head_dim, state_size)
    dx, dB, dC = split_xbc(dxbc_act, heads, head_dim, state_size)
    _, _, dA, _, _, dD, _, ddt_bias, _ = ssd_backward(
        dy.view(x.shape), None, y.view(x.shape), x, dt, A, B, C, chunk_size, D, None, dt_bias,
        None, seq_idx, True, (dt_min, dt_max), dt_chunked, dA_cumsum, states, dx=dx, ddt=ddt,
        dB=dB, dC=dC)
    if causal_conv1d:  # dx lands in dxbc seen as [b, c, t] (its channel stride is 1)
        _, dconv_weight, dconv_bias, _ = kp.causal_conv1d_bwd(
            xbc.contiguous().transpose(1, 2), conv_weight, conv_bias, dxbc_act.transpose(1, 2),
            seq_idx, None, None, dxbc.transpose(1, 2), False, True)
    else:
        _, dconv_weight, dconv_bias, _ = conv_triton.conv_backward(
            dxbc_act, xbc, conv_weight, conv_bias, seq_idx, None, None, True, dx_BTC=dxbc)
    return [dzxbcdt, dconv_weight.to(conv_weight.dtype), dconv_bias.to(conv_bias.dtype),
            dA.to(A.dtype), dD.to(D.dtype), ddt_bias.to(dt_bias.dtype),
            dnorm_weight.to(norm_weight.dtype)]


@_core_bwd.register_fake
def _(dout, zxbcdt, conv_weight, conv_bias, A, D, dt_bias, norm_weight, seq_idx, xbc_act, y,
      rstd, dt_chunked, dA_cumsum, states, head_dim, state_size, chunk_size, dt_min, dt_max,
      norm_group_size, norm_eps, causal_conv1d):
    return [torch.empty_like(t) for t in (zxbcdt, conv_weight, conv_bias, A, D, dt_bias,
                                          norm_weight)]


_OPTIONS = ("head_dim", "state_size", "chunk_size", "dt_min", "dt_max", "norm_group_size",
            "norm_eps", "causal_conv1d")


def _setup_context(ctx, inputs, output):
    (zxbcdt, conv_weight, conv_bias, A, D, dt_bias, norm_weight, seq_idx, *options) = inputs
    ctx.options = options
    _, xbc_act, y, rstd, dt_chunked, dA_cumsum, states = output
    ctx.save_for_backward(zxbcdt, conv_weight, conv_bias, A, D, dt_bias, norm_weight, seq_idx,
                          xbc_act, y, rstd, dt_chunked, dA_cumsum, states)


def _backward(ctx, dout, *_):
    grads = _core_bwd(dout, *ctx.saved_tensors, *ctx.options)
    return (*grads, None, *[None] * len(_OPTIONS))


_core_fwd.register_autograd(_backward, setup_context=_setup_context)


def core_runs_fused(zxbcdt: torch.Tensor) -> bool:
    """Whether `mamba2_core` can run for this input: mamba_ssm's kernels run here and the conv
    has a kernel (causal-conv1d's, or ours, which needs only triton)."""
    return use_kernel(zxbcdt, "mamba_ssm")


def mamba2_core(zxbcdt_BTN, conv_weight_CW, conv_bias_C, A, D, dt_bias, norm_weight, *,
                seq_idx, head_dim, state_size, chunk_size, dt_limit, norm_group_size, norm_eps):
    """out_proj's input [b, t, d_inner] from in_proj's output [b, t, z | xBC | dt] (see the
    module docstring; A is the decay rate -exp(A_log))."""
    causal_conv1d = _uses_causal_conv1d(zxbcdt_BTN, conv_weight_CW)
    ids = None if seq_idx is None else seq_idx.to(torch.int32).contiguous()
    out, *_ = _core_fwd(zxbcdt_BTN, conv_weight_CW, conv_bias_C, A, D, dt_bias, norm_weight, ids,
                        head_dim, state_size, chunk_size, float(dt_limit[0]), float(dt_limit[1]),
                        norm_group_size, norm_eps, causal_conv1d)
    return out

"""Our own causal depthwise conv as Triton kernels: what a GPU runs without causal-conv1d.

`causal_depthwise_conv1d_triton(x, weight, bias, seq_idx=, activation=, initial_states=,
initial_seq_idx=)` takes the torch path's arguments (titan_hybrid.ops.conv) plus the rows before
the sequence that context parallelism passes between pieces (its halo):

- x `[b, t, c]` is read where it lies, through its strides: a slice of in_proj's output needs no
  copy (causal-conv1d wants it dense). Only the channel stride must be 1.
- bias and SiLU are fused into the one forward pass, and the backward is one pass for dx (and
  the halo's gradient) with the weight and bias gradients as per-block partial sums, which
  torch adds up afterwards (deterministic, unlike atomics).
- packed documents: a tap reads position t - s only when seq_idx is the same there.
- initial_states `[b, w-1, c]`: the inputs at positions -(w-1) .. -1, in the documents of
  initial_seq_idx `[b, w-1]` (default: position 0's; without seq_idx every halo row counts).
  Their gradient comes back like any input's.

Arithmetic is float32 in registers whatever the dtypes (bf16 activations, fp32 weights under
FSDP's mixed precision); outputs take their inputs' dtypes. The backward recomputes the
pre-activation rather than keeping it (one more read of x, instead of a saved [b, t, c]).

The kernels run as `torch.library` custom ops, opaque to torch.compile. Block sizes are fixed
(no autotuning, so no cold-start cost): the kernel is memory-bound, and a block of 32 steps x
128 channels reads x in 256-byte rows of bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from titan_hybrid.ops.custom_ops import kernel_op

BLOCK_T, BLOCK_C = 32, 128
ACTIVATIONS = (None, "silu", "swish")


@triton.jit
def _tap(x_ptr, init_ptr, seq_ptr, init_seq_ptr, pos, offs_c, batch, length, channels,
         stride_xb, stride_xt, stride_ib, stride_it, stride_sb, stride_isb,
         WIDTH: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr):
    """x at positions `pos` [T] (negative: the halo rows, or zero without them) as float32
    [T, C], and each position's document id [T] (0 without seq_idx)."""
    in_x = (pos >= 0) & (pos < length)
    mask_c = offs_c < channels
    values = tl.load(x_ptr + batch * stride_xb + pos[:, None] * stride_xt + offs_c[None, :],
                     mask=in_x[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
    halo_row = pos + (WIDTH - 1)
    in_halo = (pos < 0) & (halo_row >= 0)
    if HAS_INIT:
        values += tl.load(init_ptr + batch * stride_ib + halo_row[:, None] * stride_it
                          + offs_c[None, :], mask=in_halo[:, None] & mask_c[None, :],
                          other=0.0).to(tl.float32)
    doc = tl.zeros(pos.shape, dtype=tl.int32)
    if HAS_SEQ:
        doc = tl.load(seq_ptr + batch * stride_sb + pos, mask=in_x, other=0).to(tl.int32)
        if HAS_INIT:
            doc += tl.load(init_seq_ptr + batch * stride_isb + halo_row, mask=in_halo,
                           other=0).to(tl.int32)
    return values, doc


@triton.jit
def _pre_activation(x_ptr, w_ptr, b_ptr, init_ptr, seq_ptr, init_seq_ptr, pos, offs_c, batch,
                    length, channels, stride_xb, stride_xt, stride_ib, stride_it, stride_sb,
                    stride_isb, stride_wc, stride_wk, WIDTH: tl.constexpr,
                    HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr):
    """bias + sum_k w[k] x[pos - (w-1-k)] over taps in pos's document, float32 [T, C]."""
    mask_c = offs_c < channels
    acc = tl.zeros((pos.shape[0], offs_c.shape[0]), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    _, doc = _tap(x_ptr, init_ptr, seq_ptr, init_seq_ptr, pos, offs_c, batch, length,
                  channels, stride_xb, stride_xt, stride_ib, stride_it, stride_sb, stride_isb,
                  WIDTH, HAS_INIT, HAS_SEQ)
    for k in tl.static_range(WIDTH):
        x_k, doc_k = _tap(x_ptr, init_ptr, seq_ptr, init_seq_ptr, pos - (WIDTH - 1 - k), offs_c,
                          batch, length, channels, stride_xb, stride_xt, stride_ib, stride_it,
                          stride_sb, stride_isb, WIDTH, HAS_INIT, HAS_SEQ)
        w_k = tl.load(w_ptr + offs_c * stride_wc + k * stride_wk, mask=mask_c,
                      other=0.0).to(tl.float32)
        acc += tl.where((doc_k == doc)[:, None], x_k * w_k[None, :], 0.0)
    return acc


@triton.jit
def _conv_fwd_kernel(x_ptr, w_ptr, b_ptr, init_ptr, seq_ptr, init_seq_ptr, out_ptr,
                     length, channels, stride_xb, stride_xt, stride_ib, stride_it, stride_sb,
                     stride_isb, stride_wc, stride_wk, stride_ob, stride_ot,
                     WIDTH: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr,
                     HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    batch, block_t, block_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    pos = block_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = block_c * BLOCK_C + tl.arange(0, BLOCK_C)
    out = _pre_activation(x_ptr, w_ptr, b_ptr, init_ptr, seq_ptr, init_seq_ptr, pos, offs_c,
                          batch, length, channels, stride_xb, stride_xt, stride_ib, stride_it,
                          stride_sb, stride_isb, stride_wc, stride_wk, WIDTH, HAS_BIAS,
                          HAS_INIT, HAS_SEQ)
    if SILU:
        out = out * tl.sigmoid(out)
    mask = (pos < length)[:, None] & (offs_c < channels)[None, :]
    tl.store(out_ptr + batch * stride_ob + pos[:, None] * stride_ot + offs_c[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _conv_bwd_kernel(x_ptr, w_ptr, b_ptr, init_ptr, seq_ptr, init_seq_ptr, dout_ptr, dx_ptr,
                     dw_partial_ptr, db_partial_ptr, length, channels, first_pos, rows,
                     stride_xb, stride_xt, stride_ib, stride_it, stride_sb, stride_isb,
                     stride_wc, stride_wk, stride_gb, stride_gt, stride_dxb, stride_dxt,
                     WIDTH: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr,
                     HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Gradients for the `rows` source positions from first_pos: dx there (the halo rows when
    first_pos < 0, which dx_ptr then points at), and each block's partial weight / bias
    gradients from the outputs at the same positions."""
    batch, block_t, block_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    pos = first_pos + block_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = block_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < channels
    _, doc = _tap(x_ptr, init_ptr, seq_ptr, init_seq_ptr, pos, offs_c, batch, length,
                  channels, stride_xb, stride_xt, stride_ib, stride_it, stride_sb, stride_isb,
                  WIDTH, HAS_INIT, HAS_SEQ)
    dx = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    # Output t = pos + j reads pos through tap w-1-j: dx[pos] = sum_j w[w-1-j] dpre[pos + j].
    for j in tl.static_range(WIDTH):
        out_pos = pos + j
        in_out = (out_pos >= 0) & (out_pos < length)
        dpre = tl.load(dout_ptr + batch * stride_gb + out_pos[:, None] * stride_gt
                       + offs_c[None, :], mask=in_out[:, None] & mask_c[None, :],
                       other=0.0).to(tl.float32)
        if SILU:
            pre = _pre_activation(x_ptr, w_ptr, b_ptr, init_ptr, seq_ptr, init_seq_ptr, out_pos,
                                  offs_c, batch, length, channels, stride_xb, stride_xt,
                                  stride_ib, stride_it, stride_sb, stride_isb, stride_wc,
                                  stride_wk, WIDTH, HAS_BIAS, HAS_INIT, HAS_SEQ)
            sig = tl.sigmoid(pre)
            dpre = dpre * sig * (1.0 + pre * (1.0 - sig))
        _, out_doc = _tap(x_ptr, init_ptr, seq_ptr, init_seq_ptr, out_pos, offs_c, batch,
                          length, channels, stride_xb, stride_xt, stride_ib, stride_it,
                          stride_sb, stride_isb, WIDTH, HAS_INIT, HAS_SEQ)
        w_j = tl.load(w_ptr + offs_c * stride_wc + (WIDTH - 1 - j) * stride_wk, mask=mask_c,
                      other=0.0).to(tl.float32)
        dx += tl.where((out_doc == doc)[:, None], dpre * w_j[None, :], 0.0)
        if j == 0:  # the outputs at this block's own positions: their weight / bias gradients
            partial = (batch * tl.num_programs(1) + block_t) * channels
            if HAS_BIAS:
                tl.store(db_partial_ptr + partial + offs_c, tl.sum(dpre, 0), mask=mask_c)
            for k in tl.static_range(WIDTH):
                x_k, doc_k = _tap(x_ptr, init_ptr, seq_ptr, init_seq_ptr, pos - (WIDTH - 1 - k),
                                  offs_c, batch, length, channels, stride_xb, stride_xt,
                                  stride_ib, stride_it, stride_sb, stride_isb, WIDTH, HAS_INIT,
                                  HAS_SEQ)
                dw_k = tl.sum(tl.where((doc_k == doc)[:, None], dpre * x_k, 0.0), 0)
                tl.store(dw_partial_ptr + (partial + offs_c) * WIDTH + k, dw_k, mask=mask_c)
    mask = (pos - first_pos < rows)[:, None] & mask_c[None, :]
    tl.store(dx_ptr + batch * stride_dxb + (pos - first_pos)[:, None] * stride_dxt
             + offs_c[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _flags(bias_C, initial_states_BWC, seq_idx_BT):
    return dict(HAS_BIAS=bias_C is not None, HAS_INIT=initial_states_BWC is not None,
                HAS_SEQ=seq_idx_BT is not None, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C)


def _strides(x_BTC, weight_CW, initial_states_BWC, seq_idx_BT, initial_seq_idx_BW):
    init_strides = (0, 0) if initial_states_BWC is None else initial_states_BWC.stride()[:2]
    seq_stride = 0 if seq_idx_BT is None else seq_idx_BT.stride(0)
    init_seq_stride = 0 if initial_seq_idx_BW is None else initial_seq_idx_BW.stride(0)
    return (*x_BTC.stride()[:2], *init_strides, seq_stride, init_seq_stride,
            *weight_CW.stride())


def conv_forward(x_BTC: torch.Tensor, weight_CW: torch.Tensor, bias_C: torch.Tensor | None,
                 seq_idx_BT: torch.Tensor | None, initial_states_BWC: torch.Tensor | None,
                 initial_seq_idx_BW: torch.Tensor | None, silu: bool) -> torch.Tensor:
    """The forward launch: a new [b, t, c] output (ids int32, channel strides 1)."""
    batch, length, channels = x_BTC.shape
    out = x_BTC.new_empty(batch, length, channels)
    grid = (batch, triton.cdiv(length, BLOCK_T), triton.cdiv(channels, BLOCK_C))
    _conv_fwd_kernel[grid](
        x_BTC, weight_CW, bias_C, initial_states_BWC, seq_idx_BT, initial_seq_idx_BW, out,
        length, channels,
        *_strides(x_BTC, weight_CW, initial_states_BWC, seq_idx_BT, initial_seq_idx_BW),
        *out.stride()[:2], WIDTH=weight_CW.shape[1], SILU=silu,
        **_flags(bias_C, initial_states_BWC, seq_idx_BT))
    return out


def conv_backward(dout_BTC, x_BTC, weight_CW, bias_C, seq_idx_BT, initial_states_BWC,
                  initial_seq_idx_BW, silu: bool, dx_BTC: torch.Tensor | None = None):
    """(dx, dweight, dbias or None, dinitial_states or None). dx is written into `dx_BTC` when
    given (any [b, t, c] view with channel stride 1: a slice of a larger gradient)."""
    batch, length, channels = x_BTC.shape
    width = weight_CW.shape[1]
    blocks_t = triton.cdiv(length, BLOCK_T)
    dx = x_BTC.new_empty(batch, length, channels) if dx_BTC is None else dx_BTC
    dw_partial = torch.empty(batch * blocks_t, channels, width, dtype=torch.float32,
                             device=x_BTC.device)
    db_partial = torch.empty(batch * blocks_t if bias_C is not None else 0, channels,
                             dtype=torch.float32, device=x_BTC.device)
    strides = _strides(x_BTC, weight_CW, initial_states_BWC, seq_idx_BT, initial_seq_idx_BW)
    flags = _flags(bias_C, initial_states_BWC, seq_idx_BT)
    inputs = (x_BTC, weight_CW, bias_C, initial_states_BWC, seq_idx_BT, initial_seq_idx_BW,
              dout_BTC)
    _conv_bwd_kernel[(batch, blocks_t, triton.cdiv(channels, BLOCK_C))](
        *inputs, dx, dw_partial, db_partial, length, channels, 0, length, *strides,
        *dout_BTC.stride()[:2], *dx.stride()[:2], WIDTH=width, SILU=silu, **flags)
    dinit = None
    if initial_states_BWC is not None:
        # The halo rows' own launch: one block of positions -(w-1) .. -1 (its partial weight
        # gradients are those of outputs before the sequence: none, so they are not kept).
        dinit = torch.empty_like(initial_states_BWC)
        scratch = torch.empty(batch, channels, width, dtype=torch.float32, device=x_BTC.device)
        _conv_bwd_kernel[(batch, 1, triton.cdiv(channels, BLOCK_C))](
            *inputs, dinit, scratch, scratch, length, channels, -(width - 1), width - 1,
            *strides, *dout_BTC.stride()[:2], *dinit.stride()[:2], WIDTH=width, SILU=silu,
            **flags)
    dweight = dw_partial.sum(0).to(weight_CW.dtype)
    dbias = None if bias_C is None else db_partial.sum(0).to(bias_C.dtype)
    return dx, dweight, dbias, dinit


@kernel_op("triton_causal_conv1d_fwd")
def _conv_fwd(x_BTC: torch.Tensor, weight_CW: torch.Tensor, bias_C: torch.Tensor | None,
              seq_idx_BT: torch.Tensor | None, initial_states_BWC: torch.Tensor | None,
              initial_seq_idx_BW: torch.Tensor | None, silu: bool) -> torch.Tensor:
    return conv_forward(x_BTC, weight_CW, bias_C, seq_idx_BT, initial_states_BWC,
                        initial_seq_idx_BW, silu)


@_conv_fwd.register_fake
def _(x_BTC, weight_CW, bias_C, seq_idx_BT, initial_states_BWC, initial_seq_idx_BW, silu):
    return x_BTC.new_empty(x_BTC.shape)


@kernel_op("triton_causal_conv1d_bwd")
def _conv_bwd(dout_BTC: torch.Tensor, x_BTC: torch.Tensor, weight_CW: torch.Tensor,
              bias_C: torch.Tensor | None, seq_idx_BT: torch.Tensor | None,
              initial_states_BWC: torch.Tensor | None, initial_seq_idx_BW: torch.Tensor | None,
              silu: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias, dinitial_states); an absent input's gradient is an empty tensor."""
    dx, dweight, dbias, dinit = conv_backward(dout_BTC, x_BTC, weight_CW, bias_C, seq_idx_BT,
                                              initial_states_BWC, initial_seq_idx_BW, silu)
    empty = x_BTC.new_empty(0)
    return dx, dweight, empty if dbias is None else dbias, empty if dinit is None else dinit


@_conv_bwd.register_fake
def _(dout_BTC, x_BTC, weight_CW, bias_C, seq_idx_BT, initial_states_BWC, initial_seq_idx_BW,
      silu):
    dbias = x_BTC.new_empty(0) if bias_C is None else torch.empty_like(bias_C)
    dinit = (x_BTC.new_empty(0) if initial_states_BWC is None
             else torch.empty_like(initial_states_BWC))
    return x_BTC.new_empty(x_BTC.shape), torch.empty_like(weight_CW), dbias, dinit


def _setup_context(ctx, inputs, output):
    x, weight, bias, seq_idx, initial_states, initial_seq_idx, ctx.silu = inputs
    ctx.save_for_backward(x, weight, bias, seq_idx, initial_states, initial_seq_idx)


def _backward(ctx, dout_BTC):
    x, weight, bias, seq_idx, initial_states, initial_seq_idx = ctx.saved_tensors
    if dout_BTC.stride(-1) != 1:
        dout_BTC = dout_BTC.contiguous()
    dx, dweight, dbias, dinit = _conv_bwd(dout_BTC, x, weight, bias, seq_idx, initial_states,
                                          initial_seq_idx, ctx.silu)
    return (dx, dweight, None if bias is None else dbias, None,
            None if initial_states is None else dinit, None, None)


_conv_fwd.register_autograd(_backward, setup_context=_setup_context)


def _channels_last(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return tensor if tensor is None or tensor.stride(-1) == 1 else tensor.contiguous()


def causal_depthwise_conv1d_triton(x_BTC, weight_CW, bias_C=None, *, seq_idx=None,
                                   activation=None, initial_states=None, initial_seq_idx=None):
    """The causal conv through our Triton kernels (see the module docstring)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation '{activation}' is not 'silu' or None")
    if initial_seq_idx is not None and (seq_idx is None or initial_states is None):
        raise ValueError("initial_seq_idx needs seq_idx and initial_states")
    if initial_seq_idx is None and seq_idx is not None and initial_states is not None:
        # The halo rows continue the first position's document (as the torch path reads them).
        initial_seq_idx = seq_idx[:, :1].expand(-1, initial_states.shape[1])
    as_ids = (lambda ids: None if ids is None else ids.to(torch.int32).contiguous())
    return _conv_fwd(_channels_last(x_BTC), weight_CW, bias_C, as_ids(seq_idx),
                     _channels_last(initial_states), as_ids(initial_seq_idx),
                     activation is not None)

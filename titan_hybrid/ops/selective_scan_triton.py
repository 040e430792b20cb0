"""Mamba1's selective scan as Triton kernels: the GPU path with packed documents and initial /
final states, which mamba_ssm's `selective_scan_fn` does not take.

`selective_scan_triton(u, dt, A, B, C, D=, z=, dt_bias=, dt_softplus=, seq_idx=,
initial_state=, return_final_state=)` takes the torch path's arguments and gives its results
(titan_hybrid.ops.selective_scan, whose docstring has the recurrence and the shapes).

- The forward: a program a (row, block of BLOCK_D channels) holds the block's state
  [BLOCK_D, n] in registers and walks the tokens in order: the decay exp(dt A), the input
  dt u B, the read-out C . h + D u and the gate, one token at a time, fused with dt's bias and
  softplus. It also writes the state entering every CHUNK-th token (`chunk_states`
  [b, ceil(t / CHUNK), d, n], float32, 1/CHUNK of all the states).
- The backward walks the chunks last to first: it recomputes a chunk's states from the one
  entering it into a scratch buffer of its own, then walks the chunk backwards, carrying the
  state's gradient. B and C are shared by every channel, so their gradients are written per
  channel block, and those of A, D and dt_bias per row, then summed by torch: no atomics, so the
  same inputs give the same gradients bit for bit.
- Packed documents: the state is dropped where seq_idx changes; the position before the
  sequence counts as document 0 (as in the torch path).

Arithmetic is float32 in registers whatever the dtypes; y takes u's dtype, the final state is
float32. Both passes are `torch.library` custom ops (opaque to torch.compile), and per-op
selective activation checkpointing keeps the forward's outputs (ops/custom_ops.py). The loop
over tokens is sequential in each program: the parallelism is rows x channel blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from titan_hybrid.ops.custom_ops import kernel_op

BLOCK_D = 32  # channels a program
CHUNK = 64  # tokens between the states the forward keeps for the backward


@triton.jit
def _softplus(x):
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _token(u_ptr, dt_ptr, b_ptr, c_ptr, seq_ptr, bias, t, offs_d, offs_n, mask_d, mask_n,
           stride_ut, stride_dtt, stride_bt, stride_ct, HAS_BIAS: tl.constexpr,
           SOFTPLUS: tl.constexpr, HAS_SEQ: tl.constexpr):
    """Token t's u, raw dt (with its bias), dt [D] and B, C [N], and its document id (0
    without seq_idx)."""
    u = tl.load(u_ptr + t * stride_ut + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    dt_raw = tl.load(dt_ptr + t * stride_dtt + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    if HAS_BIAS:
        dt_raw += bias
    dt = dt_raw
    if SOFTPLUS:
        dt = _softplus(dt_raw)
    b = tl.load(b_ptr + t * stride_bt + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + t * stride_ct + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    doc = 0
    if HAS_SEQ:
        doc = tl.load(seq_ptr + t)
    return u, dt_raw, dt, b, c, doc


@triton.jit
def _channel_block(a_ptr, bias_ptr, d_ptr, channels, state_size, BLOCK_D: tl.constexpr,
                   BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_D: tl.constexpr):
    """This program's channel block: its offsets and masks, the offsets of its rows in a
    [d, n] state, and its A [D, N], dt bias and D [D] (zeros where absent), float32."""
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_d, mask_n = offs_d < channels, offs_n < state_size
    mask_dn = mask_d[:, None] & mask_n[None, :]
    state_offs = offs_d[:, None] * state_size + offs_n[None, :]
    a = tl.load(a_ptr + state_offs, mask=mask_dn, other=0.0).to(tl.float32)
    bias = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    skip = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_D:
        skip = tl.load(d_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    return offs_d, offs_n, mask_d, mask_n, mask_dn, state_offs, a, bias, skip


@triton.jit
def _row_starts(u_ptr, dt_ptr, b_ptr, c_ptr, seq_ptr, row, stride_ub, stride_dtb, stride_bb,
                stride_cb, stride_sb, HAS_SEQ: tl.constexpr):
    """The per-token inputs' pointers at this program's row."""
    if HAS_SEQ:
        seq_ptr += row * stride_sb
    return (u_ptr + row * stride_ub, dt_ptr + row * stride_dtb, b_ptr + row * stride_bb,
            c_ptr + row * stride_cb, seq_ptr)


@triton.jit
def _scan_fwd_kernel(u_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, bias_ptr, seq_ptr,
                     init_ptr, out_ptr, final_ptr, chunks_ptr, length, channels, state_size,
                     stride_ub, stride_ut, stride_dtb, stride_dtt, stride_bb, stride_bt,
                     stride_cb, stride_ct, stride_zb, stride_zt, stride_sb, stride_ob, stride_ot,
                     BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
                     SOFTPLUS: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_INIT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs_d, offs_n, mask_d, mask_n, mask_dn, state_offs, a, bias, skip = _channel_block(
        a_ptr, bias_ptr, d_ptr, channels, state_size, BLOCK_D, BLOCK_N, HAS_BIAS, HAS_D)
    h = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32)
    if HAS_INIT:
        h = tl.load(init_ptr + row * channels * state_size + state_offs, mask=mask_dn,
                    other=0.0).to(tl.float32)
    u_ptr, dt_ptr, b_ptr, c_ptr, seq_ptr = _row_starts(
        u_ptr, dt_ptr, b_ptr, c_ptr, seq_ptr, row, stride_ub, stride_dtb, stride_bb, stride_cb,
        stride_sb, HAS_SEQ)
    chunk_count = tl.cdiv(length, CHUNK)
    previous = tl.full([], 0, tl.int64)
    for t in range(length):
        # the state entering every CHUNK-th token, for the backward
        tl.store(chunks_ptr + (row * chunk_count + t // CHUNK) * channels * state_size
                 + state_offs, h, mask=mask_dn & (t % CHUNK == 0))
        u, dt_raw, dt, b, c, doc = _token(u_ptr, dt_ptr, b_ptr, c_ptr, seq_ptr, bias, t,
                                          offs_d, offs_n, mask_d, mask_n, stride_ut, stride_dtt,
                                          stride_bt, stride_ct, HAS_BIAS, SOFTPLUS, HAS_SEQ)
        if HAS_SEQ:
            h = tl.where(doc == previous, h, 0.0)
            previous = doc.to(tl.int64)
        h = tl.exp(dt[:, None] * a) * h + (dt * u)[:, None] * b[None, :]
        y = tl.sum(h * c[None, :], axis=1) + skip * u
        if HAS_Z:
            z = tl.load(z_ptr + row * stride_zb + t * stride_zt + offs_d, mask=mask_d,
                        other=0.0).to(tl.float32)
            y = y * z * tl.sigmoid(z)
        tl.store(out_ptr + row * stride_ob + t * stride_ot + offs_d,
                 y.to(out_ptr.dtype.element_ty), mask=mask_d)
    tl.store(final_ptr + row * channels * state_size + state_offs, h, mask=mask_dn)


@triton.jit
def _scan_bwd_kernel(u_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, bias_ptr, seq_ptr,
                     dout_ptr, dfinal_ptr, chunks_ptr, scratch_ptr, du_ptr, ddt_ptr, dz_ptr,
                     db_part_ptr, dc_part_ptr, da_part_ptr, dd_part_ptr, dbias_part_ptr,
                     dinit_ptr, length, channels, state_size,
                     stride_ub, stride_ut, stride_dtb, stride_dtt, stride_bb, stride_bt,
                     stride_cb, stride_ct, stride_zb, stride_zt, stride_sb,
                     BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
                     SOFTPLUS: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_INIT: tl.constexpr,
                     HAS_DFINAL: tl.constexpr):
    """Gradients, with dt's for the raw dt (before bias and softplus). The dense outputs
    (du, ddt, dz: [b, t, d]) are contiguous; the partial sums are
    db / dc [b, d-blocks, t, n], da [b, d, n], dd / dbias [b, d]."""
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    blocks = tl.num_programs(1)
    offs_d, offs_n, mask_d, mask_n, mask_dn, state_offs, a, bias, skip = _channel_block(
        a_ptr, bias_ptr, d_ptr, channels, state_size, BLOCK_D, BLOCK_N, HAS_BIAS, HAS_D)
    g = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32)  # d loss / d (the state after token t)
    if HAS_DFINAL:
        g = tl.load(dfinal_ptr + row * channels * state_size + state_offs, mask=mask_dn,
                    other=0.0).to(tl.float32)
    da = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32)
    dskip = tl.zeros([BLOCK_D], dtype=tl.float32)
    dbias = tl.zeros([BLOCK_D], dtype=tl.float32)
    u_ptr, dt_ptr, b_ptr, c_ptr, seq_ptr = _row_starts(
        u_ptr, dt_ptr, b_ptr, c_ptr, seq_ptr, row, stride_ub, stride_dtb, stride_bb, stride_cb,
        stride_sb, HAS_SEQ)
    dense = row * length * channels  # du, ddt, dz, dout: contiguous [b, t, d]
    part = (row * blocks + block) * length * state_size  # db, dc: [b, blocks, t, n]
    local = tl.arange(0, BLOCK_D)[:, None] * BLOCK_N + offs_n[None, :]
    scratch_ptr += (row * blocks + block) * CHUNK * BLOCK_D * BLOCK_N
    chunk_count = tl.cdiv(length, CHUNK)
    for chunk_from_end in range(chunk_count):
        chunk = chunk_count - 1 - chunk_from_end
        start = chunk * CHUNK
        entering_ptr = chunks_ptr + (row * chunk_count + chunk) * channels * state_size
        h = tl.load(entering_ptr + state_offs, mask=mask_dn, other=0.0)
        previous = tl.full([], 0, tl.int64)
        if HAS_SEQ:
            previous = tl.load(seq_ptr + start - 1, mask=start > 0, other=0).to(tl.int64)
        steps = tl.minimum(CHUNK, length - start)
        for k in range(steps):  # the chunk's states, after each of its tokens
            t = start + k
            u, dt_raw, dt, b, c, doc = _token(u_ptr, dt_ptr, b_ptr, c_ptr, seq_ptr, bias, t,
                                              offs_d, offs_n, mask_d, mask_n, stride_ut,
                                              stride_dtt, stride_bt, stride_ct, HAS_BIAS,
                                              SOFTPLUS, HAS_SEQ)
            if HAS_SEQ:
                h = tl.where(doc == previous, h, 0.0)
                previous = doc.to(tl.int64)
            h = tl.exp(dt[:, None] * a) * h + (dt * u)[:, None] * b[None, :]
            tl.store(scratch_ptr + k * BLOCK_D * BLOCK_N + local, h)
        for k_from_end in range(steps):
            k = steps - 1 - k_from_end
            t = start + k
            u, dt_raw, dt, b, c, doc = _token(u_ptr, dt_ptr, b_ptr, c_ptr, seq_ptr, bias, t,
                                              offs_d, offs_n, mask_d, mask_n, stride_ut,
                                              stride_dtt, stride_bt, stride_ct, HAS_BIAS,
                                              SOFTPLUS, HAS_SEQ)
            h_t = tl.load(scratch_ptr + k * BLOCK_D * BLOCK_N + local)
            h_before = (tl.load(scratch_ptr + (k - 1) * BLOCK_D * BLOCK_N + local,
                                mask=(k > 0) & (local >= 0), other=0.0)
                        + tl.load(entering_ptr + state_offs, mask=mask_dn & (k == 0),
                                  other=0.0))
            if HAS_SEQ:  # whether the state before t enters t
                keep = doc == tl.load(seq_ptr + t - 1, mask=t > 0, other=0)
                h_before = tl.where(keep, h_before, 0.0)
            dout = tl.load(dout_ptr + dense + t * channels + offs_d, mask=mask_d,
                           other=0.0).to(tl.float32)
            dy = dout
            if HAS_Z:
                z = tl.load(z_ptr + row * stride_zb + t * stride_zt + offs_d, mask=mask_d,
                            other=0.0).to(tl.float32)
                sig = tl.sigmoid(z)
                y = tl.sum(h_t * c[None, :], axis=1) + skip * u
                tl.store(dz_ptr + dense + t * channels + offs_d,
                         dout * y * sig * (1.0 + z * (1.0 - sig)), mask=mask_d)
                dy = dout * z * sig
            g += dy[:, None] * c[None, :]
            tl.store(dc_part_ptr + part + t * state_size + offs_n,
                     tl.sum(dy[:, None] * h_t, axis=0), mask=mask_n)
            tl.store(db_part_ptr + part + t * state_size + offs_n,
                     tl.sum(g * (dt * u)[:, None], axis=0), mask=mask_n)
            decay = tl.exp(dt[:, None] * a)
            g_decay = g * h_before * decay  # d loss / d (dt A), before the sum over n
            g_b = tl.sum(g * b[None, :], axis=1)
            ddt = u * g_b + tl.sum(g_decay * a, axis=1)
            if SOFTPLUS:
                ddt = ddt * tl.sigmoid(dt_raw)
            da += g_decay * dt[:, None]
            dskip += dy * u
            dbias += ddt
            tl.store(du_ptr + dense + t * channels + offs_d, dt * g_b + skip * dy, mask=mask_d)
            tl.store(ddt_ptr + dense + t * channels + offs_d, ddt, mask=mask_d)
            g = g * decay
            if HAS_SEQ:
                g = tl.where(keep, g, 0.0)
    if HAS_INIT:
        tl.store(dinit_ptr + row * channels * state_size + state_offs, g, mask=mask_dn)
    tl.store(da_part_ptr + row * channels * state_size + state_offs, da, mask=mask_dn)
    tl.store(dd_part_ptr + row * channels + offs_d, dskip, mask=mask_d)
    tl.store(dbias_part_ptr + row * channels + offs_d, dbias, mask=mask_d)


def _grid(u: torch.Tensor) -> tuple[int, int]:
    return u.shape[0], triton.cdiv(u.shape[2], BLOCK_D)


def _flags(D, z, dt_bias, seq_idx, initial_state, softplus: bool) -> dict:
    return dict(SOFTPLUS=softplus, HAS_D=D is not None, HAS_Z=z is not None,
                HAS_BIAS=dt_bias is not None, HAS_SEQ=seq_idx is not None,
                HAS_INIT=initial_state is not None)


def _strides(u, dt, B, C, z, seq_idx) -> tuple[int, ...]:
    return (*u.stride()[:2], *dt.stride()[:2], *B.stride()[:2], *C.stride()[:2],
            *(z.stride()[:2] if z is not None else (0, 0)),
            seq_idx.stride(0) if seq_idx is not None else 0)


def _tile_sizes(A: torch.Tensor) -> dict:
    return dict(BLOCK_D=BLOCK_D, BLOCK_N=triton.next_power_of_2(A.shape[1]), CHUNK=CHUNK)


def scan_forward(u, dt, A, B, C, D, z, dt_bias, seq_idx, initial_state, softplus: bool):
    """(y [b, t, d] in u's dtype, final state [b, d, n] and chunk_states, float32)."""
    batch, length, channels = u.shape
    out = torch.empty_like(u, memory_format=torch.contiguous_format)
    final = u.new_empty(batch, channels, A.shape[1], dtype=torch.float32)
    chunks = u.new_empty(batch, triton.cdiv(length, CHUNK), channels, A.shape[1],
                         dtype=torch.float32)
    _scan_fwd_kernel[_grid(u)](
        u, dt, A, B, C, D, z, dt_bias, seq_idx, initial_state, out, final, chunks,
        length, channels, A.shape[1], *_strides(u, dt, B, C, z, seq_idx), *out.stride()[:2],
        **_tile_sizes(A), **_flags(D, z, dt_bias, seq_idx, initial_state, softplus))
    return out, final, chunks


def scan_backward(dout, dfinal, u, dt, A, B, C, D, z, dt_bias, seq_idx, initial_state, chunks,
                  softplus: bool):
    """(du, ddt, dA, dB, dC, dD, dz, ddt_bias, dinitial_state), None for an absent input."""
    batch, length, channels = u.shape
    state_size = A.shape[1]
    blocks = triton.cdiv(channels, BLOCK_D)
    sizes = _tile_sizes(A)
    f32 = dict(dtype=torch.float32, device=u.device)
    du, ddt = torch.empty(batch, length, channels, **f32), torch.empty(batch, length, channels,
                                                                       **f32)
    dz = torch.empty(batch, length, channels, **f32) if z is not None else None
    db_part = torch.empty(batch, blocks, length, state_size, **f32)
    dc_part = torch.empty(batch, blocks, length, state_size, **f32)
    da_part = torch.empty(batch, channels, state_size, **f32)
    dd_part, dbias_part = torch.empty(batch, channels, **f32), torch.empty(batch, channels, **f32)
    dinit = torch.empty(batch, channels, state_size, **f32) if initial_state is not None else None
    scratch = torch.empty(batch * blocks * CHUNK * sizes["BLOCK_D"] * sizes["BLOCK_N"], **f32)
    _scan_bwd_kernel[_grid(u)](
        u, dt, A, B, C, D, z, dt_bias, seq_idx, dout.contiguous(), dfinal, chunks, scratch,
        du, ddt, dz, db_part, dc_part, da_part, dd_part, dbias_part, dinit,
        length, channels, state_size, *_strides(u, dt, B, C, z, seq_idx), **sizes,
        **_flags(D, z, dt_bias, seq_idx, initial_state, softplus), HAS_DFINAL=dfinal is not None)
    like = (lambda grad, tensor: None if tensor is None else grad.to(tensor.dtype))
    return (like(du, u), like(ddt, dt), like(da_part.sum(0), A), like(db_part.sum(1), B),
            like(dc_part.sum(1), C), like(dd_part.sum(0), D), like(dz, z),
            like(dbias_part.sum(0), dt_bias), like(dinit, initial_state))


@kernel_op("triton_selective_scan_fwd", saved_by_selective_ac=True)
def _scan_fwd(u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
              C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None,
              dt_bias: torch.Tensor | None, seq_idx: torch.Tensor | None,
              initial_state: torch.Tensor | None,
              softplus: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return scan_forward(u, dt, A, B, C, D, z, dt_bias, seq_idx, initial_state, softplus)


@_scan_fwd.register_fake
def _(u, dt, A, B, C, D, z, dt_bias, seq_idx, initial_state, softplus):
    batch, length, channels = u.shape
    return (u.new_empty(u.shape), u.new_empty(batch, channels, A.shape[1], dtype=torch.float32),
            u.new_empty(batch, triton.cdiv(length, CHUNK), channels, A.shape[1],
                        dtype=torch.float32))


@kernel_op("triton_selective_scan_bwd")
def _scan_bwd(dout: torch.Tensor, dfinal: torch.Tensor | None, u: torch.Tensor,
              dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
              D: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None,
              seq_idx: torch.Tensor | None, initial_state: torch.Tensor | None,
              chunks: torch.Tensor, softplus: bool) -> list[torch.Tensor]:
    """The gradients of (u, dt, A, B, C, D, z, dt_bias, initial_state); an absent input's is an
    empty tensor (a custom op returns no None)."""
    grads = scan_backward(dout, dfinal, u, dt, A, B, C, D, z, dt_bias, seq_idx, initial_state,
                          chunks, softplus)
    return [u.new_empty(0) if grad is None else grad for grad in grads]


@_scan_bwd.register_fake
def _(dout, dfinal, u, dt, A, B, C, D, z, dt_bias, seq_idx, initial_state, chunks, softplus):
    return [u.new_empty(0) if tensor is None else torch.empty_like(tensor)
            for tensor in (u, dt, A, B, C, D, z, dt_bias, initial_state)]


def _setup_context(ctx, inputs, output):
    *tensors, ctx.softplus = inputs
    ctx.save_for_backward(*tensors, output[2])


def _backward(ctx, dout, dfinal, _dchunks):
    u, dt, A, B, C, D, z, dt_bias, seq_idx, initial_state, chunks = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(u)
    grads = _scan_bwd(dout, dfinal, u, dt, A, B, C, D, z, dt_bias, seq_idx, initial_state,
                      chunks, ctx.softplus)
    present = (u, dt, A, B, C, D, z, dt_bias, initial_state)
    du, ddt, dA, dB, dC, dD, dz, dbias, dinit = (
        None if tensor is None else grad for grad, tensor in zip(grads, present, strict=True))
    return du, ddt, dA, dB, dC, dD, dz, dbias, None, dinit, None


_scan_fwd.register_autograd(_backward, setup_context=_setup_context)


def _dense_rows(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A [b, t, x] tensor whose last dimension is contiguous (what the kernels index)."""
    return tensor if tensor is None or tensor.stride(-1) == 1 else tensor.contiguous()


def selective_scan_triton(u_BTD, dt_BTD, A_DN, B_BTN, C_BTN, D=None, z_BTD=None, dt_bias=None,
                          dt_softplus=False, seq_idx=None, initial_state=None,
                          return_final_state=False):
    """The selective scan through our Triton kernels (see the module docstring)."""
    y, final, _ = _scan_fwd(
        _dense_rows(u_BTD), _dense_rows(dt_BTD), A_DN.contiguous(), _dense_rows(B_BTN),
        _dense_rows(C_BTN), None if D is None else D.contiguous(), _dense_rows(z_BTD),
        None if dt_bias is None else dt_bias.contiguous(),
        None if seq_idx is None else seq_idx.to(torch.int32).contiguous(),
        None if initial_state is None else initial_state.contiguous(), dt_softplus)
    return (y, final) if return_final_state else y

"""Mamba-3's SISO scan on mamba_ssm's Triton kernels (2.3.2.post1), as torch.library custom ops.

mamba_ssm's kernels take more of the layer than our torch path does (ops/mamba3_scan.py): the
B / C biases, the angles' running sum (tanh(angles) * pi * dt) and the rotation happen inside,
and z's gate too. `mamba3_siso(...)` takes the layer's tensors at that point: C and B normed
[B, T, G, N], x [B, T, H, P], dt and the log decay [B, T, H], the trapezoid before its sigmoid
[B, T, H], the biases [H, N], the angles [B, T, S], D, z [B, T, H, P] or None; packed documents
as `seq_idx`. It returns y [B, T, H, P] in x's dtype.

As mamba_ssm's own module does, q, k, x, z, the trapezoid and the angles enter the kernels in
bfloat16 on a GPU (the forward keeps the chunks' states in bfloat16, and the backward takes
nothing else); in Triton's interpreter (tests, CPU) in their own dtype, since the interpreter
multiplies bf16 bit patterns. Documents become mamba_ssm's `cu_seqlens`: the rows are laid end
to end as one row, cut at each row's and each document's first token. The backward is mamba_ssm's
(_Mamba3Function.backward, its steps called one by one), without entering or final states.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titan_hybrid.compat import kernel_packages
from titan_hybrid.ops.custom_ops import kernel_op


def sequence_starts(seq_idx_BT: torch.Tensor | None) -> torch.Tensor | None:
    """mamba_ssm's cu_seqlens (int32) for packed documents, the rows laid end to end: each
    row's first token and each document's first token start a sequence. None without
    documents (the kernels take the rows as a batch)."""
    if seq_idx_BT is None:
        return None
    starts = F.pad(seq_idx_BT[:, 1:] != seq_idx_BT[:, :-1], (1, 0), value=True)
    positions = starts.flatten().nonzero().flatten()
    end = positions.new_tensor([starts.numel()])
    return torch.cat([positions, end]).to(torch.int32)


def kernel_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.bfloat16 if x.is_cuda else x.dtype


def one_row(tensor: torch.Tensor | None, cu_seqlens) -> torch.Tensor | None:
    """[B, T, ...] -> [1, B*T, ...] when the rows are laid end to end."""
    if tensor is None or cu_seqlens is None:
        return tensor
    return tensor.reshape(1, -1, *tensor.shape[2:])


def per_head_time(tensor: torch.Tensor, cu_seqlens) -> torch.Tensor:
    """[B, T, H] -> mamba_ssm's [B, H, T] (one row when the rows are laid end to end)."""
    return one_row(tensor, cu_seqlens).transpose(1, 2).contiguous()


def like_input(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A gradient in mamba_ssm's layout (one row with documents) -> the input's shape and
    dtype."""
    return grad.reshape(like.shape).to(like.dtype)


def from_per_head_time(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[B or 1, H, T] -> the input's [B, T, H] and dtype."""
    return grad.transpose(1, 2).reshape(like.shape).to(like.dtype)


def angles_gradient(grad_BTHS: torch.Tensor, angles_BTS: torch.Tensor) -> torch.Tensor:
    """The angles' gradient: mamba_ssm's per head [B or 1, T, H, S], summed over the heads that
    share them."""
    b, t, s = angles_BTS.shape
    return grad_BTHS.reshape(b, t, -1, s).sum(2).to(angles_BTS.dtype)


def _kernel_inputs(C, B, x, dt, trap, angles, z, seq_idx):
    """What both directions pass mamba_ssm, in its layouts and dtypes: (cu_seqlens, q, k, v,
    dt, the trapezoid, the angles per head, z or None)."""
    b, t, h, _ = x.shape
    cu_seqlens = sequence_starts(seq_idx)
    low = kernel_dtype(x)
    q, k, v = (one_row(tensor.to(low), cu_seqlens).contiguous() for tensor in (C, B, x))
    gate = None if z is None else one_row(z.to(low), cu_seqlens).contiguous()
    step, trap_ = (per_head_time(tensor, cu_seqlens) for tensor in (dt.float(), trap.to(low)))
    angle = one_row(angles.to(low)[:, :, None].expand(b, t, h, -1), cu_seqlens).contiguous()
    return cu_seqlens, q, k, v, step, trap_, angle, gate


@kernel_op("mamba3_siso_fwd", saved_by_selective_ac=True)
def _forward(C: torch.Tensor, B: torch.Tensor, x: torch.Tensor, log_decay: torch.Tensor,
             dt: torch.Tensor, trap: torch.Tensor, C_bias: torch.Tensor, B_bias: torch.Tensor,
             angles: torch.Tensor, D: torch.Tensor, z: torch.Tensor | None,
             seq_idx: torch.Tensor | None, chunk_size: int) -> list[torch.Tensor]:
    """[y, *the residuals]: y [B, T, H, P] in x's dtype, then the angles' running sum, the
    output before the gate, the chunks' states, the cumulative log decays and their sums, q
    rotated, k rotated and scaled, q . k, the trapezoid's scale and gamma (mamba_ssm's)."""
    cu_seqlens, q, k, v, step, trap_, angle, gate = _kernel_inputs(C, B, x, dt, trap, angles,
                                                                   z, seq_idx)
    adt = per_head_time(log_decay.float(), cu_seqlens)
    cumulative = kernel_packages.mamba3_angles_fwd(angle, step, chunk_size=chunk_size,
                                                   cu_seqlens=cu_seqlens)
    out, *residuals, _ = kernel_packages.mamba3_siso_fwd(
        q, k, v, adt, step, trap_, C_bias.float(), B_bias.float(), cumulative, D.float(), gate,
        chunk_size=chunk_size, store_states_adt_outv=True, cu_seqlens=cu_seqlens)
    return [out.reshape(x.shape).to(x.dtype), cumulative, *residuals]


@_forward.register_fake
def _(C, B, x, log_decay, dt, trap, C_bias, B_bias, angles, D, z, seq_idx, chunk_size):
    b, t, h, p = x.shape
    n, low = C.shape[-1], kernel_dtype(x)
    if seq_idx is None:
        chunks = -(-t // chunk_size)
    else:  # one row; the kernel's chunks restart at each sequence: as many as the data says
        b, t = 1, b * t
        chunks = torch.library.get_ctx().new_dynamic_size()
    per_head_time = x.new_empty(b, h, t, dtype=torch.float32)
    return [torch.empty_like(x), x.new_empty(b, t, h, angles.shape[-1], dtype=low),
            x.new_empty(b, t, h, p, dtype=low),
            x.new_empty(b, h, p, chunks * n, dtype=torch.bfloat16),
            torch.empty_like(per_head_time), x.new_empty(b, h, chunks, dtype=torch.float32),
            x.new_empty(b, t, h, n, dtype=low), x.new_empty(b, t, h, n, dtype=low),
            torch.empty_like(per_head_time), torch.empty_like(per_head_time),
            torch.empty_like(per_head_time)]


@kernel_op("mamba3_siso_bwd")
def _backward(dy: torch.Tensor, C: torch.Tensor, B: torch.Tensor, x: torch.Tensor,
              dt: torch.Tensor, trap: torch.Tensor, C_bias: torch.Tensor, B_bias: torch.Tensor,
              angles: torch.Tensor, D: torch.Tensor, z: torch.Tensor | None,
              seq_idx: torch.Tensor | None, chunk_size: int,
              residuals: list[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients of C, B, x, the log decay, dt, the trapezoid, the biases, the angles, D
    and z (empty without z), each in its input's dtype."""
    (cumulative, out_before_gate, states, decay_cumsum, decay_sums, q_rotated, k_scaled,
     qk_dot, scale, gamma) = residuals
    cu_seqlens, q, k, v, step, trap_, angle, gate = _kernel_inputs(C, B, x, dt, trap, angles,
                                                                   z, seq_idx)
    do = one_row(dy.to(kernel_dtype(x)), cu_seqlens).contiguous()
    dz = None
    if z is not None:
        dz, do = kernel_packages.mamba3_siso_bwd_dz(do, gate, out_before_gate,
                                                    chunk_size=chunk_size)
    dq_mid, dk_mid, dv, dadt, dqk, dD, _ = kernel_packages.mamba3_siso_bwd_dqkv(
        q=q_rotated, k=k_scaled, v=v, da_cs=decay_cumsum, da_cs_sum=decay_sums,
        qk_dot=qk_dot, SSM_States=states.to(q_rotated.dtype), do=do, D=D.float(),
        chunk_size=chunk_size,
        Cu_Seqlens=cu_seqlens)
    dq, dk, dC_bias, dB_bias, dcumulative, dscale, dgamma = (
        kernel_packages.mamba3_siso_bwd_rotation(
            q=q, k=k, scale=scale, gamma=gamma, q_bias=C_bias.float(), k_bias=B_bias.float(),
            angles=cumulative, dq_in=dq_mid, dk_in=dk_mid, dqk=dqk, chunk_size=chunk_size,
            Cu_Seqlens=cu_seqlens))
    ddt, dtrap, *_ = kernel_packages.mamba3_siso_bwd_steps(
        dscale=dscale, dgamma=dgamma, dt=step, trap=trap_.float(), Cu_Seqlens=cu_seqlens)
    dangle, ddt_angles, _ = kernel_packages.mamba3_angles_bwd(
        grad_out=dcumulative, angle=angle, dt=step, chunk_size=chunk_size,
        cu_seqlens=cu_seqlens)
    return [like_input(dq, C), like_input(dk, B), like_input(dv, x),
            from_per_head_time(dadt, dt), from_per_head_time(ddt + ddt_angles, dt),
            from_per_head_time(dtrap, trap), dC_bias.to(C_bias.dtype), dB_bias.to(B_bias.dtype),
            angles_gradient(dangle, angles), dD.to(D.dtype),
            x.new_empty(0) if dz is None else like_input(dz, z)]


@_backward.register_fake
def _(dy, C, B, x, dt, trap, C_bias, B_bias, angles, D, z, seq_idx, chunk_size, residuals):
    likes = (C, B, x, dt, dt, trap, C_bias, B_bias, angles, D)
    return [torch.empty_like(like) for like in likes] + [
        x.new_empty(0) if z is None else torch.empty_like(z)]


def _setup_context(ctx, inputs, output):
    C, B, x, _, dt, trap, C_bias, B_bias, angles, D, z, seq_idx, ctx.chunk_size = inputs
    ctx.has_z = z is not None
    ctx.save_for_backward(C, B, x, dt, trap, C_bias, B_bias, angles, D, z, seq_idx,
                          *output[1:])


def _autograd_backward(ctx, grads):
    dy = grads[0]  # the op returns one list: y, then residuals, which take no gradient
    C, B, x, dt, trap, C_bias, B_bias, angles, D, z, seq_idx, *residuals = ctx.saved_tensors
    (dC, dB, dx, dlog_decay, ddt, dtrap, dC_bias, dB_bias, dangles, dD, dz) = _backward(
        dy, C, B, x, dt, trap, C_bias, B_bias, angles, D, z, seq_idx, ctx.chunk_size,
        residuals)
    return (dC, dB, dx, dlog_decay, ddt, dtrap, dC_bias, dB_bias, dangles, dD,
            dz if ctx.has_z else None, None, None)


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def mamba3_siso(C_BTGN: torch.Tensor, B_BTGN: torch.Tensor, x_BTHP: torch.Tensor,
                log_decay_BTH: torch.Tensor, dt_BTH: torch.Tensor, trap_BTH: torch.Tensor,
                C_bias_HN: torch.Tensor, B_bias_HN: torch.Tensor, angles_BTS: torch.Tensor,
                D_H: torch.Tensor, z_BTHP: torch.Tensor | None, seq_idx_BT: torch.Tensor | None,
                chunk_size: int) -> torch.Tensor:
    """y [B, T, H, P] (see the module docstring)."""
    return _forward(C_BTGN, B_BTGN, x_BTHP, log_decay_BTH, dt_BTH, trap_BTH, C_bias_HN,
                    B_bias_HN, angles_BTS, D_H, z_BTHP, seq_idx_BT, chunk_size)[0]

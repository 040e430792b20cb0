"""Mamba-3's MIMO scan on mamba_ssm's TileLang kernels (2.3.2.post1, tilelang 0.1.8), as
torch.library custom ops.

As for SISO (ops/mamba3_kernel.py), the kernels take more of the layer than our torch path does:
the B / C biases, the angles' running sum and the rotation, x's up-projection by mimo_x, and
(without the output norm) z's gate by mimo_z and the read-out by mimo_o happen inside.
`mamba3_mimo(...)` takes the layer's tensors at that point: C and B normed [B, T, R, G, N], x
[B, T, H, P], the log decay and dt [B, T, H], the trapezoid before its sigmoid [B, T, H], the
biases [H, R, N], mimo_x / mimo_z / mimo_o [H, R, P] (mimo_o None with the output norm, and
then z None too: y is [B, T, R, H, P], one output per rank), the angles [B, T, S], D, z
[B, T, H, P]; packed documents as `seq_idx`. It returns y [B, T, H, P] in x's dtype.

The kernels run chunks of `chunk_size` tokens (mamba_ssm recommends 64 / R: their shared memory
holds chunk_size * R rows); the caller picks it (model/mamba3.py). Their backward supports one
group, or one per head, and without documents a length that is a multiple of the chunk, and
TileLang may fail to compile sizes mamba_ssm did not test: the caller takes the torch path for
those. As mamba_ssm's module does, q, k, x, z and the trapezoid enter in bfloat16 on a GPU; on
CPU (tests: tests/triton_kernels.py's stand-in for the TileLang kernels) in their own dtype.
Documents become mamba_ssm's cu_seqlens, the rows laid end to end. The backward is mamba_ssm's
(its _Mamba3Function.backward, its steps called one by one), without entering or final states.
"""

from __future__ import annotations

import torch

from titan_hybrid.compat import kernel_packages
from titan_hybrid.ops.custom_ops import kernel_op
from titan_hybrid.ops.mamba3_kernel import (
    angles_gradient,
    from_per_head_time,
    kernel_dtype,
    like_input,
    one_row,
    per_head_time,
    sequence_starts,
)


def _dense_or_varlen(dense: kernel_packages.Launcher, varlen: kernel_packages.Launcher,
                     cu_seqlens, named: dict):
    """The dense launcher, or with packed documents its _varlen twin (the same positional
    parameters, then cu_seqlens), called with the arguments in `named`."""
    args = [named[name] for name in dense.positional]
    return dense(*args) if cu_seqlens is None else varlen(*args, cu_seqlens=cu_seqlens)


def _decays(log_decay, cu_seqlens, chunk_size):
    """mamba_ssm's chunk decay sums of the log decay [B, T, H]: (cumulative, reverse,
    segment sums)."""
    adt = per_head_time(log_decay.float(), cu_seqlens)
    return _dense_or_varlen(kernel_packages.mamba3_mimo_decays,
                            kernel_packages.mamba3_mimo_decays_varlen, cu_seqlens,
                            dict(da=adt, chunk_size=chunk_size))


def _kernel_args(C, B, x, log_decay, dt, trap, C_bias, B_bias, mimo_x, mimo_z, mimo_o,
                 angles, D, z, seq_idx, chunk_size):
    """What both directions pass mamba_ssm, in its layouts and dtypes: (cu_seqlens, the angles
    per head in float32, the kernels' arguments by name but the angles' running sum and
    dout)."""
    b, t, h, _ = x.shape
    cu_seqlens = sequence_starts(seq_idx)
    low = kernel_dtype(x)
    q, k, v = (one_row(tensor.to(low), cu_seqlens).contiguous() for tensor in (C, B, x))
    da_cs, da_cs_rev, segsum = _decays(log_decay, cu_seqlens, chunk_size)
    named = dict(q=q, k=k, v=v, q_bias=C_bias.float(), k_bias=B_bias.float(),
                 mimo_v=mimo_x.float(), mimo_o=None if mimo_o is None else mimo_o.float(),
                 z=None if z is None else one_row(z.to(low), cu_seqlens).contiguous(),
                 D=D.float(), mimo_z=mimo_z.float(), dA_cs=da_cs, dA_cs_rev=da_cs_rev,
                 dt=per_head_time(dt.float(), cu_seqlens),
                 trap=per_head_time(trap.to(low), cu_seqlens), segsum=segsum)
    angle = one_row(angles.float()[:, :, None].expand(b, t, h, -1), cu_seqlens).contiguous()
    return cu_seqlens, angle, named


@kernel_op("mamba3_mimo_fwd", saved_by_selective_ac=True)
def _forward(C: torch.Tensor, B: torch.Tensor, x: torch.Tensor, log_decay: torch.Tensor,
             dt: torch.Tensor, trap: torch.Tensor, C_bias: torch.Tensor, B_bias: torch.Tensor,
             mimo_x: torch.Tensor, mimo_z: torch.Tensor, mimo_o: torch.Tensor | None,
             angles: torch.Tensor, D: torch.Tensor, z: torch.Tensor | None,
             seq_idx: torch.Tensor | None, chunk_size: int,
             rotary_dim_divisor: int) -> list[torch.Tensor]:
    """[y, the angles' running sum]: y [B, T, H, P] (or [B, T, R, H, P] without mimo_o) in x's
    dtype; the running sum is what the backward needs besides the inputs."""
    cu_seqlens, angle, named = _kernel_args(C, B, x, log_decay, dt, trap, C_bias, B_bias,
                                            mimo_x, mimo_z, mimo_o, angles, D, z, seq_idx,
                                            chunk_size)
    cumulative = kernel_packages.mamba3_angles_fwd(angle, named["dt"], chunk_size=chunk_size,
                                                   cu_seqlens=cu_seqlens)
    out, _, _ = _dense_or_varlen(
        kernel_packages.mamba3_mimo_fwd, kernel_packages.mamba3_mimo_fwd_varlen, cu_seqlens,
        dict(named, angles=cumulative, chunk_size=chunk_size,
             rotary_dim_divisor=rotary_dim_divisor, dtype=named["q"].dtype))
    return [out.reshape(_output_shape(x, C, mimo_o)).to(x.dtype), cumulative]


def _output_shape(x, C, mimo_o) -> tuple[int, ...]:
    b, t, h, p = x.shape
    return (b, t, h, p) if mimo_o is not None else (b, t, C.shape[2], h, p)


@_forward.register_fake
def _(C, B, x, log_decay, dt, trap, C_bias, B_bias, mimo_x, mimo_z, mimo_o, angles, D, z,
      seq_idx, chunk_size, rotary_dim_divisor):
    b, t, h, _ = x.shape
    if seq_idx is not None:  # one row
        b, t = 1, b * t
    return [x.new_empty(_output_shape(x, C, mimo_o)),
            x.new_empty(b, t, h, angles.shape[-1], dtype=torch.float32)]


@kernel_op("mamba3_mimo_bwd")
def _backward(dy: torch.Tensor, C: torch.Tensor, B: torch.Tensor, x: torch.Tensor,
              log_decay: torch.Tensor, dt: torch.Tensor, trap: torch.Tensor,
              C_bias: torch.Tensor, B_bias: torch.Tensor, mimo_x: torch.Tensor,
              mimo_z: torch.Tensor, mimo_o: torch.Tensor | None, angles: torch.Tensor,
              D: torch.Tensor, z: torch.Tensor | None, seq_idx: torch.Tensor | None,
              chunk_size: int, rotary_dim_divisor: int,
              cumulative: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of C, B, x, the log decay, dt, the trapezoid, the biases, mimo_x, mimo_z,
    mimo_o (empty without it), the angles, D and z (empty without it), each in its input's
    dtype."""
    cu_seqlens, angle, named = _kernel_args(C, B, x, log_decay, dt, trap, C_bias, B_bias,
                                            mimo_x, mimo_z, mimo_o, angles, D, z, seq_idx,
                                            chunk_size)
    low = named["q"].dtype
    (dq, dk, dv, dadt, ddt, dtrap, dC_bias, dB_bias, dmimo_x, dmimo_z, dmimo_o, dcumulative,
     dD, dz) = _dense_or_varlen(
        kernel_packages.mamba3_mimo_bwd, kernel_packages.mamba3_mimo_bwd_varlen, cu_seqlens,
        dict(named, dout=one_row(dy.to(low), cu_seqlens).contiguous(), angles=cumulative,
             chunk_size=chunk_size, rotary_dim_divisor=rotary_dim_divisor, dtype=low))
    dangle, ddt_angles, _ = kernel_packages.mamba3_angles_bwd(
        grad_out=dcumulative, angle=angle, dt=named["dt"], chunk_size=chunk_size,
        cu_seqlens=cu_seqlens)
    return [like_input(dq, C), like_input(dk, B), like_input(dv, x),
            from_per_head_time(dadt, log_decay), from_per_head_time(ddt + ddt_angles, dt),
            from_per_head_time(dtrap, trap), dC_bias.to(C_bias.dtype), dB_bias.to(B_bias.dtype),
            dmimo_x.to(mimo_x.dtype), dmimo_z.to(mimo_z.dtype) if z is not None
            else torch.zeros_like(mimo_z),
            x.new_empty(0) if mimo_o is None else dmimo_o.to(mimo_o.dtype),
            angles_gradient(dangle, angles), dD.to(D.dtype),
            x.new_empty(0) if z is None else like_input(dz, z)]


@_backward.register_fake
def _(dy, C, B, x, log_decay, dt, trap, C_bias, B_bias, mimo_x, mimo_z, mimo_o, angles, D, z,
      seq_idx, chunk_size, rotary_dim_divisor, cumulative):
    likes = (C, B, x, log_decay, dt, trap, C_bias, B_bias, mimo_x, mimo_z)
    return [torch.empty_like(like) for like in likes] + [
        x.new_empty(0) if mimo_o is None else torch.empty_like(mimo_o),
        torch.empty_like(angles), torch.empty_like(D),
        x.new_empty(0) if z is None else torch.empty_like(z)]


_TENSOR_INPUTS = 14  # C ... z, which take gradients (seq_idx and the two ints do not)


def _setup_context(ctx, inputs, output):
    *tensors, seq_idx, ctx.chunk_size, ctx.rotary_dim_divisor = inputs
    ctx.absent = [tensor is None for tensor in tensors]
    ctx.save_for_backward(*tensors, seq_idx, output[1])


def _autograd_backward(ctx, grads):
    dy = grads[0]  # the op returns one list: y, then the running sum, which takes no gradient
    *tensors, seq_idx, cumulative = ctx.saved_tensors
    gradients = _backward(dy, *tensors, seq_idx, ctx.chunk_size, ctx.rotary_dim_divisor,
                          cumulative)
    return (*(None if absent else gradient
              for gradient, absent in zip(gradients, ctx.absent, strict=True)),
            None, None, None)


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def mamba3_mimo(C_BTRGN: torch.Tensor, B_BTRGN: torch.Tensor, x_BTHP: torch.Tensor,
                log_decay_BTH: torch.Tensor, dt_BTH: torch.Tensor, trap_BTH: torch.Tensor,
                C_bias_HRN: torch.Tensor, B_bias_HRN: torch.Tensor, mimo_x_HRP: torch.Tensor,
                mimo_z_HRP: torch.Tensor, mimo_o_HRP: torch.Tensor | None,
                angles_BTS: torch.Tensor, D_H: torch.Tensor, z_BTHP: torch.Tensor | None,
                seq_idx_BT: torch.Tensor | None, chunk_size: int,
                rotary_dim_divisor: int) -> torch.Tensor:
    """y [B, T, H, P], or [B, T, R, H, P] without mimo_o (see the module docstring)."""
    return _forward(C_BTRGN, B_BTRGN, x_BTHP, log_decay_BTH, dt_BTH, trap_BTH, C_bias_HRN,
                    B_bias_HRN, mimo_x_HRP, mimo_z_HRP, mimo_o_HRP, angles_BTS, D_H, z_BTHP,
                    seq_idx_BT, chunk_size, rotary_dim_divisor)[0]

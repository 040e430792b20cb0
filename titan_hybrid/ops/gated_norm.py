"""Gated, grouped RMS norms with the RMS over groups of channels:

- Mamba2's: ``norm(y * silu(z)) * weight`` (``norm_before_gate=False``);
- gated DeltaNet's: ``norm(y) * weight * silu(z)`` (``norm_before_gate=True``, one group per head).

``gated_group_rms_norm`` calls mamba_ssm's Triton kernel (``mamba_ssm.ops.triton.layernorm_gated``,
which does both orders) when ``titan_hybrid.ops.kernels.use_kernel`` says so (CUDA tensors, or
inside ``force_kernels()``), else ``gated_group_rms_norm_torch``.

Shapes: y, z ``[..., c]``; weight ``[c]``; c a multiple of group_size. y and z may be strided views
(slices of a projection's output): the kernel reads rows with their own stride, so they are not
copied as long as their channels are contiguous. The output has y's dtype; the arithmetic is
float32 (float64 for float64 inputs) on both paths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titan_hybrid.compat import kernel_packages
from titan_hybrid.ops.custom_ops import kernel_op
from titan_hybrid.ops.kernels import use_kernel


def gated_group_rms_norm_torch(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, *,
                               group_size: int, eps: float,
                               norm_before_gate: bool = False) -> torch.Tensor:
    compute = torch.promote_types(y.dtype, torch.float32)  # mean of squares loses bits in bf16
    gate = F.silu(z.to(compute))
    normed = y.to(compute) if norm_before_gate else y.to(compute) * gate
    normed = F.rms_norm(normed.unflatten(-1, (-1, group_size)), (group_size,), eps=eps)
    normed = normed.flatten(-2) * weight.to(compute)
    return (normed * gate if norm_before_gate else normed).to(y.dtype)


def gated_group_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, *,
                         group_size: int, eps: float,
                         norm_before_gate: bool = False) -> torch.Tensor:
    channels = y.shape[-1]
    if channels % group_size != 0:
        raise ValueError(f"gated norm: {channels} channels is not a multiple of group_size "
                         f"{group_size}")
    if z.shape != y.shape or weight.shape != (channels,):
        raise ValueError(f"gated norm: y {tuple(y.shape)}, z {tuple(z.shape)} and weight "
                         f"{tuple(weight.shape)} do not match")
    if use_kernel(y, "mamba_ssm"):
        out, _ = _norm_fwd(_rows(y), _rows(z), weight.contiguous(), eps, group_size,
                           norm_before_gate)
        return out.view(y.shape)
    return gated_group_rms_norm_torch(y, z, weight, group_size=group_size, eps=eps,
                                      norm_before_gate=norm_before_gate)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[rows, channels] with contiguous channels, as the kernel reads them: a view when x's
    leading dims merge (a slice of a projection's output does), else a copy."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


# ---- mamba_ssm's kernel as torch.library custom ops (opaque to torch.compile). Its forward and
# backward launchers (what its own LayerNormFn calls; private in mamba_ssm, so reached through
# titan_hybrid.compat.kernel_packages) are used directly: the backward needs only y, z, weight
# and the saved rstd.

@kernel_op("gated_rms_norm_fwd")
def _norm_fwd(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
              group_size: int, norm_before_gate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out, _, rstd = kernel_packages.gated_rms_norm_fwd(
        y, weight, None, eps, z=z, group_size=group_size, norm_before_gate=norm_before_gate,
        is_rms_norm=True)
    return out, rstd


@_norm_fwd.register_fake
def _(y, z, weight, eps, group_size, norm_before_gate):
    # Rows with contiguous channels are contiguous or strided; the kernel's empty_like gives
    # contiguous outputs for both.
    return y.new_empty(y.shape), y.new_empty(y.numel() // group_size, dtype=torch.float32)


@kernel_op("gated_rms_norm_bwd")
def _norm_bwd(dout: torch.Tensor, y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
              rstd: torch.Tensor, eps: float, group_size: int,
              norm_before_gate: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dy, dweight, _, dz = kernel_packages.gated_rms_norm_bwd(
        dout.contiguous(), y, weight, None, eps, None, rstd, z=z, group_size=group_size,
        norm_before_gate=norm_before_gate, is_rms_norm=True, dz=None)
    return dy, dweight, dz


@_norm_bwd.register_fake
def _(dout, y, z, weight, rstd, eps, group_size, norm_before_gate):
    return y.new_empty(y.shape), torch.empty_like(weight), z.new_empty(z.shape)


def _norm_setup_context(ctx, inputs, output):
    y, z, weight, ctx.eps, ctx.group_size, ctx.norm_before_gate = inputs
    ctx.save_for_backward(y, z, weight, output[1])


def _norm_backward(ctx, dout, _drstd):
    y, z, weight, rstd = ctx.saved_tensors
    dy, dweight, dz = _norm_bwd(dout, y, z, weight, rstd, ctx.eps, ctx.group_size,
                                ctx.norm_before_gate)
    return dy, dz, dweight, None, None, None


_norm_fwd.register_autograd(_norm_backward, setup_context=_norm_setup_context)

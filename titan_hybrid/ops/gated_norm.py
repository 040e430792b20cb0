"""Mamba2's gated, grouped RMS norm: norm(y * silu(z)) * weight, RMS over groups of channels.

``gated_group_rms_norm`` calls mamba_ssm's Triton kernel (``mamba_ssm.ops.triton.layernorm_gated``,
``rmsnorm_fn(..., norm_before_gate=False)``) when ``titan_hybrid.ops.kernels.use_kernel`` says
so (CUDA tensors, or inside ``force_kernels()``), else ``gated_group_rms_norm_torch``.

Shapes: y, z ``[..., c]``; weight ``[c]``; c a multiple of group_size. The output has y's dtype;
the arithmetic is float32 (float64 for float64 inputs) on both paths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titan_hybrid.ops.kernels import use_kernel


def gated_group_rms_norm_torch(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, *,
                               group_size: int, eps: float) -> torch.Tensor:
    compute = torch.promote_types(y.dtype, torch.float32)  # mean of squares loses bits in bf16
    gated = y.to(compute) * F.silu(z.to(compute))
    grouped = gated.unflatten(-1, (-1, group_size))
    normed = F.rms_norm(grouped, (group_size,), eps=eps).flatten(-2)
    return (normed * weight.to(compute)).to(y.dtype)


def gated_group_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, *,
                         group_size: int, eps: float) -> torch.Tensor:
    channels = y.shape[-1]
    if channels % group_size != 0:
        raise ValueError(f"gated norm: {channels} channels is not a multiple of group_size "
                         f"{group_size}")
    if z.shape != y.shape or weight.shape != (channels,):
        raise ValueError(f"gated norm: y {tuple(y.shape)}, z {tuple(z.shape)} and weight "
                         f"{tuple(weight.shape)} do not match")
    if use_kernel(y, "mamba_ssm"):
        # The kernel takes rows of contiguous channels.
        y_2d = y.reshape(-1, channels).contiguous()
        z_2d = z.reshape(-1, channels).contiguous()
        out, _ = _norm_fwd(y_2d, z_2d, weight.contiguous(), eps, group_size)
        return out.view(y.shape)
    return gated_group_rms_norm_torch(y, z, weight, group_size=group_size, eps=eps)


# ---- mamba_ssm's kernel as torch.library custom ops (opaque to torch.compile). Its forward and
# backward launchers (mamba_ssm 2.3.2's _layer_norm_fwd / _layer_norm_bwd, what its own
# LayerNormFn calls) are used directly: the backward needs only y, z, weight and the saved rstd.

@torch.library.custom_op("titan_hybrid::gated_rms_norm_fwd", mutates_args=())
def _norm_fwd(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
              group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    from mamba_ssm.ops.triton.layernorm_gated import _layer_norm_fwd
    out, _, rstd = _layer_norm_fwd(y, weight, None, eps, z=z, group_size=group_size,
                                   norm_before_gate=False, is_rms_norm=True)
    return out, rstd


@_norm_fwd.register_fake
def _(y, z, weight, eps, group_size):
    return torch.empty_like(y), y.new_empty(y.numel() // group_size, dtype=torch.float32)


@torch.library.custom_op("titan_hybrid::gated_rms_norm_bwd", mutates_args=())
def _norm_bwd(dout: torch.Tensor, y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
              rstd: torch.Tensor, eps: float,
              group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from mamba_ssm.ops.triton.layernorm_gated import _layer_norm_bwd
    dy, dweight, _, dz = _layer_norm_bwd(dout.contiguous(), y, weight, None, eps, None, rstd,
                                         z=z, group_size=group_size, norm_before_gate=False,
                                         is_rms_norm=True)
    return dy, dweight, dz


@_norm_bwd.register_fake
def _(dout, y, z, weight, rstd, eps, group_size):
    return torch.empty_like(y), torch.empty_like(weight), torch.empty_like(z)


def _norm_setup_context(ctx, inputs, output):
    y, z, weight, ctx.eps, ctx.group_size = inputs
    ctx.save_for_backward(y, z, weight, output[1])


def _norm_backward(ctx, dout, _drstd):
    y, z, weight, rstd = ctx.saved_tensors
    dy, dweight, dz = _norm_bwd(dout, y, z, weight, rstd, ctx.eps, ctx.group_size)
    return dy, dz, dweight, None, None


_norm_fwd.register_autograd(_norm_backward, setup_context=_norm_setup_context)

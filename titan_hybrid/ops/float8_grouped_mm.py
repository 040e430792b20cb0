"""Float8 grouped GEMMs, the routed experts' under FP8 training (torchtitan's
`quantize.grouped_mm.float8`): `out[rows of group g] = a[rows of g] @ b[g]`, with every GEMM's
operands, in forward and in both gradients, cast to float8 e4m3 with one power-of-2 scale per
row of the GEMM's contraction (torchao's rowwise recipe, which its MoE training uses too):

    GEMM               first operand                       second operand
    out = a @ b[g]     a [M, K]: per row, over K           b[g] [K, N]: per column, over K
    grad_a             grad [M, N]: per row, over N        b[g]^T: per column, over N
    grad_b[g]          a_g^T: per column, over g's rows    grad_g: per column, over g's rows

Emulated: each operand is cast to float8 and back and the GEMM runs in the operands' own dtype
(F.grouped_mm), so the rounding is float8's and the arithmetic the high-precision one; this is
the CPU path and the tests'. (The GPU's float8 grouped GEMM, torch's scaled grouped matmul on
SM90+, is not wired in: a run asks for `emulate`, training/float8.py.) Shapes as F.grouped_mm's
2D x 3D case; `offs` [G] int32: each group's end row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FLOAT8 = torch.float8_e4m3fn


def float8_round_trip(t: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """`t` cast to float8 e4m3 and back, scaled by the power of 2 at or below e4m3's largest
    value over `amax` (broadcast against `t`: one scale per row, column or group)."""
    largest = torch.finfo(FLOAT8).max
    scale = torch.exp2(torch.floor(torch.log2(largest / amax.float().clamp(min=1e-12))))
    cast = (t.float() * scale).clamp(-largest, largest).to(FLOAT8)
    return (cast.float() / scale).to(t.dtype)


def _per_row(t: torch.Tensor, dim: int) -> torch.Tensor:
    return float8_round_trip(t, t.abs().amax(dim=dim, keepdim=True))


def _per_group_column(t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`t` [M, C] rounded with one scale per (group of rows, column)."""
    rows = torch.arange(t.shape[0], device=t.device)
    group = torch.searchsorted(offs, rows, right=True).clamp(max=offs.numel() - 1)
    amax = t.new_zeros(offs.numel(), t.shape[1]).scatter_reduce(
        0, group[:, None].expand_as(t), t.abs(), reduce="amax")
    return float8_round_trip(t, amax[group])


class _Float8GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b, offs)
        return F.grouped_mm(_per_row(a, -1), _per_row(b, -2), offs=offs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b, offs = ctx.saved_tensors
        grad = grad.contiguous()
        grad_a = F.grouped_mm(_per_row(grad, -1), _per_row(b, -1).transpose(-2, -1),
                              offs=offs)
        grad_b = F.grouped_mm(_per_group_column(a, offs).t(), _per_group_column(grad, offs),
                              offs=offs)
        return grad_a, grad_b, None


def float8_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """F.grouped_mm(a, b, offs=offs) [M, N] with its GEMMs' operands in float8 (rowwise)."""
    return _Float8GroupedMM.apply(a, b, offs)

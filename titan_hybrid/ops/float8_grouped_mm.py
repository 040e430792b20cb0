"""Float8 grouped GEMMs, the routed experts' under FP8 training (torchtitan's
`quantize.grouped_mm.float8`): `out[rows of group g] = a[rows of g] @ b[g]`, with every GEMM's
operands, in forward and in both gradients, cast to float8 e4m3 with one power-of-2 scale per
row of the GEMM's contraction (torchao's rowwise recipe, which its MoE training uses too):

    GEMM               first operand                       second operand
    out = a @ b[g]     a [M, K]: per row, over K           b[g] [K, N]: per column, over K
    grad_a             grad [M, N]: per row, over N        b[g]^T: per column, over N
    grad_b[g]          a_g^T: per column, over g's rows    grad_g: per column, over g's rows

Two paths with the same rounding:
- emulated: each operand is cast to float8 and back and the GEMM runs in the operands' own
  dtype (F.grouped_mm), so the arithmetic is the high-precision one. Pure torch: it compiles
  into the layer's graph. The CPU tests' path.
- float8: each expert's GEMM takes the float8 operands themselves (torch's scaled matmul, on a
  GPU's float8 units, or the CPU's kernel) and accumulates in float32; the power-of-2 scales
  are divided out after, which is exact. A GEMM's contraction and output widths are padded
  with zeros to multiples of 16, which float8 GEMM units need. The loop over experts reads the
  group ends on the host, so it sits inside custom ops that torch.compile sees as one node
  each. (torch's one-kernel scaled grouped matmul on SM90 would save the loop's launches; it
  has no CPU kernel to test it against, and is not used yet.)

Shapes as F.grouped_mm's 2D x 3D case; `offs` [G] int32: each group's end row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titan_hybrid.compat.aten_ops import float8_matmul
from titan_hybrid.ops.custom_ops import kernel_op

FLOAT8 = torch.float8_e4m3fn
ALIGNMENT = 16  # float8 GEMM units take widths (and leading dimensions) in multiples of 16


def float8_scale(amax: torch.Tensor) -> torch.Tensor:
    """The power of 2 at or below e4m3's largest value over `amax` (float32)."""
    largest = torch.finfo(FLOAT8).max
    return torch.exp2(torch.floor(torch.log2(largest / amax.float().clamp(min=1e-12))))


def to_float8(t: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`t` scaled into e4m3's range and cast, and the scale (`amax` broadcasts against `t`:
    one scale per row, column or group)."""
    scale = float8_scale(amax)
    largest = torch.finfo(FLOAT8).max
    return (t.float() * scale).clamp(-largest, largest).to(FLOAT8), scale


def float8_round_trip(t: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """`t` cast to float8 e4m3 and back, with `to_float8`'s scales."""
    cast, scale = to_float8(t, amax)
    return (cast.float() / scale).to(t.dtype)


def _padded(t: torch.Tensor, dim: int) -> torch.Tensor:
    """`t` with zeros appended along `dim` up to a multiple of ALIGNMENT (itself if it is one)."""
    missing = -t.shape[dim] % ALIGNMENT
    if not missing:
        return t
    pad = [0, 0] * (t.dim() - dim % t.dim() - 1) + [0, missing]
    return F.pad(t, pad)


def _scaled_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` [m, n] in float32 from float8 operands, `a` [m, k] scaled per row over k and `b`
    [k, n] per column over k (zeros pad k and n, then the padding columns are dropped)."""
    n = b.shape[1]
    a, b = _padded(a, 1), _padded(_padded(b, 0), 1)
    a_fp8, a_scale = to_float8(a, a.abs().amax(1, keepdim=True))
    b_fp8, b_scale = to_float8(b.t().contiguous(), b.abs().amax(0)[:, None])
    return (float8_matmul(a_fp8, b_fp8.t()) / (a_scale * b_scale.t()))[:, :n]


def _group_bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()
    return list(zip([0] + ends[:-1], ends))


@kernel_op("float8_grouped_products")
def _float8_products(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """out[rows of g] = a[rows of g] @ b[g], each in float8 (a per row, b[g] per column)."""
    out = a.new_zeros(a.shape[0], b.shape[-1])
    for group, (start, end) in enumerate(_group_bounds(offs)):
        if end > start:
            out[start:end] = _scaled_product(a[start:end], b[group]).to(out.dtype)
    return out


@_float8_products.register_fake
def _(a, b, offs):
    return a.new_empty(a.shape[0], b.shape[-1])


@kernel_op("float8_grouped_weight_grads")
def _float8_weight_grads(a: torch.Tensor, grad: torch.Tensor,
                         offs: torch.Tensor) -> torch.Tensor:
    """grad_b[g] = a[rows of g]^T @ grad[rows of g], each in float8 with one scale per column
    over g's rows; zero for an empty group."""
    out = a.new_zeros(offs.numel(), a.shape[1], grad.shape[1])
    for group, (start, end) in enumerate(_group_bounds(offs)):
        if end > start:
            a_rows, grad_rows = _padded(a[start:end], 0), _padded(grad[start:end], 0)
            out[group] = _scaled_product(a_rows.t(), grad_rows).to(out.dtype)
    return out


@_float8_weight_grads.register_fake
def _(a, grad, offs):
    return a.new_empty(offs.numel(), a.shape[1], grad.shape[1])


def _per_row(t: torch.Tensor, dim: int) -> torch.Tensor:
    return float8_round_trip(t, t.abs().amax(dim=dim, keepdim=True))


def _per_group_column(t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`t` [M, C] rounded with one scale per (group of rows, column)."""
    rows = torch.arange(t.shape[0], device=t.device)
    group = torch.searchsorted(offs, rows, right=True).clamp(max=offs.numel() - 1)
    amax = t.new_zeros(offs.numel(), t.shape[1]).scatter_reduce(
        0, group[:, None].expand_as(t), t.abs(), reduce="amax")
    return float8_round_trip(t, amax[group])


def _products(a, b, offs, emulate: bool) -> torch.Tensor:
    if emulate:
        return F.grouped_mm(_per_row(a, -1), _per_row(b, -2), offs=offs)
    return _float8_products(a, b, offs)


def _weight_grads(a, grad, offs, emulate: bool) -> torch.Tensor:
    if emulate:
        return F.grouped_mm(_per_group_column(a, offs).t(), _per_group_column(grad, offs),
                            offs=offs)
    return _float8_weight_grads(a, grad, offs)


class _Float8GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
                emulate: bool) -> torch.Tensor:
        ctx.save_for_backward(a, b, offs)
        ctx.emulate = emulate
        return _products(a, b, offs, emulate)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b, offs = ctx.saved_tensors
        grad = grad.contiguous()
        grad_a = _products(grad, b.transpose(-2, -1), offs, ctx.emulate)
        return grad_a, _weight_grads(a, grad, offs, ctx.emulate), None, None


def float8_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, *,
                      emulate: bool) -> torch.Tensor:
    """F.grouped_mm(a, b, offs=offs) [M, N] with its GEMMs' operands in float8 (rowwise);
    `emulate`: float8's rounding with high-precision arithmetic (see the module's doc)."""
    return _Float8GroupedMM.apply(a, b, offs, emulate)

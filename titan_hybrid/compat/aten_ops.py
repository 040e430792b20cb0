"""aten / c10d operators known only by private names: the ones selective activation
checkpointing keeps (parallel/activation_checkpoint.py). The attention kernels that
F.scaled_dot_product_attention dispatches to, grouped_mm's operator, the functional
reduce-scatter and `Tensor.to`'s copy (which a host offload runs) have no public op handle; a
policy must name the op it sees. Checked on torch 2.11 and 2.13-2.15 (native_functions.yaml of
each has every one).
"""

from __future__ import annotations

import torch

import titan_hybrid.compat  # noqa: F401  (the version check)

ATTENTION_OPS = (
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_attention_math.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
)
GROUPED_MM_OP = torch.ops.aten._grouped_mm.default
REDUCE_SCATTER_OP = torch.ops._c10d_functional.reduce_scatter_tensor.default
TO_COPY_OP = torch.ops.aten._to_copy.default


def float8_matmul(a_fp8: torch.Tensor, b_fp8: torch.Tensor) -> torch.Tensor:
    """`a_fp8 @ b_fp8` in float32 on float8 GEMM units (CUDA SM89+) or the CPU's kernel: torch's
    scaled matmul with unit scales, the one form every checked torch runs on CPU too (2.11's
    CPU kernel refuses row scales; the caller applies its own). `a_fp8` row-major, `b_fp8`
    column-major. No public op takes float8 operands in all of torch 2.11-2.15."""
    one = torch.ones((), dtype=torch.float32, device=a_fp8.device)
    return torch._scaled_mm(a_fp8, b_fp8, one, one, out_dtype=torch.float32)

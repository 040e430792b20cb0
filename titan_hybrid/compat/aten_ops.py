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

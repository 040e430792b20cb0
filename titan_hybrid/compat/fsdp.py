"""FSDP2 internals: its DDP (`replicate`) and its choice of reduce op.

Checked on torch 2.11 and 2.13-2.15 (`replicate` and `_get_gradient_divide_factors` take the
same arguments, and the divide factors follow the same rules, in all four).
"""

from __future__ import annotations

import functools

# Private module: FSDP2's replication (DDP built on fully_shard's machinery: the same units,
# MixedPrecisionPolicy and FSDPModule methods that data_parallel.py uses for every strategy)
# has no public import path in 2.11 and 2.13-2.15. The public DistributedDataParallel wraps the
# module (another module tree and other state-dict keys) and has none of that per-unit API.
from torch.distributed._composable.replicate_with_fsdp import replicate

import titan_hybrid.compat  # noqa: F401  (the version check)

__all__ = ["force_sum_reduction_on_cpu", "replicate"]

_sum_on_cpu_applied = False


def force_sum_reduction_on_cpu() -> None:
    """Make FSDP2 reduce gradients with plain SUM on CPU (a patch: applied only by
    titan_hybrid.runtime.cpu.apply(); later calls do nothing).

    torchtitan sets `gradient_divide_factor=1.0`, which FSDP2 turns into ReduceOp.PREMUL_SUM;
    gloo rejects that op. FSDP2 forces SUM itself for MTIA, and per module through
    `FSDPModule.set_force_sum_reduction_for_comms`, but torchtitan's own parallelize functions
    do not call that, so the decision point is patched: the private
    `torch.distributed.fsdp._fully_shard._fsdp_collectives._get_gradient_divide_factors` (module
    global, looked up at call time) with `force_sum_reduction_for_comms=True` for device "cpu".
    The divide then happens locally: the same arithmetic.
    """
    global _sum_on_cpu_applied
    if _sum_on_cpu_applied:
        return
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as collectives

    original = collectives._get_gradient_divide_factors

    @functools.wraps(original)
    def sum_on_cpu(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type="",
                   factor=None, force_sum_reduction_for_comms=False):
        if device_type == "cpu":
            force_sum_reduction_for_comms = True
        return original(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type,
                        factor, force_sum_reduction_for_comms)

    collectives._get_gradient_divide_factors = sum_on_cpu
    _sum_on_cpu_applied = True

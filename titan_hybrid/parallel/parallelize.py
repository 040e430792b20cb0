"""torchtitan's parallelize_fn for HybridModel: applies parallelisms in torchtitan's order
(TP/SP -> EP -> activation checkpointing -> compile -> data parallel)."""

from __future__ import annotations

from torch import nn

from torchtitan.config import TORCH_DTYPE_MAP, JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.tools.logging import logger

from titan_hybrid.parallel.fsdp import apply_fsdp
from titan_hybrid.parallel.init import full_tensor_materializer


def validate_parallelism(model: nn.Module, parallel_dims: ParallelDims,
                         job_config: JobConfig) -> None:
    """User errors for layouts this release cannot run, raised before any allocation."""
    unsupported = {
        "tensor_parallel_degree": parallel_dims.tp,
        "context_parallel_degree": parallel_dims.cp,
        "expert_parallel_degree": parallel_dims.ep,
        "pipeline_parallel_degree": parallel_dims.pp,
    }
    for field, degree in unsupported.items():
        if degree > 1:
            raise ValueError(f"parallelism.{field}={degree}: titan_hybrid does not support this "
                             "parallelism yet; only data parallel (FSDP / HSDP) is available")
    if parallel_dims.dp_replicate_enabled and not parallel_dims.fsdp_enabled:
        raise ValueError(
            f"parallelism.data_parallel_replicate_degree={parallel_dims.dp_replicate} without "
            "sharding (pure DDP) is not supported yet: use data_parallel_shard_degree")
    if job_config.compile.enable:
        raise ValueError("compile.enable=true is not supported for the hybrid model yet")


def parallelize_hybrid(model: nn.Module, parallel_dims: ParallelDims,
                       job_config: JobConfig) -> nn.Module:
    validate_parallelism(model, parallel_dims, job_config)
    if job_config.activation_checkpoint.mode != "none":
        apply_ac(model, job_config.activation_checkpoint,
                 base_folder=job_config.job.dump_folder)
    if parallel_dims.fsdp_enabled:
        dp_mesh_names = (("dp_replicate", "fsdp") if parallel_dims.dp_replicate_enabled
                         else ("fsdp",))
        apply_fsdp(
            model,
            parallel_dims.get_mesh(list(dp_mesh_names)),
            param_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce],
            cpu_offload=job_config.training.enable_cpu_offload,
        )
        logger.info(f"Applied FSDP over {dp_mesh_names}")
    model.init_materializer = full_tensor_materializer
    return model

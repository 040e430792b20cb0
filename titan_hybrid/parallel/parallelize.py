"""Parallelizing a HybridModel: applies parallelisms in torchtitan's order
(TP/SP -> CP -> EP -> activation checkpointing -> compile -> data parallel) and returns the
ParallelPlan the builders after it take (the TrainSpec's parallelize_fn is train_spec.py's
HybridBuild.parallelize, which keeps it)."""

from __future__ import annotations

import functools
from typing import Protocol

from torch import nn
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger

from titan_hybrid.compat.device_mesh import split_dimensions
from titan_hybrid.config.sections import (
    ActivationCheckpointSection,
    CompileSection,
    Float8Section,
    ParallelismSection,
    TrainingSection,
)
from titan_hybrid.model.common import tensor_parallel_layouts
from titan_hybrid.parallel.activation_checkpoint import apply_activation_checkpointing
from titan_hybrid.parallel.compile import apply_compile
from titan_hybrid.parallel.context_parallel import apply_context_parallel
from titan_hybrid.parallel.data_parallel import apply_data_parallel
from titan_hybrid.parallel.ep_overlap import install_overlap_hooks
from titan_hybrid.parallel.expert_parallel import apply_expert_parallel
from titan_hybrid.parallel.plan import ParallelPlan
from titan_hybrid.parallel.tensor_parallel import apply_tensor_parallel
from titan_hybrid.quantize.float8 import apply_float8, float8_summary


class ParallelizeJob(Protocol):
    """What parallelizing reads of a run (the RunConfig has it)."""
    parallelism: ParallelismSection
    training: TrainingSection
    compile: CompileSection
    activation_checkpoint: ActivationCheckpointSection
    float8: Float8Section
    dump_folder: str


def data_parallel_plan(parallel_dims: ParallelDims, strategy: str):
    """(strategy, mesh): FSDP / HSDP shard over ("dp_replicate", "fsdp"), where "fsdp" also
    spans the CP ranks (they hold the same parameters and each computes gradients from its own
    part of the sequences); the replicate-based strategies reduce over every data-parallel and
    CP rank. With nothing to shard over, parameter sharding falls back to plain replication."""
    if strategy in ("optim_grads", "optim_grads_params") and not parallel_dims.fsdp_enabled:
        strategy = "no_shard"
    if strategy in ("no_shard", "optim"):
        return strategy, parallel_dims.get_mesh("loss" if parallel_dims.cp_enabled else "batch")
    shard = shard_dimension(parallel_dims)
    if parallel_dims.dp_replicate_enabled:
        return strategy, parallel_dims.get_mesh(["dp_replicate", shard])
    return strategy, parallel_dims.get_mesh(shard)


def shard_dimension(parallel_dims: ParallelDims) -> str:
    """The mesh dimension FSDP shards over: torchtitan's "fsdp" (the data-parallel shards
    times the CP ranks). torchtitan 0.3's default SPMD backend, spmd_types, has no such
    dimension, only "dp_shard" and "cp" apart: there FSDP shards over "dp_shard", which is the
    same ranks without CP (model_spec.py refuses CP on that backend)."""
    backend = getattr(parallel_dims, "spmd_backend", "partial_dtensor")
    return "fsdp" if backend == "partial_dtensor" else "dp_shard"


def expert_meshes(parallel_dims: ParallelDims):
    """(the mesh experts are split over: "ep", with TP ("ep", "etp"); the ranks holding the
    same experts: "efsdp", with HSDP's replicas), or (None, None) without EP."""
    pd = parallel_dims
    if not pd.ep_enabled:
        return None, None
    if pd.tp_enabled and not hasattr(pd, "etp"):
        return _expert_meshes_beside_tp(
            pd.world_mesh, (pd.pp, pd.dp_replicate, pd.dp_shard * pd.cp // pd.ep, pd.ep, pd.tp),
            pd.dp_replicate_enabled)
    ep_mesh = pd.get_mesh(["ep", "etp"] if pd.tp_enabled else "ep")
    return ep_mesh, pd.get_mesh(["dp_replicate", "efsdp"] if pd.dp_replicate_enabled else "efsdp")


@functools.lru_cache(maxsize=None)
def _expert_meshes_beside_tp(world_mesh, sizes: tuple[int, ...], replicated: bool):
    """torchtitan 0.3's EP borrows TP ranks and has no "etp". titan_hybrid's experts keep their
    TP split (expert TP = TP, as under 0.2 and in Megatron), so EP takes its ranks from the
    data-parallel ones, as 0.2 built it: the world mesh split into (pp, dp_replicate, efsdp, ep,
    etp). Built once per world mesh: a pipeline rank parallelizes each of its stages."""
    names = ("pp", "dp_replicate", "efsdp", "ep", "etp")
    trivial = tuple(n for n, size in zip(names, sizes) if size == 1 and n != "efsdp")
    mesh = split_dimensions(world_mesh, sizes, names, without_groups=trivial)
    return mesh["ep", "etp"], mesh["dp_replicate", "efsdp"] if replicated else mesh["efsdp"]


def parallelize_hybrid(model: nn.Module, parallel_dims: ParallelDims,
                       run: ParallelizeJob) -> ParallelPlan:
    """Parallelize `model` (a whole model or one pipeline stage, on the meta device) in place,
    for a run whose layout has been validated (parallel/validate.py)."""
    sequence_parallel = not run.parallelism.disable_sequence_parallel
    converted = apply_float8(model, run.float8)  # the same Parameters: the plan holds
    if converted:
        logger.info(float8_summary(model, run.float8, converted))
    plan = ParallelPlan(layouts=tensor_parallel_layouts(model))
    if parallel_dims.tp_enabled:
        # Loss parallel needs plain logits; MoE / MTP outputs are tuples with scalars.
        plain_logits = not model.has_aux_loss and not len(model.mtp)
        plan.partial_grads = apply_tensor_parallel(
            model, parallel_dims.get_mesh("tp"), plan.layouts,
            sequence_parallel=sequence_parallel,
            loss_parallel=plain_logits and not run.parallelism.disable_loss_parallel)
        logger.info(f"Applied tensor parallel (sequence parallel: "
                    f"{sequence_parallel})")
    if parallel_dims.cp_enabled:
        linear_mode = run.parallelism.context_parallel_linear_mode
        apply_context_parallel(model, parallel_dims.get_mesh("cp").get_group(), linear_mode)
        logger.info(f"Applied context parallel over {parallel_dims.cp} ranks (zigzag; Mamba2 "
                    f"/ GDN / KDA: {linear_mode})")
    if parallel_dims.ep_enabled:
        plan.expert_dispatchers = apply_expert_parallel(model, expert_meshes(parallel_dims)[0])
        logger.info(f"Applied expert parallel over {parallel_dims.ep} ranks")
    compile_model = run.compile.enable and "model" in run.compile.components
    if run.activation_checkpoint.mode != "none":
        logger.info("Applied " + apply_activation_checkpointing(
            model, run.activation_checkpoint, model_compile_enabled=compile_model,
            base_folder=run.dump_folder))
    if compile_model:
        # Data parallelism will give the recurrent layers' projections bf16 units of their own.
        split_precision = (parallel_dims.dp_cp_enabled
                           and run.training.mixed_precision_param != "float32")
        # bf16 parameters under data parallelism, bf16 autocast on one device (torchtitan)
        bf16_compute = run.training.mixed_precision_param == "bfloat16"
        apply_compile(model, run.compile, split_precision=split_precision,
                      bf16_compute=bf16_compute, expert_parallel=parallel_dims.ep_enabled)
        logger.info(f"Compiled each layer / bracket group (backend {run.compile.backend})")
    if parallel_dims.dp_cp_enabled:
        strategy, dp_mesh = data_parallel_plan(
            parallel_dims, run.parallelism.data_parallel_sharding_strategy)
        apply_data_parallel(
            model,
            dp_mesh,
            strategy=strategy,
            param_dtype=TORCH_DTYPE_MAP[run.training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[run.training.mixed_precision_reduce],
            cpu_offload=run.training.enable_cpu_offload,
            expert_mesh=expert_meshes(parallel_dims)[1],
        )
        # The optimizer builder shards the optimizer state over it (ZeRO-1).
        plan.zero1_mesh = dp_mesh if strategy == "optim" else None
        logger.info(f"Applied data parallel '{strategy}' over {dp_mesh.mesh_dim_names}")
    if run.parallelism.expert_parallel_overlap and not parallel_dims.pp_enabled:
        # Under PP: pipeline_hybrid, once for all local stages.
        plan.overlap = install_overlap_hooks([model], plan.expert_dispatchers.values())
    return plan

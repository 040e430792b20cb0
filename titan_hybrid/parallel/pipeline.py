"""Pipeline parallelism: torchtitan's `pipelining_fn` for HybridModel.

Stages come from the pattern (pipeline_split.pipeline_stages): with `|` segments, segment
`virtual_stage * pp_size + pp_rank` is a stage; without them the layers are split evenly, never
through a bracket group. The embedding lives on the first stage; the final norm, the LM head and
the MTP depths on the last (the MTP depths' future-token embeddings are computed on the first
stage and passed along, see HybridModel.forward). Each stage is a copy of the model with the
other stages' parts removed, parallelized like a whole model, and driven by one of torch's
schedules (GPipe, 1F1B, Interleaved1F1B, the zero-bubble variants, DualPipeV).

torchtitan's pipeline path back-propagates the summed loss of each microbatch; here the loss
function divides by the step's global valid-token count, so gradients equal the non-pipelined
ones. The schedule is built with that loss function (GlobalTokenScaledLoss) as its `loss_fn`,
and the trainer sets the count on it before each step (`scaled_loss_of(schedule)`). torch's
`scale_grads` divides by the number of microbatches, not by tokens, so it stays off; the
schedules' `loss_kwargs` could carry the count, but the runtime does not hand them to custom
actions (the EP-overlap's OVERLAP_F_B computes losses too).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    ScheduleDualPipeV,
    ScheduleZBVZeroBubble,
    get_schedule_class,
)
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.pipeline_parallel import (
    build_pipeline_schedule,
    pipeline_module_split,
)
from torchtitan.tools.logging import logger

from titan_hybrid.compat import pipelining
from titan_hybrid.job_config import hybrid_job
from titan_hybrid.model.args import HybridModelArgs
from titan_hybrid.model.dsa import DeepSeekSparseAttention
from titan_hybrid.model.moe import MoE
from titan_hybrid.parallel.ep_overlap import install_overlap_hooks
from titan_hybrid.parallel.ep_overlap_pipeline import overlap_pipeline_schedule
from titan_hybrid.parallel.pipeline_split import pipeline_stages
from titan_hybrid.parallel.tensor_parallel import record_param_layouts


def stages_per_rank(job_config: JobConfig, model_args: HybridModelArgs) -> int:
    """Virtual stages per rank: set by `|` segments when the pattern has them, else 1 for
    single-stage schedules and 2 (V-shaped schedules: exactly 2) for looped ones, unless
    parallelism.pipeline_parallel_layers_per_stage says otherwise."""
    parallelism = job_config.parallelism
    pp = parallelism.pipeline_parallel_degree
    schedule = get_schedule_class(parallelism.pipeline_parallel_schedule)
    single = issubclass(schedule, PipelineScheduleSingle)
    pattern = model_args.parsed_pattern
    if len(pattern.segments) > 1:
        count = len(pattern.segments) // pp if len(pattern.segments) % pp == 0 else 0
    elif parallelism.pipeline_parallel_layers_per_stage:
        per_stage = parallelism.pipeline_parallel_layers_per_stage
        count = pattern.num_physical_layers // (per_stage * pp)
        if count * per_stage * pp != pattern.num_physical_layers:
            raise ValueError(
                f"parallelism.pipeline_parallel_layers_per_stage={per_stage}: the "
                f"{pattern.num_physical_layers} physical layers of '{model_args.pattern}' are not "
                f"a multiple of layers_per_stage * pipeline_parallel_degree={per_stage * pp}")
    else:
        count = 1 if single else 2
    if single and count != 1:
        raise ValueError(
            f"parallelism.pipeline_parallel_schedule '{parallelism.pipeline_parallel_schedule}' "
            f"runs one stage per rank, but the pattern / layers_per_stage give {count}; use a "
            "looped schedule (e.g. Interleaved1F1B) or fewer '|' segments")
    if schedule in (ScheduleZBVZeroBubble, ScheduleDualPipeV) and count != 2:
        raise ValueError(
            f"parallelism.pipeline_parallel_schedule '{parallelism.pipeline_parallel_schedule}' "
            f"needs exactly 2 stages per rank, the pattern gives {count}")
    if not single and count < 2:
        raise ValueError(
            f"parallelism.pipeline_parallel_schedule '{parallelism.pipeline_parallel_schedule}' "
            f"needs at least 2 stages per rank, the pattern gives {count}")
    return count


def module_names_per_stage(model_args: HybridModelArgs, pp: int,
                           virtual_stages: int) -> list[list[str]]:
    """The model's module names that each pipeline stage keeps, in stage order."""
    pattern = model_args.parsed_pattern
    stages = pipeline_stages(pattern, pp, virtual_stages)
    names = []
    for stage in stages:
        kept = [f"layers.{stage.first_logical_index + offset}" for offset in range(len(stage.items))]
        if stage.index == 0:
            kept.insert(0, "tok_embeddings")
        if stage.index == len(stages) - 1:
            kept += ["norm", "output"] + [f"mtp.{depth}" for depth in range(pattern.mtp_depths)]
        names.append(kept)
    return names


class GlobalTokenScaledLoss:
    """The per-microbatch loss divided by the step's global valid-token count, which
    HybridTrainer sets each step. torchtitan's own trainer sets none: there the microbatch
    losses pass through undivided, as with torchtitan's own pipeline loss (it divides their
    sum afterwards)."""

    def __init__(self, loss_fn) -> None:
        self.loss_fn = loss_fn
        self.global_valid_tokens: torch.Tensor | None = None

    def __call__(self, pred, labels):
        loss = self.loss_fn(pred, labels)
        return loss if self.global_valid_tokens is None else loss / self.global_valid_tokens


def scaled_loss_of(schedule) -> GlobalTokenScaledLoss:
    """The loss function of a schedule built by pipeline_hybrid: set its token count."""
    loss_fn = pipelining.loss_function(schedule)
    assert isinstance(loss_fn, GlobalTokenScaledLoss), type(loss_fn)
    return loss_fn


def _forget_metadata_inference_routing(stage) -> None:
    """torch's first schedule step runs each stage once on the first microbatch to learn the
    shapes it sends; that run must not count in the router (or DSA indexer) statistics of
    step 1."""

    def reset() -> None:
        for module in stage.submod.modules():
            if isinstance(module, MoE):
                module.reset_router_statistics()
            elif isinstance(module, DeepSeekSparseAttention):
                module.reset_indexer_statistics()

    pipelining.after_metadata_inference(stage, reset)


def pipeline_hybrid(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig,
                    device: torch.device, model_args: HybridModelArgs, parallelize_fn,
                    loss_fn):
    job_config = hybrid_job(job_config)
    pp_mesh = parallel_dims.get_mesh("pp")
    virtual = stages_per_rank(job_config, model_args)
    names = module_names_per_stage(model_args, parallel_dims.pp, virtual)
    for index, stage_names in enumerate(names):
        logger.info(f"Pipeline stage {index}: {stage_names}")
    record_param_layouts(model)  # before the stage copies lose the parameter annotations
    stages, model_parts = pipeline_module_split(
        model, pp_mesh, job_config.parallelism.pipeline_parallel_schedule, device, names)
    for index, part in enumerate(model_parts):
        model_parts[index] = parallelize_fn(part, parallel_dims, job_config)
        stages[index].submod = model_parts[index]
    for stage in stages:
        _forget_metadata_inference_routing(stage)
    scaled_loss = GlobalTokenScaledLoss(loss_fn)
    schedule = build_pipeline_schedule(job_config, stages, scaled_loss)
    if job_config.parallelism.expert_parallel_overlap:
        # One coordinator for this rank's stages: a pair may be a forward of one stage and a
        # backward of another (parallelize_hybrid leaves this to us under PP).
        coordinator = install_overlap_hooks(*model_parts)
        schedule = overlap_pipeline_schedule(schedule, stages,
                                             job_config.parallelism.pipeline_parallel_schedule,
                                             coordinator)
    return (schedule, model_parts, any(stage.is_first for stage in stages),
            any(stage.is_last for stage in stages))

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

from typing import Protocol

import torch
from torch import nn
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger

from titan_hybrid.compat import pipelining
from titan_hybrid.model.args import HybridModelArgs
from titan_hybrid.model.kind_counters import reset_statistics
from titan_hybrid.parallel.ep_overlap import install_overlap_hooks
from titan_hybrid.parallel.ep_overlap_pipeline import overlap_pipeline_schedule
from titan_hybrid.parallel.parallelize import ParallelizeJob, parallelize_hybrid
from titan_hybrid.parallel.pipeline_split import module_names_per_stage, stages_per_rank
from titan_hybrid.parallel.plan import ParallelPlan


class PipelineJob(ParallelizeJob, Protocol):
    """What pipelining reads of a run: parallelizing's, and the model args that the stages'
    split follows."""
    model: HybridModelArgs


class GlobalTokenScaledLoss:
    """The per-microbatch loss divided by the step's global valid-token count: the one
    torchtitan 0.3's schedule step passes (its `loss_kwargs`), else the one HybridTrainer sets
    each step (the EP-overlap's actions pass none). torchtitan 0.2's own trainer sets none:
    there the microbatch losses pass through undivided, as with its own pipeline loss (it
    divides their sum afterwards)."""

    def __init__(self, loss_fn) -> None:
        self.loss_fn = loss_fn
        self.global_valid_tokens: torch.Tensor | None = None

    def __call__(self, pred, labels, global_valid_tokens: torch.Tensor | None = None):
        loss = self.loss_fn(pred, labels)
        count = self.global_valid_tokens if global_valid_tokens is None else global_valid_tokens
        return loss if count is None else loss / count


def scaled_loss_of(schedule) -> GlobalTokenScaledLoss:
    """The loss function of a schedule built by pipeline_hybrid: set its token count."""
    loss_fn = pipelining.loss_function(schedule)
    assert isinstance(loss_fn, GlobalTokenScaledLoss), type(loss_fn)
    return loss_fn


def _forget_metadata_inference_routing(stage) -> None:
    """torch's first schedule step runs each stage once on the first microbatch to learn the
    shapes it sends; that run must not count in the layer kinds' statistics of step 1
    (titan_hybrid.training.kind_statistics)."""
    pipelining.after_metadata_inference(stage, lambda: reset_statistics([stage.submod]))


def pipeline_hybrid(model: nn.Module, parallel_dims: ParallelDims, run: PipelineJob,
                    device: torch.device, loss_fn, *, split_module, build_schedule):
    """Split `model` into this rank's stages and parallelize each. Returns torchtitan's
    (schedule, model parts, has first stage, has last stage) and this rank's ParallelPlan.

    The torchtitan adapter passes its version's helpers: `split_module(model, pp_mesh,
    schedule_name, device, module_names_per_stage)` gives (stages, model parts) and
    `build_schedule(stages, loss_fn)` the schedule."""
    pp_mesh = parallel_dims.get_mesh("pp")
    virtual = stages_per_rank(run.parallelism, run.model)
    names = module_names_per_stage(run.model, parallel_dims.pp, virtual)
    for index, stage_names in enumerate(names):
        logger.info(f"Pipeline stage {index}: {stage_names}")
    stages, model_parts = split_module(
        model, pp_mesh, run.parallelism.pipeline_parallel_schedule, device, names)
    plan = ParallelPlan()
    for part in model_parts:
        plan.add(parallelize_hybrid(part, parallel_dims, run))
    for stage in stages:
        _forget_metadata_inference_routing(stage)
    scaled_loss = GlobalTokenScaledLoss(loss_fn)
    schedule = build_schedule(stages, scaled_loss)
    if run.parallelism.expert_parallel_overlap:
        # One coordinator for this rank's stages: a pair may be a forward of one stage and a
        # backward of another (parallelize_hybrid leaves this to us under PP).
        plan.overlap = install_overlap_hooks(model_parts, plan.expert_dispatchers.values())
        schedule = overlap_pipeline_schedule(schedule, stages,
                                             run.parallelism.pipeline_parallel_schedule,
                                             plan.overlap)
    return (schedule, model_parts, any(stage.is_first for stage in stages),
            any(stage.is_last for stage in stages)), plan

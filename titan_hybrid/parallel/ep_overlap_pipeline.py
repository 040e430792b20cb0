"""EP-overlap inside pipeline schedules (PP > 1).

Each rank's compute order is taken from torch's schedule (1F1B runs as Interleaved1F1B with one
stage per rank, which gives the same order) and every backward that is directly followed by a
forward of another microbatch becomes one OVERLAP_F_B action. torch's pipelining runtime calls
`run_overlapped_action` for those: it waits for both inputs, then runs the forward on this
thread and the backward on a helper thread, taking turns at the all-to-alls exactly as the
PP = 1 schedule does (ep_overlap.py). The pair's sends go out after both have finished, so the
merged order is checked for progress before the first step: a merge that would make two ranks
wait on each other is refused with a ValueError, never left to hang.

torch's pipelining runtime, which runs custom actions, is private: every use of it goes through
titan_hybrid.compat.pipelining.
"""

from __future__ import annotations

import functools

from torch.distributed.pipelining.schedules import (
    FORWARD,
    FULL_BACKWARD,
    OVERLAP_F_B,
    Schedule1F1B,
    ScheduleInterleaved1F1B,
)
from torchtitan.tools.logging import logger

from titan_hybrid.compat import pipelining
from titan_hybrid.compat.pipelining import Action, PipelineContext, PipelineScheduleRuntime
from titan_hybrid.parallel.ep_overlap import OverlapCoordinator, run_forward_with_backward

# Pipeline schedules that parallelism.expert_parallel_overlap runs inside.
OVERLAP_SCHEDULES = ("1F1B", "Interleaved1F1B")


def merge_backward_forward_pairs(order: list[Action | None]) -> list[Action]:
    """One rank's compute actions with each (backward(i), forward(j)) neighbour pair, i != j,
    merged into OVERLAP_F_B(forward(j), backward(i)); idle slots dropped."""
    actions = [action for action in order if action is not None]
    merged: list[Action] = []
    index = 0
    while index < len(actions):
        action = actions[index]
        following = actions[index + 1] if index + 1 < len(actions) else None
        if (action.computation_type == FULL_BACKWARD and following is not None
                and following.computation_type == FORWARD
                and following.microbatch_index != action.microbatch_index):
            merged.append(Action(-1, OVERLAP_F_B, None, (following, action)))
            index += 2
        else:
            merged.append(action)
            index += 1
    return merged


def check_progress(merged: dict[int, list[Action]], stage_to_rank, num_stages: int) -> None:
    """Raise ValueError if the merged order cannot run: torch's lowering places each send and
    receive where its producer has run, and an overlapped pair only once both of its inputs
    can arrive, so it fails exactly when some ranks would wait on each other forever (see
    compat.pipelining.lowering_deadlocks for how its failure is read)."""
    if pipelining.lowering_deadlocks(merged, stage_to_rank, num_stages):
        raise ValueError(
            "parallelism.expert_parallel_overlap: pairing backwards with forwards in this "
            "pipeline schedule would deadlock; use more microbatches or run without the "
            "overlap")


def run_overlapped_action(action: Action, ctx: PipelineContext, *,
                          coordinator: OverlapCoordinator) -> None:
    """torch's custom function for OVERLAP_F_B: forward(j) here, backward(i) on the helper."""
    schedule = ctx.schedule_ref
    stages = {stage.stage_index: stage for stage in pipelining.local_stages(schedule)}
    forward_action, backward_action = action.sub_actions
    forward_stage = stages[forward_action.stage_index]
    backward_stage = stages[backward_action.stage_index]
    forward_mb, backward_mb = forward_action.microbatch_index, backward_action.microbatch_index
    forward_input_is_local = forward_stage.stage_index - 1 in stages
    backward_input_is_local = backward_stage.stage_index + 1 in stages
    if not forward_stage.is_first and not forward_input_is_local:
        pipelining.wait_for_input(schedule, forward_stage, forward_mb, backward=False)
    if not backward_stage.is_last and not backward_input_is_local:
        pipelining.wait_for_input(schedule, backward_stage, backward_mb, backward=True)
    pipelining.wait_until_unsharded(schedule, forward_stage)
    pipelining.wait_until_unsharded(schedule, backward_stage)

    def forward():
        output = forward_stage.forward_one_chunk(forward_mb, ctx.arg_mbs[forward_mb],
                                                 ctx.kwarg_mbs[forward_mb])
        pipelining.compute_loss(schedule, forward_stage, output, ctx, forward_mb)
        if forward_stage.stage_index + 1 in stages:
            stages[forward_stage.stage_index + 1].set_local_fwd_input(output, forward_mb)

    def backward():
        loss = pipelining.stored_loss(schedule, backward_stage, backward_mb)
        last = pipelining.count_full_backward(schedule, backward_stage)
        backward_stage.backward_one_chunk(backward_mb, loss=loss, full_backward=True,
                                          last_backward=last)
        if backward_stage.stage_index - 1 in stages:
            stages[backward_stage.stage_index - 1].set_local_bwd_input(
                backward_stage.get_local_bwd_output(backward_mb), backward_mb)

    run_forward_with_backward(coordinator, forward, backward)


def overlap_pipeline_schedule(schedule, stages, schedule_name: str,
                              coordinator: OverlapCoordinator) -> PipelineScheduleRuntime:
    """The given torch schedule with its backward/forward neighbours overlapped, taking turns
    through `coordinator` (install_overlap_hooks of this rank's stages)."""
    if schedule_name not in OVERLAP_SCHEDULES:
        raise ValueError(
            "parallelism.expert_parallel_overlap with pipeline_parallel_schedule="
            f"'{schedule_name}' is not supported; use one of {OVERLAP_SCHEDULES}")
    if isinstance(schedule, Schedule1F1B):
        # Same per-rank order, in the runtime form that takes custom actions.
        runtime = ScheduleInterleaved1F1B(stages,
                                          n_microbatches=pipelining.microbatch_count(schedule),
                                          loss_fn=pipelining.loss_function(schedule),
                                          scale_grads=schedule.scale_grads)
    else:
        runtime = schedule
    merged = {rank: merge_backward_forward_pairs(order)
              for rank, order in runtime.pipeline_order.items()}
    check_progress(merged, lambda stage: runtime.stage_index_to_group_rank[stage],
                   pipelining.stage_count(runtime))
    pipelining.set_compute_order(runtime, merged)
    runtime.register_custom_function(
        OVERLAP_F_B, functools.partial(run_overlapped_action, coordinator=coordinator))
    pairs = sum(action.computation_type == OVERLAP_F_B for action in merged[runtime.rank])
    logger.info(f"EP-overlap: {pairs} backward/forward pairs overlapped per step on this "
                f"pipeline rank ({schedule_name}, {pipelining.microbatch_count(runtime)} "
                "microbatches)")
    return runtime

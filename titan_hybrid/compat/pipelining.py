"""torch.distributed.pipelining internals, behind a thin adapter.

What needs them: the EP-overlap inside pipeline schedules (parallel/ep_overlap_pipeline.py)
runs a forward and a backward of two microbatches as ONE action. torch's pipelining runtime has
that action type (OVERLAP_F_B) and calls a registered function for it, but the runtime class,
its action and context types, its lowering of compute actions into sends and receives, and the
per-step state a custom function must drive (receives to wait for, losses, backward counts,
FSDP unshards) are all private: a custom action has no public way to do what the runtime's own
FORWARD / FULL_BACKWARD handling does. Besides: the schedules keep their stage list, microbatch
count and loss function private, and stages have no public hook after the shape inference of
the first step.

Each function below does exactly what the runtime does for its own actions, in the same order
(read from `_PipelineScheduleRuntime._step_microbatches`). Checked on torch 2.11 and 2.13-2.15:
the runtime, its action / context types and lowering are the same in all four; 2.11's stages
infer shapes differently (see after_metadata_inference).
"""

from __future__ import annotations

from collections.abc import Callable

from torch.distributed.pipelining.schedules import (
    _Action,
    _add_send_recv,
    _PipelineContext,
    _PipelineScheduleRuntime,
    _wait_batch_p2p,
)

from titan_hybrid.compat import TORCH_RELEASE  # (also the version check)

# torch 2.11's stages learn their shapes in `_shape_inference` and have no cleanup method after it.
_SHAPE_INFERENCE_HOOK = TORCH_RELEASE < (2, 12)

# The runtime's schedule IR: an action (stage_index, computation_type, microbatch_index,
# sub_actions), the context a custom function receives (schedule_ref, arg_mbs, kwarg_mbs,
# target_mbs, losses), and the schedule class that runs custom functions.
Action = _Action
PipelineContext = _PipelineContext
PipelineScheduleRuntime = _PipelineScheduleRuntime


def local_stages(schedule) -> list:
    """The pipeline stages this rank runs, in the schedule's order (`_stages` of a multi-stage
    schedule, `_stage` of a single-stage one)."""
    if hasattr(schedule, "_stages"):
        return list(schedule._stages)
    return [schedule._stage]


def microbatch_count(schedule) -> int:
    return schedule._n_microbatches


def loss_function(schedule):
    """The loss function the schedule was built with (its `loss_fn` argument)."""
    return schedule._loss_fn


def set_loss_function(schedule, loss_fn) -> None:
    """Make `loss_fn` the schedule's loss function (one a builder wrapped, unwrapped)."""
    schedule._loss_fn = loss_fn


def stage_count(schedule) -> int:
    """The number of stages in the whole pipeline (all ranks)."""
    return schedule._num_stages


def lowering_deadlocks(compute_actions: dict[int, list[Action]],
                       stage_to_rank: Callable[[int], int], num_stages: int) -> bool:
    """Whether torch's lowering of these per-rank compute orders into sends and receives
    (`_add_send_recv`, what `set_compute_order` runs) fails.

    How the failure is read: `_add_send_recv` walks the ranks in turn and schedules a rank's
    next action (for OVERLAP_F_B: both of its sub-actions) only once its inputs have been
    produced; when a full pass over the ranks schedules nothing, it raises AssertionError
    ("Malformed compute schedule, can't schedule sends/recvs"). That is exactly the case of
    ranks that would wait on each other forever, so an AssertionError is reported here as a
    deadlock. Its other AssertionErrors (an empty per-rank list, an action that cannot
    communicate) are malformed inputs that ep_overlap_pipeline never builds; any AssertionError
    means the order cannot run, so none is hidden from the caller's refusal either way.
    """
    try:
        _add_send_recv({rank: list(order) for rank, order in compute_actions.items()},
                       stage_to_rank, num_stages)
    except AssertionError:
        return True
    return False


def set_compute_order(runtime: PipelineScheduleRuntime,
                      compute_actions: dict[int, list[Action]]) -> None:
    """Run `runtime` with these per-rank compute orders (lowered to sends and receives by
    torch, with the custom actions kept)."""
    runtime.pipeline_order = compute_actions
    runtime._prepare_schedule_with_comms(compute_actions)


def wait_for_input(schedule: PipelineScheduleRuntime, stage, microbatch: int, *,
                   backward: bool) -> None:
    """Wait for the receive of `stage`'s input (its forward input, or with `backward` the
    gradient of its output) for `microbatch`, which the runtime posted earlier."""
    pending = schedule.bwd_recv_ops if backward else schedule.fwd_recv_ops
    _wait_batch_p2p(pending.pop((stage.stage_index, microbatch)))


def wait_until_unsharded(schedule: PipelineScheduleRuntime, stage) -> None:
    """Wait for the FSDP unshard of `stage` that the runtime started (and check it ran)."""
    schedule._assert_unsharded(stage)


def compute_loss(schedule: PipelineScheduleRuntime, stage, output, ctx: PipelineContext,
                 microbatch: int) -> None:
    """On the last stage: the microbatch's loss, kept for its backward and for `losses`."""
    schedule._maybe_compute_loss(stage, output, ctx.target_mbs, microbatch)


def stored_loss(schedule: PipelineScheduleRuntime, stage, microbatch: int):
    """The loss `compute_loss` kept for the microbatch (None off the last stage)."""
    return schedule._maybe_get_loss(stage, microbatch)


def count_full_backward(schedule: PipelineScheduleRuntime, stage) -> bool:
    """Count one full backward of `stage`; returns whether it is the step's last one (FSDP
    reduces gradients after it)."""
    schedule.backward_counter[stage.stage_index] += 1
    return schedule.backward_counter[stage.stage_index] == schedule._n_microbatches


def after_metadata_inference(stage, callback: Callable[[], None]) -> None:
    """Call `callback` after torch's cleanup of the shape-inference run of the first step.

    torch runs each stage once, on real inputs, to learn the shapes it sends, then calls the
    stage's private `_post_metadata_inference_cleanup` (which resets FSDP state and gradients);
    there is no public hook. This wraps that method on this stage object only.

    torch 2.11 has no such cleanup: there a stage runs its forward once under no_grad, on zeros
    shaped like the first microbatch, in its private `_shape_inference` (called once, by the
    first step); the callback runs when that method returns.
    """
    if _SHAPE_INFERENCE_HOOK:  # torch 2.11: `_post_metadata_inference_cleanup` is 2.12+
        infer_shapes = stage._shape_inference

        def infer_shapes_then_callback(*args, **kwargs):
            outputs_meta = infer_shapes(*args, **kwargs)
            callback()
            return outputs_meta

        stage._shape_inference = infer_shapes_then_callback
        return
    cleanup = stage._post_metadata_inference_cleanup

    def cleanup_then_callback() -> None:
        cleanup()
        callback()

    stage._post_metadata_inference_cleanup = cleanup_then_callback

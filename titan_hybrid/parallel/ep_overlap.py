"""EP-overlap: the forward of one microbatch runs together with the backward of the previous
one, so that each one's expert-parallel all-to-alls are in flight while the other computes
(Megatron's combined 1F1B at PP = 1: forward of microbatch 0 alone, then forward(i+1) with
backward(i), the last backward alone; under PP, ep_overlap_pipeline.py pairs them inside the
pipeline schedule with the same machinery).

Mechanism. Two threads take turns: the trainer's thread runs the forward, a helper thread the
backward, and only one of them computes at a time. Every all-to-all of the MoE dispatch and
combine (forward and backward, see expert_parallel.py and collectives.py) is a hand-over point,
once `install_overlap_hooks` has given the model's dispatchers its coordinator (without it they
wait for their all-to-alls in place and nothing here is consulted): the running thread
issues its all-to-all asynchronously, lets the other thread compute until that one issues its
own, then waits for its result. So the forward's layer j meets the backward's layer L-1-j, each
microbatch's all-to-all hides behind the other's expert or mixer compute, and:
- every rank hands over at the same points, so all ranks issue their collectives in the same
  order (no hangs, whatever the layer pattern, activation checkpointing included: its
  recomputed all-to-alls are hand-over points like any other);
- each microbatch runs the operations it runs without overlap, in the same order, and
  gradients still accumulate microbatch after microbatch. Measured: losses and logits equal
  bit for bit, gradients equal to float32 rounding (<= 2e-6 relative; not bitwise, for a
  reason not yet pinned down: running the backward on another thread, the layer markers below
  and FSDP's last-backward flag each leave gradients bitwise unchanged on their own).

Layers are units. A logical layer (the data-parallel unit) is never inside the forward of one
microbatch and the backward of the other at once: with ZeRO-3 whichever finishes it first
would release its gathered parameters under the other. Where the two threads cross (one
middle MoE layer), the thread about to enter that layer waits until the other has left it;
that layer's all-to-alls are not overlapped, and parameters are still gathered and released
per layer. The backward thread also waits, before the embedding's backward, for the forward to
finish, so FSDP's end-of-backward callback never runs while the forward is inside a layer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch import nn
from torchtitan.tools.logging import logger

FORWARD, BACKWARD = "forward", "backward"
_OTHER = {FORWARD: BACKWARD, BACKWARD: FORWARD}
# Thread states: RUNNING holds the turn; PARKED waits for it at a hand-over point; BLOCKED
# waits for a condition on the other thread (it left a layer, or it is done); DONE.
RUNNING, PARKED, BLOCKED, DONE = "running", "parked", "blocked", "done"


class OverlapCoordinator:
    """Turn-taking between the forward thread and the backward thread of one overlapped pair.
    All transitions are made by the thread holding the turn, so they happen at the same
    program points on every rank."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._forward_thread: int | None = None  # None: no overlapped pair is running
        self._state: dict[str, str] = {}
        self._waiting_for: dict[str, tuple] = {}
        self._inside: dict[str, set[int]] = {}

    def _role(self) -> str | None:
        if self._forward_thread is None:
            return None
        # The backward may run on autograd's device threads (CUDA), not on the helper thread.
        return FORWARD if threading.get_ident() == self._forward_thread else BACKWARD

    def begin(self) -> None:
        with self._cv:
            self._forward_thread = threading.get_ident()
            self._state = {FORWARD: RUNNING, BACKWARD: PARKED}
            self._waiting_for = {}
            self._inside = {FORWARD: set(), BACKWARD: set()}

    def end(self) -> None:
        with self._cv:
            self._forward_thread = None

    def wait_for_turn(self, role: str) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._state[role] == RUNNING)

    def finish(self, role: str) -> None:
        with self._cv:
            self._state[role] = DONE
            self._inside[role].clear()
            other = _OTHER[role]
            if self._state[other] in (PARKED, BLOCKED):
                self._state[other] = RUNNING
            self._cv.notify_all()

    def communicate(self, work) -> None:
        """Called right after issuing an asynchronous collective: let the other thread compute
        while it is in flight, then wait for it."""
        role = self._role()
        if role is not None:
            with self._cv:
                other = _OTHER[role]
                if self._state[other] == PARKED:
                    self._state[role], self._state[other] = PARKED, RUNNING
                    self._cv.notify_all()
                    self._cv.wait_for(lambda: self._state[role] == RUNNING)
        work.wait()

    def _block(self, role: str, reason: tuple) -> None:
        """Give the turn away until `reason` holds; caller holds the lock."""
        other = _OTHER[role]
        assert self._state[other] != BLOCKED, "both overlap threads blocked on each other"
        self._state[role] = BLOCKED
        self._waiting_for[role] = reason
        if self._state[other] == PARKED:
            self._state[other] = RUNNING
        self._cv.notify_all()
        self._cv.wait_for(lambda: self._state[role] == RUNNING)

    def enter_layer(self, unit: int) -> None:
        role = self._role()
        if role is None:
            return
        with self._cv:
            if unit in self._inside[_OTHER[role]]:
                self._block(role, ("left", unit))
            self._inside[role].add(unit)

    def leave_layer(self, unit: int) -> None:
        role = self._role()
        if role is None:
            return
        with self._cv:
            self._inside[role].discard(unit)
            other = _OTHER[role]
            if self._state[other] == BLOCKED and self._waiting_for[other] == ("left", unit):
                self._state[other] = PARKED  # it gets the turn at this thread's next hand-over

    def wait_for_forward_done(self) -> None:
        if self._role() != BACKWARD:
            return
        with self._cv:
            if self._state[FORWARD] != DONE:
                self._block(BACKWARD, ("done",))


# --------------------------------------------------------------------------- layer tracking
class _OnBackward(torch.autograd.Function):
    """Identity whose backward calls `callback` when the gradient reaches this point. Its
    output is a view (no copy of the activation): a marked layer output is only read after it
    (by the next layer, the norm and head, or a pipeline stage's send), never updated in
    place, so FSDP2's pre-backward hook on the unit's own output, registered before this
    marker, is never dropped. The root's aux loss, which a caller may accumulate into, is a
    fresh tensor (model/model.py)."""

    @staticmethod
    def forward(ctx, x, callback):
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.callback()
        return grad, None


def _mark(value, callback):
    if isinstance(value, torch.Tensor) and value.requires_grad and torch.is_grad_enabled():
        return _OnBackward.apply(value, callback)
    return value


def install_overlap_hooks(models: list[nn.Module], dispatchers) -> OverlapCoordinator:
    """Make `models` (one model, or the pipeline stages of one rank, whose forwards and
    backwards pair across stages) overlap-capable with one shared coordinator, returned for
    the ParallelPlan: their MoE `dispatchers` (apply_expert_parallel's) hand over at every
    all-to-all, and their layers record which thread is inside them.

    Layer tracking is installed after parallelization, so the hooks wrap FSDP's: the forward
    checks a layer before FSDP gathers it; the backward marks entering a layer before FSDP's
    pre-backward and leaving it after its post-backward. The backward enters a layer when the
    gradient reaches the layer's outputs and leaves it when the gradient reaches its input;
    autograd runs nodes in reverse creation order, so these markers bracket exactly that
    layer's backward."""
    coordinator = OverlapCoordinator()
    for dispatcher in dispatchers:
        dispatcher.overlap = coordinator
    for model in models:
        _install(model, coordinator)
    return coordinator


def _install(model: nn.Module, coordinator: OverlapCoordinator) -> None:
    units = [*model.layers.values(), *getattr(model, "mtp", [])]
    for unit in units:
        key = id(unit)

        def before(module, args, key=key):
            coordinator.enter_layer(key)
            return (_mark(args[0], lambda: coordinator.leave_layer(key)), *args[1:])

        def after(module, args, output, key=key):
            coordinator.leave_layer(key)
            outputs = output if isinstance(output, tuple) else (output,)
            marked = tuple(_mark(value, lambda: coordinator.enter_layer(key)) for value in outputs)
            return marked if isinstance(output, tuple) else marked[0]

        unit.register_forward_pre_hook(before, prepend=True)
        unit.register_forward_hook(after)
    if getattr(model, "tok_embeddings", None) is not None:
        model.tok_embeddings.register_forward_hook(
            lambda module, args, output: _mark(output, coordinator.wait_for_forward_done))


# --------------------------------------------------------------------------- schedule
def run_forward_with_backward(coordinator: OverlapCoordinator,
                              forward: Callable[[], torch.Tensor],
                              backward: Callable[[], None]) -> torch.Tensor:
    """Run `forward` on this thread and `backward` on a helper thread, taking turns at the
    all-to-alls of the models `coordinator` was installed on; returns what `forward` returned."""
    errors: list[BaseException] = []

    def backward_thread() -> None:
        try:
            coordinator.wait_for_turn(BACKWARD)
            backward()
        except BaseException as error:  # re-raised on the trainer's thread
            errors.append(error)
        finally:
            coordinator.finish(BACKWARD)

    coordinator.begin()
    helper = threading.Thread(target=backward_thread, name="ep-overlap-backward", daemon=True)
    helper.start()
    try:
        result = forward()
    except BaseException as error:
        errors.append(error)
    finally:
        coordinator.finish(FORWARD)
        helper.join()
        coordinator.end()
    if errors:
        raise errors[0]
    return result


class CombinedOneFOneB:
    """Forward/backward of a step's microbatches, one call per microbatch (the trainer's
    gradient-accumulation loop): forward(0) alone, forward(i+1) with backward(i), and the
    last microbatch's backward right after its forward. `coordinator`: install_overlap_hooks'
    for `model`."""

    def __init__(self, model: nn.Module, coordinator: OverlapCoordinator,
                 num_microbatches: int) -> None:
        self.model = model
        self.coordinator = coordinator
        self.num_microbatches = num_microbatches
        self._pending: torch.Tensor | None = None
        self._done = 0
        logger.info(f"EP-overlap: combined 1F1B over the step's {num_microbatches} "
                    "microbatches (each forward runs with the previous one's backward)")

    def _set_last_backward(self, last: bool) -> None:
        # FSDP clears its backward-prefetch order after a "last" backward; the next
        # microbatch's forward has already run by then.
        if hasattr(self.model, "set_is_last_backward"):
            self.model.set_is_last_backward(last)

    def __call__(self, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`forward()` returns this microbatch's scaled loss; returns it detached."""
        last = self._done == self.num_microbatches - 1
        if self._pending is None:
            loss = forward()
        else:
            pending = self._pending
            self._set_last_backward(False)
            loss = run_forward_with_backward(self.coordinator, forward, pending.backward)
        self._done += 1
        if last:
            self._set_last_backward(True)
            loss.backward()
            self._pending, self._done = None, 0
        else:
            self._pending = loss
        return loss.detach()

"""torchtitan 0.2.2 internals: checkpoint hooks under public names, and the pause at the end
of its training loop (its device globals, the same in 0.3, are in torchtitan.py).

Checked on torchtitan 0.2.2 (with torch 2.11 and 2.13-2.15).
"""

from __future__ import annotations

import contextlib
import time

from torchtitan.components.checkpoint import CheckpointManager, ModelWrapper

import titan_hybrid.compat  # noqa: F401  (the version check)


class ModelWrapperHooks(ModelWrapper):
    """torchtitan's ModelWrapper (the checkpointed model state) with its one hook public.

    Private name: `ModelWrapper._get_state_dict`, which torchtitan calls at construction and
    after every load to (re)build the state dict that `state_dict()` hands to DCP. It is the
    only place to change what a checkpoint holds for the model (titan_hybrid saves fused
    tensors as their components); `state_dict()` returns a cache built by it, so overriding
    `state_dict()` alone would miss the rebuild after a load.
    """

    def build_state_dict(self) -> dict:
        """The model's state dict as torchtitan builds it; override to transform it."""
        return super()._get_state_dict()

    def _get_state_dict(self) -> dict:
        return self.build_state_dict()


class CheckpointManagerHooks(CheckpointManager):
    """torchtitan's CheckpointManager with the private hooks titan_hybrid overrides or calls
    under public names. Subclasses override the public methods; torchtitan's own calls to the
    private hooks land on them, and the defaults run torchtitan's code.

    Private names (no public hook exists for these steps in 0.2.2):
    - `_save_last_step`: the final save, whose model-only / HF / dtype rules titan_hybrid decides;
    - `_find_load_step`: which `step-N` folder a resume reads (titan_hybrid skips damaged ones);
    - `_purge_stale_checkpoints`: `keep_latest_k` (titan_hybrid counts intact folders only);
    - `_create_checkpoint_id`: the folder of a step, as torchtitan names it;
    - `_async_wait`: where a save waits for the previous background save (titan_hybrid commits
      that one there); `save_future` holds the background save's future (torchtitan's field);
    - `enable_staging`, `staging`, `staging_future`: the flags and future through which the
      train step waits for a background copy to host memory (`maybe_wait_for_staging`).
    """

    def enable_background_staging(self) -> None:
        """The train step waits for each save's staging (titan_hybrid's own stager)."""
        self.enable_staging = True

    def staging_started(self, future) -> None:
        """A save's copy to host memory runs in the background until `future` is done."""
        self.staging_future, self.staging = future, True

    def save_last_step(self, step: int) -> None:
        super()._save_last_step(step)

    def find_load_step(self, folder: str = "") -> int:
        return super()._find_load_step(folder)

    def purge_stale_checkpoints(self) -> None:
        super()._purge_stale_checkpoints()

    def step_folder(self, step: int) -> str:
        return self._create_checkpoint_id(step)

    def wait_for_background_save(self) -> None:
        super()._async_wait()

    def background_save_done(self) -> bool:
        """Whether the background save (if any) has finished on this rank."""
        future = self.save_future
        return future is None or future.done()

    def _save_last_step(self, curr_step: int) -> None:
        self.save_last_step(curr_step)

    def _find_load_step(self, folder: str = "") -> int:
        return self.find_load_step(folder)

    def _purge_stale_checkpoints(self) -> None:
        self.purge_stale_checkpoints()

    def _async_wait(self) -> None:
        self.wait_for_background_save()


class _TimeWithoutSleep:
    """The `time` module as torchtitan.train sees it inside `without_final_sleep`."""

    def __getattr__(self, name: str):
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        """Returns at once: HybridTrainer.train waits for the other ranks with a barrier."""


@contextlib.contextmanager
def without_final_sleep():
    """torchtitan's `Trainer.train` ends with rank 0 sleeping 2 s "for other ranks to complete";
    inside this context that sleep returns at once, and the caller waits for the other ranks
    with a barrier instead (2 s less per run, and no guess at how long the slowest rank takes).

    Internal detail relied on: torchtitan.train calls `time.sleep` through its module global
    `time`, and only for that wait. torchtitan has no setting for it.
    """
    import torchtitan.train as tt_train

    tt_train.time = _TimeWithoutSleep()
    try:
        yield
    finally:
        tt_train.time = time

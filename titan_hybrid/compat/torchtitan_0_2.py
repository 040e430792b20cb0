"""torchtitan 0.2.2 internals: checkpoint hooks under public names, and the pause at the end
of its training loop (its device globals, the same in 0.3, are in torchtitan.py).

Checked on torchtitan 0.2.2 (with torch 2.11 and 2.13-2.15).
"""

from __future__ import annotations

from torchtitan.components.checkpoint import CheckpointManager, ModelWrapper

import titan_hybrid.compat  # noqa: F401  (the version check)
from titan_hybrid.compat.torchtitan import without_final_sleep as without_final_sleep_in


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

    def _save_last_step(self, curr_step: int) -> None:
        self.save_last_step(curr_step)

    def _find_load_step(self, folder: str = "") -> int:
        return self.find_load_step(folder)

    def _purge_stale_checkpoints(self) -> None:
        self.purge_stale_checkpoints()

    def _async_wait(self) -> None:
        self.wait_for_background_save()


def without_final_sleep():
    """titan_hybrid.compat.torchtitan.without_final_sleep for this generation, whose
    `Trainer.train` is in torchtitan.train."""
    import torchtitan.train as trainer_module

    return without_final_sleep_in(trainer_module)

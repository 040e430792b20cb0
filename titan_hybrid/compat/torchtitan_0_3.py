"""torchtitan 0.3.0 internals: checkpoint hooks under public names, the pause at the end of its
training loop, and its pipeline split and schedule builder (public in 0.2, private in 0.3).
Checked on torchtitan 0.3.0 with torch 2.14 and 2.15.

The hooks give titan_hybrid's checkpoint manager (titan_hybrid/checkpoint/manager.py) the same
public names as torchtitan_0_2.py does for 0.2, so that one class runs under both.
"""

from __future__ import annotations

from torchtitan.components.checkpointer import CheckpointManager, ModelWrapper
from torchtitan.distributed.pipeline_parallel import (
    _build_get_mesh_callback,
    _build_pipeline_schedule,
    _pipeline_module_split,
)

import titan_hybrid.compat  # noqa: F401  (the version check)
from titan_hybrid.compat import pipelining
from titan_hybrid.compat.torchtitan import without_final_sleep as without_final_sleep_in


class ModelWrapperHooks(ModelWrapper):
    """torchtitan 0.3's ModelWrapper with its one hook public, and its state dict the one it
    built.

    Private name: `ModelWrapper._get_state_dict`, which torchtitan calls at construction, on
    every `state_dict()` and after every load. 0.3's `state_dict()` then merges the fresh dict
    into its cache by checking shared storage or copying values in place; titan_hybrid's fused
    tensors are saved as component views without storage of their own, which neither works on.
    They are views of the live parameters, so the cache built at construction and after each
    load (`cached_state_dict`) always holds the current values: it is what `state_dict()` gives,
    as in 0.2.
    """

    def build_state_dict(self) -> dict:
        return super()._get_state_dict()

    def _get_state_dict(self) -> dict:
        return self.build_state_dict()

    def state_dict(self) -> dict:
        return self.cached_state_dict


class CheckpointManagerHooks(CheckpointManager):
    """torchtitan 0.3's CheckpointManager with the private hooks titan_hybrid overrides or
    calls under public names (the same names as torchtitan_0_2.CheckpointManagerHooks).

    Private names (0.3's public `save` / `load` / `close` check `enable` and call `_save` /
    `_load` / `_close`; the steps titan_hybrid changes have no public hook):
    - `_save_last_step`, `_find_load_step`, `_purge_stale_checkpoints`, `_create_checkpoint_id`:
      as in 0.2;
    - `_wait_for_saving` (0.2: `_async_wait`): where a save waits for the previous background
      save; 0.3 asserts a pending one, and `save_future` holds it;
    - `_maybe_wait_for_staging`: 0.3 waits on `staging_future` for pinned-memory saves only
      and refuses any other; titan_hybrid's `async` mode stages in the background too.
    `_save` / `_load` / `_close` are not routed to the public names: those call them.
    """

    def save_last_step(self, step: int) -> None:
        super()._save_last_step(step)

    def find_load_step(self, folder: str = "") -> int:
        return super()._find_load_step(folder)

    def purge_stale_checkpoints(self) -> None:
        super()._purge_stale_checkpoints()

    def step_folder(self, step: int) -> str:
        return self._create_checkpoint_id(step)

    def wait_for_background_save(self) -> None:
        if self.save_future is not None:
            super()._wait_for_saving()

    def enable_background_staging(self) -> None:
        """Nothing to enable: 0.3 waits whenever a staging future is pending."""

    def staging_started(self, future) -> None:
        self.staging_future = future

    def _save_last_step(self, curr_step: int) -> None:
        self.save_last_step(curr_step)

    def _find_load_step(self, folder: str = "") -> int:
        return self.find_load_step(folder)

    def _purge_stale_checkpoints(self) -> None:
        self.purge_stale_checkpoints()

    def _wait_for_saving(self) -> None:
        self.wait_for_background_save()

    def _maybe_wait_for_staging(self) -> None:
        if self.staging_future is not None:
            self.staging_future.result()
            self.staging_future = None


def without_final_sleep():
    """titan_hybrid.compat.torchtitan.without_final_sleep for this generation, whose
    `Trainer.train` is in torchtitan.trainer (0.2: torchtitan.train)."""
    import torchtitan.trainer as trainer_module

    return without_final_sleep_in(trainer_module)


def pipeline_module_splitter(parallel_dims):
    """`split(model, pp_mesh, schedule_name, device, module_names_per_stage)` -> (stages,
    model parts), as 0.2's public `pipeline_module_split`; 0.3's stages also take the
    callback that gives them their meshes."""
    get_mesh = _build_get_mesh_callback(parallel_dims)

    def split(model, pp_mesh, schedule_name, device, module_names_per_stage):
        return _pipeline_module_split(model, pp_mesh, schedule_name, device,
                                      module_names_per_stage, get_mesh=get_mesh)

    return split


def pipeline_schedule_builder(parallelism, local_batch_size: int):
    """`build(stages, loss_fn)` -> the schedule, as 0.2's public `build_pipeline_schedule`.
    0.3's builder wraps the loss function into one that unpacks 0.3's (loss, metrics) pair;
    titan_hybrid's returns the loss alone and is set back as the schedule's own, which the
    EP-overlap's actions and the validator read (compat.pipelining.loss_function)."""

    def build(stages, loss_fn):
        schedule = _build_pipeline_schedule(
            parallelism=parallelism, local_batch_size=local_batch_size, stages=stages,
            loss_fn=lambda *args, **kwargs: (loss_fn(*args, **kwargs), {}))
        pipelining.set_loss_function(schedule, loss_fn)
        return schedule

    return build

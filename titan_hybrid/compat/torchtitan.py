"""torchtitan internals that are the same in 0.2.2 and 0.3.0: its device globals (a patch
for CPU runs), and how its training loop pauses at the end. Checked on torchtitan 0.2.2 and
0.3.0."""

from __future__ import annotations

import contextlib
import sys
import time
import types

import torch

import titan_hybrid.compat  # noqa: F401  (the version check)


def point_device_globals_at_cpu(cpu_module: types.ModuleType) -> None:
    """Make every loaded torchtitan module see device "cpu" and `cpu_module` (a patch: applied
    only by titan_hybrid.runtime.cpu.apply()).

    Internal detail relied on: `torchtitan.tools.utils` computes `device_type = ... or "cuda"`
    and `device_module` once at import, other modules copy them with `from ... import
    device_type`, and their functions read these module globals at call time. torchtitan has
    no setting for the device type, so each copy is rewritten; modules imported later copy the
    already rewritten values from torchtitan.tools.utils.
    """
    import torchtitan.tools.utils as tt_utils

    tt_utils.device_type, tt_utils.device_module = "cpu", cpu_module
    for name, module in list(sys.modules.items()):
        if not name.startswith("torchtitan") or module is None:
            continue
        if getattr(module, "device_type", None) == "cuda":
            module.device_type = "cpu"
        if getattr(module, "device_module", None) is torch.cuda:
            module.device_module = cpu_module


class _TimeWithoutSleep:
    """The `time` module as torchtitan's trainer module sees it inside `without_final_sleep`."""

    def __getattr__(self, name: str):
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        """Returns at once: HybridTrainer.train waits for the other ranks with a barrier."""


@contextlib.contextmanager
def without_final_sleep(trainer_module: types.ModuleType):
    """torchtitan's `Trainer.train` ends with rank 0 sleeping 2 s "for other ranks to complete";
    inside this context that sleep returns at once, and the caller waits for the other ranks
    with a barrier instead (2 s less per run, and no guess at how long the slowest rank takes).

    Internal detail relied on: the module that defines `Trainer.train` (each generation's fence
    names it) calls `time.sleep` through its module global `time`, and only for that wait.
    torchtitan has no setting for it.
    """
    trainer_module.time = _TimeWithoutSleep()
    try:
        yield
    finally:
        trainer_module.time = time

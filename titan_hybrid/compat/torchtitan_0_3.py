"""torchtitan 0.3.0 internals. Checked on torchtitan 0.3.0 with torch 2.14 and 2.15."""

from __future__ import annotations

import contextlib
import time

import titan_hybrid.compat  # noqa: F401  (the version check)


class _TimeWithoutSleep:
    """The `time` module as torchtitan.trainer sees it inside `without_final_sleep`."""

    def __getattr__(self, name: str):
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        """Returns at once: HybridTrainer.train waits for the other ranks with a barrier."""


@contextlib.contextmanager
def without_final_sleep():
    """torchtitan's `Trainer.train` ends with rank 0 sleeping 2 s "for other ranks to complete";
    inside this context that sleep returns at once, and the caller waits for the other ranks
    with a barrier instead.

    Internal detail relied on: torchtitan.trainer calls `time.sleep` through its module global
    `time` (0.2 did it in torchtitan.train), and only for that wait.
    """
    import torchtitan.trainer as tt_trainer

    tt_trainer.time = _TimeWithoutSleep()
    try:
        yield
    finally:
        tt_trainer.time = time

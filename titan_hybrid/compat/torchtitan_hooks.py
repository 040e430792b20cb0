"""The installed torchtitan's checkpoint hooks under public names: torchtitan_0_2.py's or
torchtitan_0_3.py's, which give the same names (titan_hybrid/checkpoint/manager.py and state.py
use them, whichever torchtitan runs)."""

from __future__ import annotations

from titan_hybrid.compat import TORCHTITAN_RELEASE

if TORCHTITAN_RELEASE == (0, 2):
    from titan_hybrid.compat.torchtitan_0_2 import CheckpointManagerHooks, ModelWrapperHooks
else:
    from titan_hybrid.compat.torchtitan_0_3 import CheckpointManagerHooks, ModelWrapperHooks

__all__ = ["CheckpointManagerHooks", "ModelWrapperHooks"]

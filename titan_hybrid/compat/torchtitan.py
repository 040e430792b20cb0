"""torchtitan internals that are the same in 0.2.2 and 0.3.0: its device globals (a patch
for CPU runs). Checked on torchtitan 0.2.2 and 0.3.0."""

from __future__ import annotations

import sys
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

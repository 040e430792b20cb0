"""Which of titan_hybrid's modules belong to the torchtitan API generation that is not
installed: each adapter (and its fence in compat/, and its entry points) imports names only
its own torchtitan has. Tests that import every module skip these; CI imports them in the other
generation's leg."""

from __future__ import annotations

import importlib.metadata

INSTALLED = tuple(int(p) for p in importlib.metadata.version("torchtitan").split(".")[:2])

MODULES_OF = {
    (0, 2): ("titan_hybrid.adapters.torchtitan_0_2", "titan_hybrid.compat.torchtitan_0_2",
             "titan_hybrid.torchtitan_plugin"),
    (0, 3): ("titan_hybrid.adapters.torchtitan_0_3", "titan_hybrid.compat.torchtitan_0_3",
             "titan_hybrid.config_registry"),
}


def of_another_generation(module: str) -> bool:
    """Whether `module` is written for a torchtitan other than the installed one."""
    return any(module == prefix or module.startswith(prefix + ".")
               for generation, prefixes in MODULES_OF.items() if generation != INSTALLED
               for prefix in prefixes)

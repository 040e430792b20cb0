"""What torchtitan imports to run hybrid models: `--experimental.custom_import
titan_hybrid.torchtitan_plugin` (the TOML jobs under train_configs/ name it already).

Importing it activates titan_hybrid inside torchtitan, once per process: registers the TrainSpec
"hybrid" and the "pydoc" dataset, and on a machine without an accelerator applies the CPU
runtime (titan_hybrid.runtime.cpu). This is the one module whose import has effects; the
library modules have none.
"""

from __future__ import annotations

from titan_hybrid.data.loader import register_pydoc_dataset
from titan_hybrid.runtime import cpu
from titan_hybrid.train_spec import register_hybrid_train_spec

_active = False


def activate() -> None:
    """Register the TrainSpec and dataset and apply the CPU runtime; later calls do nothing."""
    global _active
    if _active:
        return
    cpu.apply()
    register_pydoc_dataset()
    register_hybrid_train_spec()
    _active = True


activate()

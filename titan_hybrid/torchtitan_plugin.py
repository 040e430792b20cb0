"""What torchtitan 0.2 imports to run hybrid models: `--experimental.custom_import
titan_hybrid.torchtitan_plugin`, and `--job.custom_config_module titan_hybrid.torchtitan_plugin`
for titan_hybrid's job sections (its `JobConfig`). The TOML jobs under train_configs/ name it
for both.

Importing it activates titan_hybrid inside torchtitan, once per process: registers the TrainSpec
"hybrid" and the "pydoc" dataset, and on a machine without an accelerator applies the CPU
runtime (titan_hybrid.runtime.cpu). This is the one module whose import has effects; the
library modules have none.
"""

from __future__ import annotations

from titan_hybrid.adapters.torchtitan_0_2.job_config import JobConfig
from titan_hybrid.adapters.torchtitan_0_2.train_spec import register_hybrid_train_spec
from titan_hybrid.data.loader import register_pydoc_dataset
from titan_hybrid.runtime import cpu

__all__ = ["JobConfig", "activate"]

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

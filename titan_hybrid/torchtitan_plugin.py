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

from titan_hybrid.adapters.torchtitan_0_2.front_end import activate
from titan_hybrid.adapters.torchtitan_0_2.job_config import JobConfig

__all__ = ["JobConfig", "activate"]

activate()

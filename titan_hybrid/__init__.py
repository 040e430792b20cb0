"""titan_hybrid: hybrid Mamba2 / attention / MoE / gated-DeltaNet models on torchtitan.

Importing the package registers the torchtitan TrainSpec "hybrid" and, on machines without an
accelerator, the CPU runtime patches torchtitan needs (see titan_hybrid.runtime.cpu).
"""

from titan_hybrid.runtime import cpu as _cpu_runtime

_cpu_runtime.apply()

from titan_hybrid.train_spec import register as _register  # noqa: E402

_register()

"""The run configuration titan_hybrid owns: one immutable `RunConfig` per run.

The adapter of the installed torchtitan (titan_hybrid/adapters) builds it once, from whatever
config that torchtitan parsed, and resolves the model args into it. Everything below the
adapters (pre-flight checks, data, parallelism, loss, optimizer, metrics, validation,
checkpoints) reads this object, never a torchtitan config, so that code does not know which
torchtitan runs it.

Its sections are titan_hybrid.config.sections' (the bottom layer), which code that reads one
section imports directly. Building one refuses a value of an enumerated field that is not one of
its type's (each section's `Literal[...]` fields), whichever torchtitan parsed the job.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from titan_hybrid.config.sections import (
    ActivationCheckpointSection,
    CheckpointSection,
    CompileSection,
    DataSection,
    Float8Section,
    HybridSection,
    LRSchedulerSection,
    MetricsSection,
    OptimizerSection,
    ParallelismSection,
    TrainingSection,
    ValidationSection,
    check_choices,
)
from titan_hybrid.model.args import HybridModelArgs


@dataclass(frozen=True)
class RunConfig:
    model: HybridModelArgs
    """The run's model args: its flavor with the job's pattern, sequence length and seed,
    validated. A copy of the run's own (nothing else holds it)."""
    dump_folder: str = "./outputs"
    training: TrainingSection = field(default_factory=TrainingSection)
    data: DataSection = field(default_factory=DataSection)
    parallelism: ParallelismSection = field(default_factory=ParallelismSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    validation: ValidationSection = field(default_factory=ValidationSection)
    compile: CompileSection = field(default_factory=CompileSection)
    activation_checkpoint: ActivationCheckpointSection = field(
        default_factory=ActivationCheckpointSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    lr_scheduler: LRSchedulerSection = field(default_factory=LRSchedulerSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    hybrid: HybridSection = field(default_factory=HybridSection)
    float8: Float8Section = field(default_factory=Float8Section)

    def __post_init__(self) -> None:
        # (float8 is derived from the quantize options, whose values float8_section checks
        # under their own names)
        for section in dataclasses.fields(self):
            if section.name not in ("model", "dump_folder", "float8"):
                check_choices(section.name, getattr(self, section.name))

    @property
    def flavor(self) -> str:
        """The model's named flavor (the job's `model.flavor`)."""
        return self.hybrid.flavor

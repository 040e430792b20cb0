"""torchtitan 0.3's job: the sections titan_hybrid adds to its Trainer.Config, and the run's
RunConfig built from that config (or from the pieces a stock trainer hands a ModelSpec).

0.3 names some fields differently from 0.2 and the TOML jobs; the RunConfig keeps the TOML
names (training/run_config.py), so this is the one place that knows both:
- `dump_folder`, `hf_assets_path` (0.2: `job.dump_folder`, `model.hf_assets_path`);
- `dataloader.dataset` / `dataset_path` (0.2: `training.dataset` / `dataset_path`);
- `validator` (0.2: `validation`), whose dataset sits in `validator.dataloader`;
- `parallelism.enable_sequence_parallel` (0.2 and titan_hybrid: `disable_sequence_parallel`).
titan_hybrid's own options are fields of the sections below (`--hybrid.pattern`,
`--parallelism.context_parallel_linear_mode`, `--optimizer.lr`, ...).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import SimpleNamespace

from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.validate import Validator
from torchtitan.config import ParallelismConfig

from titan_hybrid.adapters.command_line import (
    NEGATED_UNDER_0_3,
    RENAMED_UNDER_0_3,
    refusal_under_0_3,
)
from titan_hybrid.adapters.options import (
    MISSING,
    attribute_reader,
    check_quantize_choices,
    read_sections,
    run_config_from,
    with_options,
)
from titan_hybrid.config.sections import (
    ActivationCheckpointSection,
    Float8Section,
    section_from,
)
from titan_hybrid.model.args import HybridModelArgs
from titan_hybrid.quantize.float8 import float8_section
from titan_hybrid.training.run_config import RunConfig


def place_under_0_3(path: str) -> str | None:
    """Where the field at a TOML / 0.2 job path sits in a 0.3 config (None: nowhere, or as
    a field of torchtitan's that says the opposite)."""
    if refusal_under_0_3(path) or path in NEGATED_UNDER_0_3:
        return None
    return RENAMED_UNDER_0_3.get(path, path)


def _options(name: str, base: type | None, section: str, doc: str | None = None) -> type:
    return with_options(name, base, section, place_under_0_3, module=__name__, doc=doc,
                        kw_only=True, slots=True)


HybridOptions = _options("HybridOptions", None, "hybrid")
HybridOptimizerSettings = _options("HybridOptimizerSettings", None, "optimizer")
HybridActivationCheckpoint = _options(
    "HybridActivationCheckpoint", None, "activation_checkpoint",
    doc="The `--activation_checkpoint.*` section of titan_hybrid's trainer, as in a 0.2 job "
        "(titan_hybrid applies it: parallel/activation_checkpoint.py). 0.3's own section is a "
        "choice of policy classes without the every-N-th-layer option.")
ValidatorOptions = _options("ValidatorOptions", Validator.Config, "validator")
CheckpointOptions = _options("CheckpointOptions", CheckpointManager.Config, "checkpoint")
ParallelismOptions = _options("ParallelismOptions", ParallelismConfig, "parallelism")
HybridFloat8Linear = _options("HybridFloat8Linear", None, "quantize.linear.float8")
HybridMXLinear = _options("HybridMXLinear", None, "quantize.linear.mx")
HybridFloat8GroupedMM = _options("HybridFloat8GroupedMM", None, "quantize.grouped_mm.float8")
QuantizeOptions = _options("QuantizeOptions", None, "quantize")


@dataclass(kw_only=True, slots=True)
class HybridQuantizedLinear:
    float8: HybridFloat8Linear = field(default_factory=HybridFloat8Linear)
    mx: HybridMXLinear = field(default_factory=HybridMXLinear)


@dataclass(kw_only=True, slots=True)
class HybridQuantizedGroupedMM:
    float8: HybridFloat8GroupedMM = field(default_factory=HybridFloat8GroupedMM)


@dataclass(kw_only=True, slots=True)
class HybridQuantize(QuantizeOptions):
    """FP8 training in torchtitan 0.2's words: `converters` is 0.2's `model.converters` (0.3's
    model spec has no converters; a TOML job's `model.converters` lands here)."""

    linear: HybridQuantizedLinear = field(default_factory=HybridQuantizedLinear)
    grouped_mm: HybridQuantizedGroupedMM = field(default_factory=HybridQuantizedGroupedMM)


@dataclass(kw_only=True, slots=True)
class HybridParallelismConfig(ParallelismOptions):
    """torchtitan 0.3's parallelism section with titan_hybrid's fields (as in a 0.2 job). The
    meshes titan_hybrid's parallel code uses ("fsdp", "efsdp") exist under the
    `partial_dtensor` SPMD backend, its default here."""

    spmd_backend: str = "partial_dtensor"


def _reader(config):
    """read(path) over a 0.3 config (or the sections a stock trainer hands a model spec)."""
    read, read_0_3 = attribute_reader(config, place_under_0_3), attribute_reader(config)

    def reading(path: str):
        if path in NEGATED_UNDER_0_3:
            value = read_0_3(NEGATED_UNDER_0_3[path])
            return value if value is MISSING else not value
        value = read(path)
        if value is MISSING and path in _VALIDATION_WINDOWS and config.validator is not None:
            # torchtitan's own validator uses the training windows; titan_hybrid's has its own
            value = read(_VALIDATION_WINDOWS[path])
        return value
    return reading


_VALIDATION_WINDOWS = {"validation.local_batch_size": "training.local_batch_size",
                       "validation.seq_len": "training.seq_len"}


def _run_from(config, model: HybridModelArgs | None = None, flavor: str | None = None):
    read = _reader(config)
    sections = read_sections(read)
    sections["activation_checkpoint"] = activation_checkpoint_section(
        config.activation_checkpoint)
    if flavor is not None:
        sections["hybrid"] = dataclasses.replace(sections["hybrid"], flavor=flavor)
    quantize = config.quantize
    if quantize is not None:
        check_quantize_choices(read)
    float8 = (Float8Section() if quantize is None else float8_section(
        quantize.converters, quantize.linear.float8, quantize.grouped_mm.float8.fqns,
        quantize.linear.mx))
    return run_config_from(sections, dump_folder=config.dump_folder, float8=float8,
                           model=model)


def run_from_parts(model: HybridModelArgs, *, flavor: str, dump_folder: str, training,
                   parallelism, compile_config, ac_config) -> RunConfig:
    """The RunConfig from the sections a stock trainer hands a ModelSpec's functions; the
    others take titan_hybrid's defaults."""
    parts = SimpleNamespace(training=training, parallelism=parallelism, compile=compile_config,
                            activation_checkpoint=ac_config, dump_folder=dump_folder,
                            validator=None, quantize=None)
    return _run_from(parts, model, flavor)


def activation_checkpoint_section(ac_config) -> ActivationCheckpointSection:
    """From titan_hybrid's section, or from 0.3's own (one of several policy classes, None:
    off; the mode is its kind)."""
    if isinstance(ac_config, HybridActivationCheckpoint):
        return section_from(ActivationCheckpointSection, ac_config)
    if ac_config is None:
        return ActivationCheckpointSection(mode="none")
    kind = type(ac_config).__qualname__.split(".")[0]  # FullAC.Config -> FullAC
    mode = {"FullAC": "full", "SelectiveAC": "selective", "MemoryBudgetAC": "memory_budget"}
    if kind not in mode:
        raise ValueError(f"activation_checkpoint {kind} is not one of {sorted(mode)}")
    return section_from(ActivationCheckpointSection, ac_config, mode=mode[kind],
                        selective_ac_option="op" if kind == "SelectiveAC" else "2")


def _require(condition: bool, field: str, value, rule: str) -> None:
    if not condition:
        raise ValueError(f"{field}={value!r} {rule}")


def check_torchtitan_0_3_fields(config) -> None:
    """The fields only a 0.3 job has."""
    p = config.parallelism
    _require(p.spmd_backend == "partial_dtensor", "parallelism.spmd_backend", p.spmd_backend,
             "must be 'partial_dtensor': titan_hybrid's parallel code shards with FSDP2 and "
             "DTensor on the meshes that backend builds")
    _require(config.training.disable_cuda_graphs, "training.disable_cuda_graphs", False,
             "is not supported: titan_hybrid's layers are not CUDA-graph safe")


def run_config(config) -> RunConfig:
    """The RunConfig of a HybridTrainer.Config (titan_hybrid's sections included), with the
    model args resolved and validated; ValueError names a field titan_hybrid cannot run."""
    check_torchtitan_0_3_fields(config)
    return _run_from(config)

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

from dataclasses import dataclass, field

from torchtitan.config import ParallelismConfig

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
    section_from,
)
from titan_hybrid.hf.families import model_args_from_hf
from titan_hybrid.model.args import HybridModelArgs, resolve_model_args
from titan_hybrid.training.float8 import float8_section
from titan_hybrid.training.run_config import RunConfig


@dataclass(kw_only=True, slots=True)
class HybridOptions:
    """The `--hybrid.*` options (the TOML jobs' `[hybrid]` section, plus the flavor, which a
    0.2 job names as `model.flavor`)."""

    flavor: str = "debug"
    """The named model shapes (titan_hybrid.model.args.hybrid_flavors)."""
    pattern: str = ""
    """Hybrid layer pattern overriding the flavor's (e.g. "M*M-E", "M[M*]-", "M*-/*-")."""
    loss_curve_file: str = ""
    """If set, append each logged step's exact loss as a JSON line to this file (relative
    paths under dump_folder)."""
    document_masking: bool = False
    """Rows are documents packed back to back, each starting with the tokenizer's BOS token:
    attention, Mamba / GDN states, conv taps and positions restart at each document."""
    model_config: str = ""
    """An HF folder (or its config.json) whose model this job trains, in place of the flavor
    (its family's config gives the model args)."""
    load_layers_by_order: bool = False
    """Read a checkpoint of another pattern layer by layer of each kind."""


@dataclass(kw_only=True, slots=True)
class HybridFloat8Linear:
    """`--quantize.linear.float8.*`: torchtitan 0.2's fields (training/float8.py)."""

    recipe_name: str | None = None
    """tensorwise (None: the default), rowwise or rowwise_with_gw_hp."""
    emulate: bool = False
    """The float8 GEMMs as casts to float8 and back around a high-precision matmul (CPU)."""
    filter_fqns: list[str] = field(default_factory=list)
    """Modules whose FQN contains one of these stay in high precision."""
    enable_fsdp_float8_all_gather: bool = False
    precompute_float8_dynamic_scale_for_fsdp: bool = False


@dataclass(kw_only=True, slots=True)
class HybridMXLinear:
    """`--quantize.linear.mx.*`: torchtitan 0.2's fields (training/float8.py)."""

    recipe_name: str = "mxfp8_cublas"
    """mxfp8_cublas, mxfp8_cublas_rceil (Blackwell), mxfp8_emulated or mxfp8_emulated_rceil."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Modules whose FQN contains one of these stay in high precision."""


@dataclass(kw_only=True, slots=True)
class HybridQuantizedLinear:
    float8: HybridFloat8Linear = field(default_factory=HybridFloat8Linear)
    mx: HybridMXLinear = field(default_factory=HybridMXLinear)


@dataclass(kw_only=True, slots=True)
class HybridFloat8GroupedMM:
    fqns: list[str] = field(default_factory=list)
    """The routed experts whose FQN contains one of these (empty: all of them)."""


@dataclass(kw_only=True, slots=True)
class HybridQuantizedGroupedMM:
    float8: HybridFloat8GroupedMM = field(default_factory=HybridFloat8GroupedMM)


@dataclass(kw_only=True, slots=True)
class HybridQuantize:
    """FP8 training in torchtitan 0.2's words: `converters` is 0.2's `model.converters` (0.3's
    model spec has no converters; a TOML job's `model.converters` lands here)."""

    converters: list[str] = field(default_factory=list)
    """quantize.linear.float8 or quantize.linear.mx, and / or quantize.grouped_mm.float8."""
    linear: HybridQuantizedLinear = field(default_factory=HybridQuantizedLinear)
    grouped_mm: HybridQuantizedGroupedMM = field(default_factory=HybridQuantizedGroupedMM)


@dataclass(kw_only=True, slots=True)
class HybridParallelismConfig(ParallelismConfig):
    """torchtitan 0.3's parallelism section with titan_hybrid's fields (as in a 0.2 job). The
    meshes titan_hybrid's parallel code uses ("fsdp", "efsdp") exist under the
    `partial_dtensor` SPMD backend, its default here."""

    spmd_backend: str = "partial_dtensor"
    data_parallel_sharding_strategy: str = "optim_grads_params"
    """Megatron-FSDP names: no_shard (DDP), optim (ZeRO-1), optim_grads (ZeRO-2),
    optim_grads_params (ZeRO-3)."""
    expert_parallel_overlap: bool = False
    """Each microbatch's forward runs with the previous one's backward (combined 1F1B)."""
    context_parallel_linear_mode: str = "head_a2a"
    """How context parallelism splits the Mamba2 (M) and GDN (G) layers: head_a2a or
    chunkwise."""
    expert_tensor_parallel_degree: int = 1
    """1, or tensor_parallel_degree (experts split like the dense MLPs)."""
    disable_loss_parallel: bool = False


@dataclass(kw_only=True, slots=True)
class HybridOptimizerSettings:
    """The optimizer, as a 0.2 job and the TOML jobs set it (0.3's own is a list of regex
    parameter groups); weight decay skips parameters with fewer than two dimensions."""

    name: str = "AdamW"
    lr: float = 8e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    implementation: str = "fused"


def run_from_parts(model: HybridModelArgs, *, flavor: str, dump_folder: str, training,
                   parallelism, compile_config, ac_config, seed: int | None = None,
                   dataloader=None, hf_assets_path: str = "pydoc_bpe", checkpoint=None,
                   validator=None, optimizer=None, lr_scheduler=None, metrics=None,
                   hybrid=None, quantize=None) -> RunConfig:
    """The RunConfig from torchtitan 0.3's config sections; those a stock trainer does not hand
    a ModelSpec's functions (None) take titan_hybrid's defaults."""
    validation = ValidationSection()
    if validator is not None:
        loader = getattr(validator, "dataloader", None)
        validation = section_from(
            ValidationSection, validator,
            dataset=getattr(loader, "dataset", validation.dataset),
            dataset_path=getattr(loader, "dataset_path", None),
            # torchtitan's own validator uses the training windows; titan_hybrid's has its own
            local_batch_size=getattr(validator, "local_batch_size", training.local_batch_size),
            seq_len=getattr(validator, "seq_len", training.seq_len))
    return RunConfig(
        model=model,
        flavor=flavor,
        dump_folder=dump_folder,
        training=section_from(TrainingSection, training, seed=seed),
        data=section_from(DataSection, dataloader, tokenizer_path=hf_assets_path),
        parallelism=section_from(
            ParallelismSection, parallelism,
            disable_sequence_parallel=not getattr(parallelism, "enable_sequence_parallel",
                                                  True)),
        checkpoint=section_from(CheckpointSection, checkpoint),
        validation=validation,
        compile=section_from(CompileSection, compile_config),
        activation_checkpoint=activation_checkpoint_section(ac_config),
        optimizer=section_from(OptimizerSection, optimizer),
        lr_scheduler=section_from(LRSchedulerSection, lr_scheduler),
        metrics=section_from(MetricsSection, metrics),
        hybrid=section_from(HybridSection, hybrid),
        float8=(Float8Section() if quantize is None else float8_section(
            quantize.converters, quantize.linear.float8, quantize.grouped_mm.float8.fqns,
            quantize.linear.mx)),
    )


@dataclass(kw_only=True, slots=True)
class HybridActivationCheckpoint:
    """The `--activation_checkpoint.*` section of titan_hybrid's trainer, as in a 0.2 job
    (titan_hybrid applies it: parallel/activation_checkpoint.py). 0.3's own section is a
    choice of policy classes without the every-N-th-layer option."""

    mode: str = "none"
    """none, full, selective or memory_budget."""
    selective_ac_option: str = "2"
    """With mode selective: "op" (per-op) or N (every N-th layer)."""
    memory_budget: float = 0.5
    preserve_rng_state: bool = True
    early_stop: bool = False


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
    hybrid = config.hybrid
    model = resolve_model_args(hybrid.flavor, pattern=hybrid.pattern,
                               seq_len=config.training.seq_len, seed=config.debug.seed,
                               base=model_args_from_hf(hybrid.model_config)
                               if hybrid.model_config else None)
    return run_from_parts(
        model, flavor=hybrid.flavor, dump_folder=config.dump_folder, training=config.training,
        parallelism=config.parallelism, compile_config=config.compile,
        ac_config=config.activation_checkpoint, seed=config.debug.seed,
        dataloader=config.dataloader, hf_assets_path=config.hf_assets_path,
        checkpoint=config.checkpoint, validator=config.validator, optimizer=config.optimizer,
        lr_scheduler=config.lr_scheduler, metrics=config.metrics, hybrid=hybrid,
        quantize=config.quantize)

"""The run configuration's sections: what titan_hybrid's options are, each section a frozen
dataclass (the bottom layer: it imports nothing of titan_hybrid's).

The sections keep the field names of the TOML jobs and of torchtitan 0.2 (`training.seq_len`,
`parallelism.tensor_parallel_degree`, ...), so an error can name a field as the user wrote it.
Three fields sit elsewhere in a torchtitan job: `dump_folder` (0.2: `job.dump_folder`),
`data.tokenizer_path` (`model.hf_assets_path`) and `training.seed` (`debug.seed`); the dataset
fields have a section of their own, `data` (0.2: in `training`). titan_hybrid.training.run_config
gathers them, with the model args, into the run's RunConfig.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class TrainingSection:
    steps: int = 10000
    seq_len: int = 2048
    local_batch_size: int = 8
    global_batch_size: int = -1
    max_norm: float = 1.0
    gc_freq: int = 50
    mixed_precision_param: str = "bfloat16"
    mixed_precision_reduce: str = "float32"
    enable_cpu_offload: bool = False
    seed: int | None = None


@dataclass(frozen=True)
class DataSection:
    dataset: str = "pydoc"
    dataset_path: str | None = None
    tokenizer_path: str = "pydoc_bpe"
    """The folder of the tokenizer (torchtitan's hf_assets_path)."""


@dataclass(frozen=True)
class ParallelismSection:
    data_parallel_replicate_degree: int = 1
    data_parallel_shard_degree: int = -1
    fsdp_reshard_after_forward: str = "default"
    tensor_parallel_degree: int = 1
    disable_loss_parallel: bool = False
    disable_sequence_parallel: bool = False
    pipeline_parallel_degree: int = 1
    pipeline_parallel_schedule: str = "1F1B"
    pipeline_parallel_microbatch_size: int = 1
    pipeline_parallel_layers_per_stage: int | None = None
    context_parallel_degree: int = 1
    context_parallel_linear_mode: str = "head_a2a"
    expert_parallel_degree: int = 1
    expert_tensor_parallel_degree: int = 1
    expert_parallel_overlap: bool = False
    data_parallel_sharding_strategy: str = "optim_grads_params"


@dataclass(frozen=True)
class CheckpointSection:
    enable: bool = False
    folder: str = "checkpoint"
    interval: int = 500
    keep_latest_k: int = 10
    async_mode: str = "disabled"
    load_step: int = -1
    initial_load_path: str | None = None
    initial_load_in_hf: bool = False
    last_save_in_hf: bool = False
    last_save_model_only: bool = False
    export_dtype: str = "float32"
    create_seed_checkpoint: bool = False
    resume_with_fresh_optimizer: bool = False


@dataclass(frozen=True)
class ValidationSection:
    enable: bool = False
    dataset: str = "pydoc"
    dataset_path: str | None = None
    local_batch_size: int = 8
    seq_len: int = 2048
    freq: int = 10
    steps: int = -1


@dataclass(frozen=True)
class CompileSection:
    enable: bool = False
    components: tuple[str, ...] = ("model", "loss")
    backend: str = "inductor"


@dataclass(frozen=True)
class ActivationCheckpointSection:
    mode: str = "none"
    selective_ac_option: str = "2"
    """An integer N (every N-th layer) or "op" (per-op selective AC)."""
    early_stop: bool = False
    memory_budget: float = 0.5
    visualize_memory_budget_pareto: bool = False
    preserve_rng_state: bool = True


@dataclass(frozen=True)
class OptimizerSection:
    name: str = "AdamW"
    lr: float = 8e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    implementation: str = "fused"


@dataclass(frozen=True)
class LRSchedulerSection:
    warmup_steps: int = 200
    decay_ratio: float | None = None
    decay_type: str = "linear"
    min_lr_factor: float = 0.0


@dataclass(frozen=True)
class MetricsSection:
    log_freq: int = 10


@dataclass(frozen=True)
class Float8Section:
    """FP8 training (training/float8.py): torchtitan's `quantize.linear.float8`, enabled when
    `model.converters` names it."""
    enable: bool = False
    recipe_name: str | None = None  # None: tensorwise, torchao's default
    emulate: bool = False
    filter_fqns: tuple[str, ...] = ()
    enable_fsdp_float8_all_gather: bool = False
    precompute_float8_dynamic_scale_for_fsdp: bool = False
    # `quantize.grouped_mm.float8` (when `model.converters` names it): the routed experts'
    # grouped GEMMs in float8 (rowwise), those whose FQN contains one of `grouped_mm_fqns`, or
    # all of them when it is empty
    grouped_mm: bool = False
    grouped_mm_fqns: tuple[str, ...] = ()
    # `quantize.linear.mx` (when `model.converters` names it): the Linear modules in MXFP8 by
    # this torchao recipe name, not in float8 (`enable` is set; `filter_fqns` are mx's)
    mx_recipe_name: str | None = None


@dataclass(frozen=True)
class HybridSection:
    """titan_hybrid's own options (the `[hybrid]` TOML section; each is documented where the
    torchtitan adapter declares it as a job field)."""
    pattern: str = ""
    loss_curve_file: str = ""
    document_masking: bool = False
    model_config: str = ""
    load_layers_by_order: bool = False


def section_from(section_cls, source, **renamed):
    """`section_cls` filled from `source`, any object with attributes of the same names (an
    adapter's torchtitan config section); `renamed` gives the values that the source holds
    under other names or elsewhere. Lists become tuples, so the section stays immutable."""
    values = {}
    for f in dataclasses.fields(section_cls):
        if f.name in renamed:
            value = renamed[f.name]
        elif hasattr(source, f.name):
            value = getattr(source, f.name)
        else:
            continue  # this torchtitan has no such field: the default holds
        values[f.name] = tuple(value) if isinstance(value, list) else value
    return section_cls(**values)

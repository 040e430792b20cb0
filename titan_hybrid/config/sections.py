"""The run configuration's sections: what titan_hybrid's options are, each section a frozen
dataclass (the bottom layer: it imports nothing of titan_hybrid's).

Each field is one option of the job. Its place in a TOML job and in torchtitan 0.2's JobConfig
is `<section>.<field>` (`training.seq_len`, `parallelism.tensor_parallel_degree`, ...) unless the
field says otherwise (`job_path`: `data.dataset` is a job's `training.dataset`), so an error can
name a field as the user wrote it. titan_hybrid.training.run_config gathers the sections, with
the model args, into the run's RunConfig.

The fields declared with `option(...)` are titan_hybrid's to declare: the options it adds, and
those of torchtitan 0.2's that torchtitan 0.3 lacks. Each carries its one help text. The
adapters build their command-line classes from these declarations (adapters/options.py): a
torchtitan that lacks an option's field gets it, with this default and this help. The other
fields are torchtitan's own in both generations, read as they are; their defaults here are
those of a RunConfig built without a job (tests, and a stock torchtitan trainer's model spec).

An enumerated field is typed `Literal[...]`, torchtitan's habit: that type is the one list of
its values (`choices` reads it; the code's tuples derive from it), the command line shows
it, and the RunConfig refuses any other value in one line (`check_choices`), from a flag
or a TOML file alike. The values of torchtitan's own enumerated fields are torchtitan's (the
same in 0.2.2 and 0.3.0).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field
from typing import Literal

HELP = "titan_hybrid.help"
JOB_PATH = "titan_hybrid.job_path"
OVERRIDES_TORCHTITAN = "titan_hybrid.overrides_torchtitan"


def option(default, help: str, *, job_path: str | None = None,
           overrides_torchtitan: bool = False):
    """A field that titan_hybrid declares, with its one help text. `job_path`: its place in a
    job when that is not `<section>.<field>`. `overrides_torchtitan`: torchtitan has the field
    with another default, and titan_hybrid's declaration (default and help) replaces it. An
    enumerated option's values are its `Literal[...]` type, which the help need not repeat:
    the command line shows them."""
    metadata = {HELP: " ".join(help.split())}
    if job_path:
        metadata[JOB_PATH] = job_path
    if overrides_torchtitan:
        metadata[OVERRIDES_TORCHTITAN] = True
    return field(default=default, metadata=metadata)


def torchtitans(job_path: str):
    """A field of torchtitan's whose place in a job is not `<section>.<field>`."""
    return {JOB_PATH: job_path}


def job_path(section_name: str, section_field: dataclasses.Field) -> str:
    """Where the field of the RunConfig's section `section_name` sits in a TOML / 0.2 job."""
    return section_field.metadata.get(JOB_PATH, f"{section_name}.{section_field.name}")


def help_text(section_field: dataclasses.Field) -> str | None:
    """The help of a field titan_hybrid declares (None: a field of torchtitan's)."""
    return section_field.metadata.get(HELP)


def choices(field_type) -> tuple | None:
    """The values of an enumerated type: `Literal[...]`, optionally `| None` (then None is no
    choice: it means "unset"), or a tuple / list of them (each item is one of the values);
    None for any other type."""
    origin = typing.get_origin(field_type)
    if origin is typing.Literal:
        return typing.get_args(field_type)
    if origin in (typing.Union, types.UnionType):
        found = [choices(arg) for arg in typing.get_args(field_type) if arg is not type(None)]
        return found[0] if len(found) == 1 else None
    if origin in (tuple, list):
        return choices(typing.get_args(field_type)[0])
    return None


@functools.cache
def section_choices(section_cls) -> dict[str, tuple]:
    """{field name: its values} of a section's enumerated fields."""
    hints = typing.get_type_hints(section_cls)
    return {f.name: found for f in dataclasses.fields(section_cls)
            if (found := choices(hints[f.name])) is not None}


def field_choices(section_cls, name: str) -> tuple:
    """The values of the enumerated field `name` of `section_cls`."""
    return section_choices(section_cls)[name]


def choice_error(path: str, value, values: tuple) -> ValueError:
    """The one line for a value that is not one of an option's."""
    return ValueError(f"{path}={value!r}: must be one of {', '.join(map(str, values))}")


def check_choices(section_name: str, section) -> None:
    """ValueError naming the first enumerated field of `section` (the RunConfig's section
    `section_name`) whose value is not one of its type's, by its job path. TOML values reach a
    section unchecked by the command-line parser (tyro only checks the flags it parses)."""
    section_values = section_choices(type(section))
    for section_field in dataclasses.fields(section):
        values = section_values.get(section_field.name)
        value = getattr(section, section_field.name)
        if values is None or value is None:
            continue
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if item not in values:
                raise choice_error(job_path(section_name, section_field), item, values)


@dataclass(frozen=True)
class TrainingSection:
    steps: int = 10000
    seq_len: int = 2048
    local_batch_size: int = 8
    global_batch_size: int = -1
    max_norm: float = 1.0
    gc_freq: int = 50
    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"
    mixed_precision_reduce: Literal["float32"] = "float32"
    enable_cpu_offload: bool = False
    seed: int | None = field(default=None, metadata=torchtitans("debug.seed"))


@dataclass(frozen=True)
class DataSection:
    """The training data (torchtitan 0.2: fields of `training`; 0.3: its `dataloader`)."""
    dataset: str = field(default="pydoc", metadata=torchtitans("training.dataset"))
    dataset_path: str | None = field(default=None, metadata=torchtitans("training.dataset_path"))
    tokenizer_path: str = field(default="pydoc_bpe", metadata=torchtitans("model.hf_assets_path"))


@dataclass(frozen=True)
class ParallelismSection:
    data_parallel_replicate_degree: int = 1
    data_parallel_shard_degree: int = -1
    # torchtitan's; titan_hybrid refuses all but "default" (pre-flight): resharding follows
    # data_parallel_sharding_strategy, one knob for it rather than two that can disagree
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    tensor_parallel_degree: int = 1
    disable_loss_parallel: bool = option(False, """
        With tensor parallelism, compute the loss on the gathered logits instead of on the
        vocabulary shards (loss parallelism).""")
    disable_sequence_parallel: bool = option(False, """
        With tensor parallelism, norms and the residual stream are sharded along the sequence
        between TP regions (all-gather on entry, reduce-scatter on exit) unless this is set.""")
    pipeline_parallel_degree: int = 1
    pipeline_parallel_schedule: str = "1F1B"
    pipeline_parallel_microbatch_size: int = 1
    pipeline_parallel_layers_per_stage: int | None = None
    context_parallel_degree: int = 1
    context_parallel_linear_mode: Literal["head_a2a", "chunkwise"] = option("head_a2a", """
        How context parallelism splits the recurrent layers (Mamba2, GDN, ...: every kind whose
        core is model/recurrent.py's RecurrentCore). head_a2a:
        two all-to-alls per layer and direction trade sequence shards for head shards (traffic
        grows with the sequence; heads per TP rank divisible by the CP degree). chunkwise:
        each rank keeps its tokens and heads and passes per-head state summaries (traffic
        independent of the sequence length; no head-count rule).""")
    expert_parallel_degree: int = 1
    expert_tensor_parallel_degree: int = option(1, """
        1, or tensor_parallel_degree (the experts split like the dense MLPs).""")
    expert_parallel_overlap: bool = option(False, """
        Run the forward of each microbatch together with the backward of the previous one so
        that their expert-parallel all-to-alls overlap the other's compute (combined 1F1B).
        Needs expert_parallel_degree > 1; at PP = 1 at least 2 microbatches per step (gradient
        accumulation), under PP the 1F1B or Interleaved1F1B schedule.""")
    data_parallel_sharding_strategy: Literal[
        "no_shard", "optim", "optim_grads", "optim_grads_params"] = option(
        "optim_grads_params", """
        Megatron-FSDP names: no_shard (DDP), optim (ZeRO-1), optim_grads (ZeRO-2),
        optim_grads_params (ZeRO-3). With HSDP it applies to the shard dimension.""")


@dataclass(frozen=True)
class CheckpointSection:
    enable: bool = False
    folder: str = "checkpoint"
    interval: int = 500
    keep_latest_k: int = 10
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    load_step: int = -1
    initial_load_path: str | None = None
    initial_load_in_hf: bool = False
    last_save_in_hf: bool = False
    last_save_model_only: bool = option(False, """
        Whether the last step's checkpoint holds the model only (torchtitan's default: true).
        titan_hybrid saves the full state so a finished run can be extended with more steps;
        set it for a smaller final artifact (a Hugging Face export is always model-only).""",
                                        overrides_torchtitan=True)
    export_dtype: Literal["float16", "bfloat16", "float32"] = "float32"
    create_seed_checkpoint: bool = False
    resume_with_fresh_optimizer: bool = option(False, """
        Resume from a model-only checkpoint (weights, no optimizer state): the weights load,
        the optimizer starts fresh, and the step, LR schedule and data position continue from
        the checkpoint's step. Without it such a checkpoint is refused as a resume point.""")


@dataclass(frozen=True)
class ValidationSection:
    """Validation on held-out data (torchtitan 0.3: its `validator`)."""
    enable: bool = False
    dataset: str = "pydoc"
    dataset_path: str | None = None
    local_batch_size: int = option(8, "Rows per validation batch on each data-parallel rank.")
    seq_len: int = option(2048, "Tokens per validation row.")
    freq: int = 10
    steps: int = -1


@dataclass(frozen=True)
class CompileSection:
    enable: bool = False
    components: tuple[str, ...] = ("model", "loss")
    backend: str = "inductor"


@dataclass(frozen=True)
class ActivationCheckpointSection:
    mode: Literal["selective", "full", "memory_budget", "none"] = option("none", """
        Which layers' activations are recomputed in the backward instead of kept: none, every
        checkpointed layer's (full), some (selective: selective_ac_option), or what fits
        memory_budget (the compiler picks).""")
    selective_ac_option: str = option("2", """
        With mode selective: an integer N (every N-th layer) or "op" (per-op selective AC).""")
    layer_kinds: str = option("", """
        With mode full or selective: checkpoint only the layers (or bracket groups) that hold
        one of these pattern symbols, e.g. "*-E" recomputes attention, MLP and MoE layers and
        keeps the recurrent layers' activations; empty: every layer.""")
    early_stop: bool = option(False, """
        Stop a checkpointed region's recompute as soon as the saved tensors are rebuilt.""")
    memory_budget: float = option(0.5, """
        With mode memory_budget: the fraction of activation memory to keep (0: recompute all,
        1: keep all); the compiler picks what to recompute.""")
    visualize_memory_budget_pareto: bool = False
    preserve_rng_state: bool = option(True, """
        Replay the forward's random state in the recompute (set false only for a model
        without randomness, to save the state's copies).""")


@dataclass(frozen=True)
class OptimizerSection:
    name: Literal["AdamW", "Adam"] = option("AdamW", "torch.optim's class of that name.")
    lr: float = option(8e-4, "The peak learning rate.")
    beta1: float = option(0.9, "Adam's beta1.")
    beta2: float = option(0.95, "Adam's beta2.")
    eps: float = option(1e-8, "Adam's epsilon.")
    weight_decay: float = option(0.1, """
        Decoupled weight decay; parameters with fewer than two dimensions (norms, biases, the
        SSM's A_log and D) take none.""")
    implementation: Literal["for-loop", "foreach", "fused"] = option("fused", """
        How torch's optimizer runs its step (the same arithmetic): fused, one kernel; foreach,
        a few batched ops; for-loop, one parameter at a time.""")


@dataclass(frozen=True)
class LRSchedulerSection:
    warmup_steps: int = 200
    decay_ratio: float | None = None
    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    min_lr_factor: float = 0.0


@dataclass(frozen=True)
class MetricsSection:
    log_freq: int = 10


# FP8: the `quantize.linear.float8` options, which the run's Float8Section extends (the job's
# other FP8 options are config/quantize.py's, which lists these with them).

# torchao's recipe names: one scale per tensor (the default), per row, per row with the
# weight-gradient GEMM in high precision
Float8Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]
# torchao's MXFP8 recipe names (the ones torchtitan 0.2 passes on): the scales rounded down
# (floor) or up (rceil) to a power of 2; emulated: MXFP8's rounding around high-precision GEMMs
MXRecipe = Literal["mxfp8_cublas", "mxfp8_cublas_rceil", "mxfp8_emulated", "mxfp8_emulated_rceil"]


@dataclass(frozen=True)
class Float8LinearOptions:
    """`quantize.linear.float8`: the Linear modules in float8."""
    recipe_name: Float8Recipe | None = option(None, """
        torchao's float8 recipe (unset: torchao's default, one scale per tensor).""")
    emulate: bool = option(False, """
        The float8 GEMMs as casts to float8 and back around a high-precision matmul (CPU).""")
    filter_fqns: tuple[str, ...] = option((), """
        Modules whose FQN contains one of these stay in high precision.""")
    enable_fsdp_float8_all_gather: bool = option(False, """
        FSDP gathers the weights in float8 (tensorwise scaling).""")
    precompute_float8_dynamic_scale_for_fsdp: bool = option(False, """
        Compute the gathered float8 weights' scales once per step, after the optimizer (needs
        enable_fsdp_float8_all_gather).""")


@dataclass(frozen=True)
class Float8Section(Float8LinearOptions):
    """FP8 training as the run applies it (quantize/float8.py), derived from the job's
    converters and the options above: the `quantize.linear.float8` options, with what the
    converters switch on (`enable`: the Linear modules, in float8 or, with `mx_recipe_name`,
    in MXFP8, whose `filter_fqns` are then mx's)."""
    enable: bool = False
    # the routed experts' grouped GEMMs in float8 (rowwise), those whose FQN contains one of
    # `grouped_mm_fqns` (Float8GroupedMMOptions.fqns), or all of them when it is empty
    grouped_mm: bool = False
    grouped_mm_fqns: tuple[str, ...] = ()
    mx_recipe_name: MXRecipe | None = None  # None: the Linear modules (if any) in float8


@dataclass(frozen=True)
class HybridSection:
    """titan_hybrid's own options (the `[hybrid]` TOML section, and the model's flavor)."""
    flavor: str = option("debug", """
        The named model shapes (titan_hybrid.model.args.hybrid_flavors); the job's pattern,
        sequence length and seed override theirs.""", job_path="model.flavor")
    pattern: str = option("", """
        Hybrid layer pattern overriding the flavor's (e.g. "M*M-E", "M[M*]-", "M*-/*-").""")
    loss_curve_file: str = option("", """
        If set, append each logged step's exact loss (and each validation's loss and
        perplexity) as a JSON line to this file. A relative path is taken under the dump
        folder, an absolute one as is. A resumed run first drops the lines of the steps it is
        about to log again.""")
    document_masking: bool = option(False, """
        Treat each row as documents packed back to back, each starting with the tokenizer's
        BOS token: attention stays inside a document, Mamba / GDN states and conv taps restart
        at each document, and rotary positions restart at 0 (Megatron's THD packing,
        torchtitan's block_causal). With context parallelism each row is zigzag-sharded as one
        sequence.""")
    model_config: str = option("", """
        An HF folder (or its config.json) whose model this job trains, in place of the flavor:
        the model args come from the config of its family (nemotron_h, deepseek_v3, ...;
        `python -m titan_hybrid.hf import` writes jobs that name one). With
        checkpoint.initial_load_path set to the same folder and checkpoint.initial_load_in_hf,
        training starts from its weights.""")
    hc_mult: int | None = option(None, """
        Hyper-connections (mHC, DeepSeek-V4 / Megatron's HybridModel) for any pattern: the
        residual stream becomes this many parallel streams, mixed around each layer by learned,
        Sinkhorn-projected weights; 0 turns them off. Unset: the flavor's.""")
    # The values of m_layers / g_layers are the model's (model/layer_kinds.VARIANTS, a layer
    # above this one): HybridModelArgs.validate refuses any other, in one line.
    m_layers: str | None = option(None, """
        What the pattern's `M` layers build: a variant of `M` (model/layer_kinds.VARIANTS;
        docs/patterns.md, "What `M` builds", lists them with their sections). Unset: the
        flavor's.""")
    g_layers: str | None = option(None, """
        What the pattern's `G` layers build: a variant of `G` (model/layer_kinds.VARIANTS;
        docs/patterns.md, "What `G` builds", lists them with their sections). Unset: the
        flavor's.""")
    load_layers_by_order: bool = option(False, """
        Read a checkpoint of another pattern: the k-th layer of each kind (attention, MLP, ...)
        loads the checkpoint's k-th layer of that kind; kinds it lacks keep their fresh init.
        For a plain transformer checkpoint into a grouped or hybrid pattern (use with
        checkpoint.initial_load_path).""")


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

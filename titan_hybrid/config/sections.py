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
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

HELP = "titan_hybrid.help"
JOB_PATH = "titan_hybrid.job_path"
OVERRIDES_TORCHTITAN = "titan_hybrid.overrides_torchtitan"


def option(default, help: str, *, job_path: str | None = None,
           overrides_torchtitan: bool = False):
    """A field that titan_hybrid declares, with its one help text. `job_path`: its place in a
    job when that is not `<section>.<field>`. `overrides_torchtitan`: torchtitan has the field
    with another default, and titan_hybrid's declaration (default and help) replaces it."""
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
    fsdp_reshard_after_forward: str = "default"
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
    context_parallel_linear_mode: str = option("head_a2a", """
        How context parallelism splits the Mamba2 (M), GDN (G) and KDA (K) layers. head_a2a:
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
    data_parallel_sharding_strategy: str = option("optim_grads_params", """
        Megatron-FSDP names: no_shard (DDP), optim (ZeRO-1), optim_grads (ZeRO-2),
        optim_grads_params (ZeRO-3). With HSDP it applies to the shard dimension.""")


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
    last_save_model_only: bool = option(False, """
        Whether the last step's checkpoint holds the model only (torchtitan's default: true).
        titan_hybrid saves the full state so a finished run can be extended with more steps;
        set it for a smaller final artifact (a Hugging Face export is always model-only).""",
                                        overrides_torchtitan=True)
    export_dtype: str = "float32"
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
    mode: str = option("none", "none, full, selective or memory_budget.")
    selective_ac_option: str = option("2", """
        With mode selective: an integer N (every N-th layer) or "op" (per-op selective AC).""")
    layer_kinds: str = option("", """
        With mode full or selective: checkpoint only the layers (or bracket groups) that hold
        one of these pattern symbols, e.g. "*-E" recomputes attention, MLP and MoE layers and
        keeps the Mamba / GDN / KDA layers' activations; empty: every layer.""")
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
    name: str = option("AdamW", "AdamW or Adam.")
    lr: float = option(8e-4, "The peak learning rate.")
    beta1: float = option(0.9, "Adam's beta1.")
    beta2: float = option(0.95, "Adam's beta2.")
    eps: float = option(1e-8, "Adam's epsilon.")
    weight_decay: float = option(0.1, """
        Decoupled weight decay; parameters with fewer than two dimensions (norms, biases, the
        SSM's A_log and D) take none.""")
    implementation: str = option("fused", "for-loop, foreach or fused.")


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
    """FP8 training as the run applies it (quantize/float8.py), derived from the job's
    `model.converters` and `quantize.*` options (config/quantize.py): torchtitan's
    `quantize.linear.float8`, enabled when `model.converters` names it."""
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
    m_layers: str | None = option(None, """
        What the pattern's `M` layers build: "mamba2", or "gdp", gated DeltaProduct (Megatron's
        gdp_stack_spec; its sizes and Householder steps in the model's `gdp` section). Unset:
        the flavor's.""")
    g_layers: str | None = option(None, """
        What the pattern's `G` layers build: "gdn", or "gdn2", gated DeltaNet-2 (Megatron's
        experimental_attention_variant "gdn2"; its sizes in the model's `gdn2` section).
        Unset: the flavor's.""")
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

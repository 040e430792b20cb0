"""torchtitan 0.2's job: titan_hybrid's additions to its JobConfig, and the run's RunConfig
built from a parsed job (`run_config`).

`JobConfig` here is torchtitan's JobConfig plus a `[hybrid]` section and a few fields in
`[parallelism]` and `[checkpoint]`. titan_hybrid's entry points (titan_hybrid.launch,
titan_hybrid.train) always parse jobs with it; with `python -m torchtitan.train` name it as
`[job] custom_config_module = "titan_hybrid.torchtitan_plugin"` in the TOML (or
`--job.custom_config_module titan_hybrid.torchtitan_plugin`). A job parsed without it
(torchtitan's plain JobConfig) gets titan_hybrid's fields at their defaults in its RunConfig.

One default differs from torchtitan's: `checkpoint.last_save_model_only` is false, so the last
step's checkpoint holds the optimizer too and a finished run can be extended with more steps.
"""

import logging
from dataclasses import dataclass, field

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from torchtitan.config import Checkpoint as TitanCheckpoint
from torchtitan.config import ConfigManager
from torchtitan.config import JobConfig as TitanJobConfig
from torchtitan.config import Parallelism as TitanParallelism

from titan_hybrid.config.sections import (
    ActivationCheckpointSection,
    CheckpointSection,
    CompileSection,
    DataSection,
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
from titan_hybrid.model.args import resolve_model_args
from titan_hybrid.training.float8 import float8_section
from titan_hybrid.training.run_config import RunConfig


@dataclass
class Hybrid:
    pattern: str = ""
    """Hybrid layer pattern overriding the flavor's (e.g. "M*M-E", "M[M*]-", "M*-/*-")."""

    loss_curve_file: str = ""
    """If set, append each logged step's exact loss (and each validation's loss and perplexity)
    as a JSON line to this file. A relative path is taken under job.dump_folder, an absolute one
    as is. A resumed run first drops the lines of the steps it is about to log again."""

    document_masking: bool = False
    """Treat each row as documents packed back to back, each starting with the tokenizer's BOS
    token: attention stays inside a document, Mamba / GDN states and conv taps restart at each
    document, and rotary positions restart at 0 (Megatron's THD packing, torchtitan's
    block_causal). With context parallelism each row is zigzag-sharded as one sequence."""

    model_config: str = ""
    """An HF folder (or its config.json) whose model this job trains, in place of
    model.flavor: the model args come from the config of its family (nemotron_h,
    deepseek_v3, ...; `python -m titan_hybrid.hf import` writes jobs that name one). With
    --checkpoint.initial_load_path set to the same folder and --checkpoint.initial_load_in_hf,
    training starts from its weights."""

    load_layers_by_order: bool = False
    """Read a checkpoint of another pattern: the k-th layer of each kind (attention, MLP, ...)
    loads the checkpoint's k-th layer of that kind; kinds it lacks keep their fresh init. For
    a plain transformer checkpoint into a grouped or hybrid pattern (use with
    --checkpoint.initial_load_path)."""


@dataclass
class Parallelism(TitanParallelism):
    data_parallel_sharding_strategy: str = "optim_grads_params"
    """Megatron-FSDP names: no_shard (DDP), optim (ZeRO-1), optim_grads (ZeRO-2),
    optim_grads_params (ZeRO-3). With HSDP it applies to the shard dimension."""

    expert_parallel_overlap: bool = False
    """Run the forward of each microbatch together with the backward of the previous one so
    that their expert-parallel all-to-alls overlap the other's compute (combined 1F1B). Needs
    expert_parallel_degree > 1; at PP = 1 at least 2 microbatches per step (gradient
    accumulation), under PP the 1F1B or Interleaved1F1B schedule."""

    context_parallel_linear_mode: str = "head_a2a"
    """How context parallelism splits the Mamba2 (M) and GDN (G) layers. head_a2a: two
    all-to-alls per layer and direction trade sequence shards for head shards (traffic grows
    with the sequence; heads per TP rank divisible by the CP degree). chunkwise: each rank
    keeps its tokens and heads and passes per-head state summaries (traffic independent of
    the sequence length; no head-count rule)."""

    disable_sequence_parallel: bool = False
    """With tensor parallelism, norms and the residual stream are sharded along the sequence
    between TP regions (all-gather on entry, reduce-scatter on exit) unless this is set."""


@dataclass
class Checkpoint(TitanCheckpoint):
    last_save_model_only: bool = False
    """Whether the last step's checkpoint holds the model only (torchtitan's default: true).
    titan_hybrid saves the full state so a finished run can be extended with more steps; set
    it for a smaller final artifact (a Hugging Face export is always model-only)."""

    resume_with_fresh_optimizer: bool = False
    """Resume from a model-only checkpoint (weights, no optimizer state): the weights load,
    the optimizer starts fresh, and the step, LR schedule and data position continue from the
    checkpoint's step. Without it such a checkpoint is refused as a resume point."""


@dataclass
class JobConfig(TitanJobConfig):
    hybrid: Hybrid = field(default_factory=Hybrid)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)


def _require(condition: bool, field: str, value, rule: str) -> None:
    if not condition:
        raise ValueError(f"{field}={value!r} {rule}")


def run_config(job: TitanJobConfig) -> RunConfig:
    """The run's own configuration from a torchtitan 0.2 job, parsed with this JobConfig or
    with torchtitan's plain one (`python -m torchtitan.train` without `custom_config_module`:
    titan_hybrid's fields take their defaults). Resolves and validates the model args;
    ValueError names the field of a job that titan_hybrid cannot run."""
    _require(job.model.name == "hybrid", "model.name", job.model.name,
             "is not 'hybrid': titan_hybrid's trainer runs hybrid models (use "
             "torchtitan.train for others)")
    _require(not job.fault_tolerance.enable, "fault_tolerance.enable", True,
             "is not supported by titan_hybrid's trainer (its checkpoints are committed "
             "synchronously by every rank)")
    _require(not job.optimizer.early_step_in_backward, "optimizer.early_step_in_backward", True,
             "is not supported by titan_hybrid's trainer")
    hybrid = section_from(HybridSection, getattr(job, "hybrid", None))
    training = section_from(TrainingSection, job.training, seed=job.debug.seed)
    model = resolve_model_args(job.model.flavor, pattern=hybrid.pattern,
                               seq_len=training.seq_len, seed=training.seed,
                               base=model_args_from_hf(hybrid.model_config)
                               if hybrid.model_config else None)
    return RunConfig(
        model=model,
        flavor=job.model.flavor,
        dump_folder=job.job.dump_folder,
        training=training,
        data=section_from(DataSection, job.training, tokenizer_path=job.model.hf_assets_path),
        parallelism=section_from(ParallelismSection, job.parallelism),
        checkpoint=section_from(CheckpointSection, job.checkpoint),
        validation=section_from(ValidationSection, job.validation),
        compile=section_from(CompileSection, job.compile),
        activation_checkpoint=section_from(ActivationCheckpointSection,
                                           job.activation_checkpoint),
        optimizer=section_from(OptimizerSection, job.optimizer),
        lr_scheduler=section_from(LRSchedulerSection, job.lr_scheduler),
        metrics=section_from(MetricsSection, job.metrics),
        hybrid=hybrid,
        float8=float8_section(job.model.converters, job.quantize.linear.float8,
                              job.quantize.grouped_mm.float8.fqns, job.quantize.linear.mx),
    )


def _config_file(job_args: list[str]) -> str:
    """The --job.config_file value in the command line ('' if none)."""
    for index, arg in enumerate(job_args):
        if arg.startswith("--job.config_file="):
            return arg.split("=", 1)[1]
        if arg in ("--job.config_file", "--job.config-file") and index + 1 < len(job_args):
            return job_args[index + 1]
    return ""


def parse_job(job_args: list[str]) -> JobConfig:
    """The job from the command line (`--job.config_file F --section.field value ...`),
    parsed with titan_hybrid's JobConfig; a user error becomes ValueError."""
    # torchtitan logs a traceback before re-raising a TOML error; the message below says it.
    logging.disable(logging.ERROR)
    try:
        return ConfigManager(config_cls=JobConfig).parse_args(job_args)
    except FileNotFoundError as error:
        raise ValueError(f"job.config_file '{error.filename}' does not exist") from None
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"job.config_file '{_config_file(job_args)}' is not valid TOML: "
                         f"{error}") from None
    except AssertionError as error:  # torchtitan's own field checks (e.g. validation.steps)
        raise ValueError(f"job config: {error}") from None
    except ModuleNotFoundError as error:  # job.custom_config_module names no module
        raise ValueError(
            f"job.custom_config_module '{error.name}' cannot be imported (titan_hybrid's job "
            "sections are in 'titan_hybrid.torchtitan_plugin')") from None
    finally:
        logging.disable(logging.NOTSET)

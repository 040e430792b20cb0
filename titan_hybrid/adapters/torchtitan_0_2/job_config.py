"""torchtitan 0.2's job: titan_hybrid's additions to its JobConfig, and the run's RunConfig
built from a parsed job (`run_config`).

`JobConfig` here is torchtitan's JobConfig plus the options titan_hybrid declares and torchtitan
0.2 lacks (titan_hybrid/config: a `[hybrid]` section and a few fields in `[parallelism]` and
`[checkpoint]`), built from those declarations (adapters/options.py). titan_hybrid's entry
points (titan_hybrid.launch, titan_hybrid.train) always parse jobs with it; with
`python -m torchtitan.train` name it as `[job] custom_config_module = "titan_hybrid.torchtitan_plugin"` in the TOML (or
`--job.custom_config_module titan_hybrid.torchtitan_plugin`). A job parsed without it
(torchtitan's plain JobConfig) gets titan_hybrid's fields at their defaults in its RunConfig.

One default differs from torchtitan's: `checkpoint.last_save_model_only` is false, so the last
step's checkpoint holds the optimizer too and a finished run can be extended with more steps.
"""

import dataclasses
import logging

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from torchtitan.config import ConfigManager
from torchtitan.config import JobConfig as TitanJobConfig

from titan_hybrid.adapters.options import (
    attribute_reader,
    check_quantize_choices,
    declared_options,
    read_sections,
    run_config_from,
    with_options,
)
from titan_hybrid.quantize.float8 import float8_section
from titan_hybrid.training.run_config import RunConfig


def _job_config() -> type:
    """torchtitan's JobConfig with each section that lacks one of titan_hybrid's options
    replaced by a subclass that has it (or, for `[hybrid]`, added)."""
    titan_sections = {f.name: f.default_factory for f in dataclasses.fields(TitanJobConfig)}
    sections = dict.fromkeys(path.partition(".")[0] for path, _, _ in declared_options())
    fields = []
    for section in sections:
        base = titan_sections.get(section)
        cls = with_options(section.title().replace("_", ""), base, section, module=__name__)
        # the same Field objects as torchtitan's: the section needed nothing
        if base is None or dataclasses.fields(cls) != dataclasses.fields(base):
            globals()[cls.__name__] = cls
            fields.append((section, cls, dataclasses.field(default_factory=cls)))
    cls = dataclasses.make_dataclass("JobConfig", fields, bases=(TitanJobConfig,))
    cls.__module__ = __name__
    cls.__doc__ = "torchtitan 0.2's JobConfig with titan_hybrid's options."
    return cls


JobConfig = _job_config()


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
    read = attribute_reader(job)
    check_quantize_choices(read)
    return run_config_from(
        read_sections(read), dump_folder=job.job.dump_folder,
        float8=float8_section(job.model.converters, job.quantize.linear.float8,
                              job.quantize.grouped_mm.float8.fqns, job.quantize.linear.mx))


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

"""titan_hybrid's TOML front end (titan_hybrid.launch / titan_hybrid.train) under torchtitan 0.2:
the four steps every front end has, with the same names as torchtitan_0_3/front_end.py."""

from __future__ import annotations

from titan_hybrid.adapters.command_line import one_line_parse_errors, refuse_0_3_names
from titan_hybrid.adapters.options import enumerated_paths
from titan_hybrid.adapters.torchtitan_0_2 import job_config
from titan_hybrid.adapters.torchtitan_0_2.train_spec import register_hybrid_train_spec
from titan_hybrid.adapters.torchtitan_0_2.trainer import HybridTrainer
from titan_hybrid.data.loader import register_pydoc_dataset
from titan_hybrid.runtime import cpu
from titan_hybrid.training.run_config import RunConfig

_active = False


def activate() -> None:
    """Register the TrainSpec "hybrid" and the "pydoc" dataset, and apply the CPU runtime on a
    machine without an accelerator; later calls do nothing."""
    global _active
    if _active:
        return
    cpu.apply()
    register_pydoc_dataset()
    register_hybrid_train_spec()
    _active = True


def parse_job(args: list[str]) -> job_config.JobConfig:
    """The job of `--job.config_file F --section.field value ...`; ValueError: one line."""
    refuse_0_3_names(args)
    with one_line_parse_errors(enumerated_paths()):
        return job_config.parse_job(args)


def run_config(job: job_config.JobConfig) -> RunConfig:
    return job_config.run_config(job)


def build_trainer(job: job_config.JobConfig, run: RunConfig) -> HybridTrainer:
    return HybridTrainer(job, run)

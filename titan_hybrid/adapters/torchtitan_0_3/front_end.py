"""titan_hybrid's TOML front end (titan_hybrid.launch / titan_hybrid.train) under torchtitan 0.3:
the same job files and flags as under 0.2 (`--job.config_file F --section.field value ...`,
with 0.2's names, translated by titan_hybrid/adapters/command_line.py), parsed onto
HybridTrainer.Config the way 0.3's own ConfigManager parses `--module/--config` jobs."""

from __future__ import annotations

import logging
from pathlib import Path

import tyro
from torchtitan.config.manager import ConfigManager, custom_registry

from titan_hybrid.adapters.command_line import config_file, flags_for_0_3, one_line_parse_errors
from titan_hybrid.adapters.options import enumerated_paths
from titan_hybrid.adapters.torchtitan_0_3 import config as job_config
from titan_hybrid.adapters.torchtitan_0_3.toml_job import apply_toml
from titan_hybrid.adapters.torchtitan_0_3.trainer import HybridTrainer
from titan_hybrid.adapters.torchtitan_0_3.user_errors import user_errors_raised
from titan_hybrid.data.loader import register_pydoc_dataset
from titan_hybrid.runtime import cpu
from titan_hybrid.training.run_config import RunConfig


def activate() -> None:
    """Register the pydoc dataset and apply the CPU runtime (both once per process)."""
    cpu.apply()
    register_pydoc_dataset()


def parse_job(args: list[str]) -> HybridTrainer.Config:
    """The job of `--job.config_file F --section.field value ...`; ValueError: one line."""
    path, args = config_file(args)
    if path and not Path(path).is_file():
        raise ValueError(f"job.config_file '{path}' does not exist")
    args = flags_for_0_3(args)
    ConfigManager()  # registers torchtitan's parsing rules (comma-separated lists) with tyro
    # torchtitan warns at every construction of a checkpoint section without an initial load
    # path; the launcher's process has no log handler yet, and the message means nothing here.
    logging.disable(logging.WARNING)
    try:
        base = HybridTrainer.Config()
        if path:
            base = apply_toml(base, Path(path))
        with user_errors_raised(), one_line_parse_errors(enumerated_paths()):
            return tyro.cli(type(base), args=args, default=base, registry=custom_registry)
    finally:
        logging.disable(logging.NOTSET)


def run_config(config: HybridTrainer.Config) -> RunConfig:
    return job_config.run_config(config)


def build_trainer(config: HybridTrainer.Config, run: RunConfig) -> HybridTrainer:
    return HybridTrainer(config)

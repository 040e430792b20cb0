"""RunConfigs for tests, from command-line arguments as a user writes them, mapped by the
torchtitan adapter that titan_hybrid's entry points use."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from titan_hybrid.adapters.torchtitan_0_2.job_config import parse_job, run_config
from titan_hybrid.model.args import HybridModelArgs
from titan_hybrid.training.run_config import RunConfig

CONFIGS = Path(__file__).resolve().parents[1] / "train_configs"


def run_from_args(*args: str, model: HybridModelArgs | None = None,
                  config_file: str | Path | None = CONFIGS / "hybrid.toml") -> RunConfig:
    """The RunConfig of `config_file` with `args` on the command line; `model` replaces its
    resolved model args (a test's own shapes). Without a config file: torchtitan's defaults
    for a hybrid model of flavor "debug"."""
    source = (["--job.config_file", str(config_file)] if config_file else
              ["--model.name", "hybrid", "--model.flavor", "debug"])
    run = run_config(parse_job([*source, *args]))
    return run if model is None else dataclasses.replace(run, model=model)

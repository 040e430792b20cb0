"""torchtitan 0.3's config registry for titan_hybrid: what
`python -m torchtitan.train --module titan_hybrid --config NAME` reads (through torchrun).

One zero-argument function per TOML job in train_configs/, named after the file's stem
(`hybrid`, `hybrid_moe`, `nemotron_h_1b`, ...): it returns that job as titan_hybrid's
HybridTrainer.Config, to which torchtitan applies the command line (`--hybrid.pattern`,
`--parallelism.*`, `--checkpoint.*`, ...).

An entry point: importing it applies the CPU runtime on machines without an accelerator and
registers the pydoc dataset (as titan_hybrid.torchtitan_plugin does under 0.2). torchtitan
swallows an ImportError raised while importing a registry and reports only that the module
cannot be imported, so one raised here is re-raised as a RuntimeError that keeps its cause.
"""

from __future__ import annotations

from pathlib import Path

try:
    from titan_hybrid.adapters.torchtitan_0_3.components import (
        HybridDataLoaderConfig as HybridDataLoader,
    )
    from titan_hybrid.adapters.torchtitan_0_3.components import HybridLoss
    from titan_hybrid.adapters.torchtitan_0_3.front_end import activate
    from titan_hybrid.adapters.torchtitan_0_3.model_spec import model_spec
    from titan_hybrid.adapters.torchtitan_0_3.toml_job import apply_toml
    from titan_hybrid.adapters.torchtitan_0_3.trainer import HybridTrainer
except ImportError as error:
    raise RuntimeError(f"titan_hybrid's config registry cannot be imported: {error!r} (the "
                       "installed torchtitan must be 0.3.x for --module titan_hybrid; under "
                       "0.2 use --experimental.custom_import titan_hybrid.torchtitan_plugin)"
                       ) from error

TRAIN_CONFIGS = Path(__file__).resolve().parents[1] / "train_configs"

activate()


def _job_function(path: Path):
    def config() -> HybridTrainer.Config:
        return apply_toml(HybridTrainer.Config(), path)

    config.__name__ = config.__qualname__ = path.stem
    config.__doc__ = f"The job {path.relative_to(TRAIN_CONFIGS.parent)} under torchtitan 0.3."
    return config


JOBS = sorted(TRAIN_CONFIGS.glob("*.toml"))
globals().update({path.stem: _job_function(path) for path in JOBS})
# The config functions, and `model_spec`, `HybridLoss` (and `HybridDataLoader`, the
# layout-independent batches) for a torchtitan 0.3 job of your own (docs/torchtitan_0_3.md,
# "Using the model from any torchtitan job").
__all__ = [path.stem for path in JOBS] + ["model_spec", "HybridLoss", "HybridDataLoader"]

"""A user's own torchtitan 0.3 job with titan_hybrid's model spec (a stock Trainer, which runs
none of titan_hybrid's pre-flight): a parallelism field titan_hybrid does not honour is refused
by name where the model spec checks the layout, not ignored."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig

from titan_hybrid.adapters.torchtitan_0_3.model_spec import HybridBuild, HybridModelConfig
from titan_hybrid.model.args import resolve_model_args


def _checked(parallelism: ParallelismConfig):
    build = HybridBuild(HybridModelConfig(flavor="debug", args=resolve_model_args("debug", seq_len=256)))
    return build.checked_run(parallel_dims=SimpleNamespace(world_size=1),
                             training=TrainingConfig(), parallelism=parallelism,
                             compile_config=CompileConfig(), ac_config=None, dump_folder="out")


def test_the_default_is_taken():
    assert _checked(ParallelismConfig()).parallelism.fsdp_reshard_after_forward == "default"


def test_fsdp_reshard_after_forward_is_refused_by_name():
    with pytest.raises(ValueError, match="^parallelism.fsdp_reshard_after_forward='never' is "
                                         "not supported"):
        _checked(ParallelismConfig(fsdp_reshard_after_forward="never"))

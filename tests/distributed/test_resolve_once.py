"""A run builds its RunConfig (with its model args) once and validates its layout once, on every
rank, whether titan_hybrid's entry point or torchtitan's own trainer runs it (counted in real
runs by tests/distributed/resolve_once_probe.py)."""

from __future__ import annotations

import json
import re

import pytest

from tests.launch import REPO_ROOT, run_training

PROBE = "tests.distributed.resolve_once_probe"


def probes(output: str) -> list[dict]:
    # The ranks share one output stream: take each record whole, wherever its line breaks.
    return [json.loads(record) for record in re.findall(r"PROBE (\{[^{}]*\})", output)]


def plain_torchtitan_job(tmp_path):
    """hybrid.toml without titan_hybrid's job-config extension: torchtitan parses it."""
    toml = (REPO_ROOT / "train_configs" / "hybrid.toml").read_text()
    toml = toml.replace('custom_config_module = "titan_hybrid.torchtitan_plugin"', "")
    toml = toml.split("[hybrid]")[0] + "[optimizer]" + toml.split("[optimizer]")[1]
    config = tmp_path / "plain.toml"
    config.write_text(toml)
    return config


@pytest.mark.extended
@pytest.mark.parametrize("entry, pipeline", [
    ("titan_hybrid.train", 1), ("titan_hybrid.train", 2), ("torchtitan.train", 2)])
def test_job_and_model_args_resolved_and_layout_validated_once(tmp_path, entry, pipeline):
    """torchtitan.train with PP2 is also tests/distributed/test_train.py's stock entry at PP2 (a
    user's own torchtitan job, with only --experimental.custom_import): it trains 2 steps, the
    pipeline's loss taking no token count from torchtitan's trainer
    (pipeline.GlobalTokenScaledLoss)."""
    stock = entry == "torchtitan.train"
    job = ("--training.steps", "2" if stock else "1", "--training.seq_len", "64",
           "--parallelism.pipeline_parallel_degree", str(pipeline))
    if stock:
        job += ("--job.config_file", str(plain_torchtitan_job(tmp_path)),
                "--experimental.custom_import", "titan_hybrid.torchtitan_plugin")
    result = run_training(tmp_path, "--probe-entry", entry, *job, module=PROBE, nproc=pipeline)
    result.check()
    if stock:
        assert "step:  2" in result.output, result.output[-3000:]
    counted = probes(result.output)
    assert len(counted) == pipeline, result.output[-3000:]
    for rank in counted:
        assert rank["model_args_objects"] == 1, rank
        # A pipeline stage is a copy of the model, its config included (torchtitan's split).
        assert rank["copied_with_stages"] == (1 if pipeline > 1 else 0), rank
        assert rank["validate_layout"] == 1, rank  # the pre-flight check, or the first stage
        assert rank["run_configs"] == 1 and rank["resolve_model_args"] == 1, rank

"""The torchtitan entry points end to end, in real processes (gloo on CPU)."""

import math
import re

import pytest

from tests.launch import REPO_ROOT, run_training

STEPS = ("--training.steps", "4")


def test_default_job_learns_and_reports_throughput(tmp_path):
    result = run_training(tmp_path, "--training.steps", "8").check()
    losses = result.losses
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    assert losses[0] > math.log(2048) - 0.5  # starts near uniform over the vocabulary
    assert min(losses[-3:]) < losses[0] - 1.0
    assert "tps:" in result.output and "Peak FLOPS used for computing MFU" in result.output
    # MFU against this machine's measured matmul rate (runtime/cpu.py), not an A100's (which
    # would give well under 1%). That rate is the best of a few measurements, which a machine
    # loaded by other processes underestimates (MFU 100.5% seen once so): the upper bound
    # catches a FLOP count or a denominator off by an order of magnitude, not the load.
    mfus = [float(m) for m in re.findall(r"mfu: ([0-9.]+)%", result.output)]
    assert len(mfus) == 8 and 1.0 < max(mfus[1:]) < 300.0


def test_seed_and_deterministic_mode_reproduce_bitwise(tmp_path):
    args = (*STEPS, "--training.seq_len", "128", "--debug.seed", "7", "--debug.deterministic")
    first = run_training(tmp_path, *args).check()
    second = run_training(tmp_path, *args).check()
    assert first.losses == second.losses
    other_seed = run_training(tmp_path, "--training.steps", "1", "--debug.seed", "8").check()
    assert other_seed.losses[0] != first.losses[0]


@pytest.mark.extended
def test_pattern_override_and_moe_mtp_job(tmp_path):
    grouped = run_training(tmp_path, "--training.steps", "2",
                           "--hybrid.pattern", "[M*]-G").check()
    assert '"pattern": "[M*]-G"' in grouped.output
    moe = run_training(tmp_path, "--training.steps", "6", config="hybrid_moe.toml").check()
    assert '"pattern": "M*EME/*-"' in moe.output
    assert len(moe.losses) == 6 and moe.losses[-1] < moe.losses[0] - 0.5


@pytest.mark.parametrize("pipeline", [1])
def test_stock_torchtitan_entry_with_custom_import(tmp_path, pipeline):
    # A user's own torchtitan job: `python -m torchtitan.train` with only
    # --experimental.custom_import; no titan_hybrid job-config extension. PP2 runs in
    # tests/distributed/test_resolve_once.py (the same job, its arguments counted).
    toml = (REPO_ROOT / "train_configs" / "hybrid.toml").read_text()
    toml = toml.replace('custom_config_module = "titan_hybrid.torchtitan_plugin"', "")
    toml = toml.split("[hybrid]")[0] + "[optimizer]" + toml.split("[optimizer]")[1]
    config = tmp_path / "plain.toml"
    config.write_text(toml)
    result = run_training(tmp_path, "--job.config_file", str(config), "--training.steps", "2",
                          "--training.seq_len", "128",
                          "--parallelism.pipeline_parallel_degree", str(pipeline),
                          "--experimental.custom_import", "titan_hybrid.torchtitan_plugin",
                          module="torchtitan.train", nproc=pipeline)
    result.check()
    assert "step:  2" in result.output


def test_activation_checkpointing_leaves_the_loss_bitwise_unchanged(tmp_path):
    args = ("--training.steps", "2", "--training.seq_len", "128")
    plain = run_training(tmp_path, *args).check()
    full = run_training(tmp_path, *args, "--activation_checkpoint.mode", "full").check()
    # per-op selective AC on the recurrent layers only (activation_checkpoint.layer_kinds)
    selective = run_training(tmp_path, *args, "--activation_checkpoint.mode", "selective",
                             "--activation_checkpoint.selective_ac_option", "op",
                             "--activation_checkpoint.layer_kinds", "MG").check()
    assert plain.losses == full.losses == selective.losses
    # the debug flavor's M-*-M-G-: the layers 0, 4 and 6
    assert ("Applied activation checkpointing (selective op, layer kinds MG) of 3 of 8 layers"
            in selective.output)


def test_a_local_corpus_trains_and_validates_on_another_local_set(tmp_path):
    import json

    corpus, held_out = tmp_path / "corpus", tmp_path / "held_out"
    for folder, offset in ((corpus, 0), (held_out, 1000)):
        folder.mkdir()
        (folder / "docs.jsonl").write_text("".join(
            json.dumps({"text": f"record {offset + i}: " + "alpha beta gamma delta " * (i % 5 + 1)})
            + "\n" for i in range(200)))
    result = run_training(tmp_path, "--training.steps", "3", "--training.seq_len", "64",
                          "--training.dataset_path", str(corpus), "--validation.enable",
                          "--validation.dataset_path", str(held_out), "--validation.freq", "3",
                          "--validation.steps", "2", "--validation.seq_len", "64").check()
    assert len(result.losses) == 3 and len(result.validation_losses) >= 1
    # The local data, not the default corpus: that run's curve differs.
    default = run_training(tmp_path / "outputs", "--training.steps", "3",
                           "--training.seq_len", "64").check()
    assert result.losses != default.losses

"""Under torchtitan 0.3, the rest of what holds under both generations (the layouts, the
checkpoints across generations and the 0.2 curve are in test_adapter.py): compile and the
divergence guard, through `torchtitan.train` and through titan_hybrid's launcher."""

from __future__ import annotations

import pytest

from tests.torchtitan_0_3.test_adapter import SMALL, curve, one_process_curve, torchtitan_run
from tests.torchtitan_0_3.test_front_end import run_train

CURVE = ("--hybrid.loss_curve_file", "curve.jsonl")


def test_compile_gives_the_eager_curve(tmp_path, tmp_path_factory):
    eager = one_process_curve(tmp_path_factory, "hybrid", (*SMALL, *CURVE))
    compiled = torchtitan_run(tmp_path, *SMALL, *CURVE, "--compile.enable")
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    assert "Compiled each layer / bracket group (backend inductor)" in compiled.stdout
    for a, b in zip(eager, curve(tmp_path / "curve.jsonl"), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)


DIVERGING = ("--training.steps", "4", "--training.seq_len", "64", "--optimizer.lr", "1e4",
             "--checkpoint.enable", "--checkpoint.interval", "1")
PIPELINE = ("--parallelism.pipeline_parallel_degree", "2")


def test_divergence_stops_every_stage_before_the_step_is_applied_or_saved(tmp_path):
    stock = torchtitan_run(tmp_path / "stock", *DIVERGING, *PIPELINE, nproc=2)
    output = stock.stdout + stock.stderr
    assert stock.returncode != 0
    assert "error: training diverged at step 2:" in output
    assert "gradient norm = nan on rank 0" in output  # the first stage's gradients too
    assert "divergence.py" not in output  # no worker's traceback, under torchrun's recorder
    assert sorted(p.name for p in (tmp_path / "stock" / "checkpoint").iterdir()) == ["step-1"]
    # titan_hybrid's launcher: one line, exit status 3
    ours = run_train(tmp_path / "ours", *DIVERGING, *PIPELINE, ngpu=2)
    assert ours.returncode == 3, ours.stderr[-3000:]
    assert ours.stderr.count("error: training diverged at step 2:") == 1
    assert "Traceback" not in ours.stdout + ours.stderr
    assert sorted(p.name for p in (tmp_path / "ours" / "checkpoint").iterdir()) == ["step-1"]

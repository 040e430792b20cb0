"""Under torchtitan 0.3, the rest of what holds under both generations (the layouts, the
checkpoints across generations and the 0.2 curve are in test_adapter.py): compile and the
divergence guard, through `torchtitan.train` and through titan_hybrid's launcher, and Hugging
Face checkpoints through torchtitan's own checkpointer in a user's job."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_hf_checkpoint import hf_checkpoint, safetensors_of  # noqa: F401  (fixtures)
from tests.torchtitan_0_3.test_adapter import (
    SMALL,
    curve,
    one_process_curve,
    readme_registry,
    torchtitan_run,
    user_job_run,
)
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
    stock = torchtitan_run(tmp_path / "stock", *DIVERGING, *PIPELINE, nproc=2,
                           fork_workers=False)  # what torchrun's recorder prints
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


HF_ROUND_TRIP = ("--checkpoint.enable", "--checkpoint.initial_load_in_hf",
                 "--checkpoint.last_save_in_hf", "--training.steps", "1",
                 "--optimizer.param-groups.0.optimizer-kwargs.lr", "0")


@pytest.mark.parametrize("nproc, layout", [(1, ()), (2, ()),
                                           (2, ("--parallelism.tensor_parallel_degree", "2"))],
                         ids=["one-process", "fsdp2", "tp2"])
def test_hf_load_and_save_through_torchtitans_checkpointer_in_a_users_job(
        tmp_path, hf_checkpoint, nproc, layout):  # noqa: F811  (the imported fixture)
    """The README's registry with an HF-format model (`model_spec("debug_nemotron_h")`):
    torchtitan 0.3's own checkpointer reads a transformers checkpoint and writes it back
    through titan_hybrid's state_dict_adapter. At lr 0 the weights do not move, so every tensor
    comes back bit for bit (a tensor the load missed would come back as its random init).
    Under TP the fused Mamba2 tensors are interleaved per rank: refused, naming the tensor."""
    registry = readme_registry().replace('model_spec("debug_moe")',
                                         'model_spec("debug_nemotron_h")')
    assert registry != readme_registry()
    result = user_job_run(tmp_path, *HF_ROUND_TRIP, "--checkpoint.initial_load_path",
                          str(hf_checkpoint), *layout, nproc=nproc, registry=registry)
    if layout:
        assert result.returncode != 0
        assert ("HF tensor 'backbone.layers.0.mixer.in_proj.weight': 'layers.0.mamba.in_proj"
                ".weight' is split by tensor parallelism") in result.stderr
        return
    assert result.returncode == 0, result.stderr[-3000:]
    original = safetensors_of(hf_checkpoint)
    written = safetensors_of(tmp_path / "out" / "checkpoint" / "step-1")
    assert sorted(written) == sorted(original) and len(original) == 44
    for key, tensor in original.items():
        assert torch.equal(written[key], tensor), key


def test_float8_training_takes_the_same_words_under_0_3(tmp_path, tmp_path_factory):
    """FP8 under 0.3: torchtitan's own command with the quantize section (0.3's model spec has
    no converters: `--quantize.converters`), and titan_hybrid's launcher with 0.2's
    `--model.converters`, convert the same modules and give the same curve, float8's rounding
    away from the high-precision one; `quantize.linear.mx` (emulated) trains in MXFP8."""
    high = one_process_curve(tmp_path_factory, "hybrid", (*SMALL, *CURVE))
    stock = torchtitan_run(tmp_path / "stock", *SMALL, *CURVE, "--quantize.converters",
                           "quantize.linear.float8", "--quantize.linear.float8.emulate")
    assert stock.returncode == 0, stock.stderr[-3000:]
    assert "Float8 training: 17 modules compute in float8 (Linear tensorwise, emulated)" in (
        stock.stdout + stock.stderr)
    ours = run_train(tmp_path / "ours", "--model.converters", "quantize.linear.float8",
                     "--quantize.linear.float8.emulate")
    assert ours.returncode == 0, ours.stderr[-3000:]
    stock_curve = [r["loss"] for r in curve(tmp_path / "stock" / "curve.jsonl")]
    assert [r["loss"] for r in curve(tmp_path / "ours" / "curve.jsonl")] == stock_curve
    assert stock_curve != [r["loss"] for r in high]
    for ours_loss, reference in zip(stock_curve, high, strict=True):
        assert ours_loss == pytest.approx(reference["loss"], rel=0.04)
    mx = torchtitan_run(tmp_path / "mx", *SMALL, *CURVE, "--quantize.converters",
                        "quantize.linear.mx", "--quantize.linear.mx.recipe_name", "mxfp8_emulated")
    assert mx.returncode == 0, mx.stderr[-3000:]
    assert "compute in float8 (Linear mxfp8_emulated)" in mx.stdout + mx.stderr
    mx_curve = [r["loss"] for r in curve(tmp_path / "mx" / "curve.jsonl")]
    assert mx_curve != stock_curve
    for ours_loss, reference in zip(mx_curve, high, strict=True):
        assert ours_loss == pytest.approx(reference["loss"], rel=0.04)

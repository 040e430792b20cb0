"""`--validation.enable` in the real trainer (gloo): the held-out loss is the same under one
process, FSDP2, TP2 and PP2; under PP every rank logs the real training loss; the loss-curve
file lands under the dump folder and a resumed run rewrites it without duplicate steps.

Every layout evaluates the same 8 held-out windows and trains on the same global batch of 4.
One process, TP2 and PP2 take the windows as 2 batches of 4; FSDP2 as 1 global batch of 8, 4
per rank, so each rank runs exactly one of the single process's batches. One process trains on
its batch of 4 as 2 microbatches of 2 windows, and FSDP2 gives each rank one of them: the
logged step-1 training loss is then the same two float32 sums added, bitwise (asserted; a
single sum over all 4 windows rounds differently, by a last bit on some torch builds). The
first validation runs after the first optimizer step, whose clip factor max_norm / |g| comes
from a float32 norm that each layout rounds differently (tests/launch.py, TOP_K_CURVE_REL), so
its weights, and every validation loss, agree to float32 rounding, not bitwise. TP2
(vocabulary-parallel cross-entropy) and PP2 (4 microbatches of 1 window, each summed in
float32) change the rounding of the training loss too: tolerance 1e-6 relative, measured
within 1.2e-7 (validation losses within 3.1e-8). The slow ZBVZeroBubble case puts
the last stage on pp rank 0, so there rank 1 is the one that receives the loss.
"""

import json
import shutil

import pytest

from tests.launch import run_training

COMMON = ("--training.steps", "2", "--training.global_batch_size", "4",
          "--training.seq_len", "128", "--validation.enable", "--validation.freq", "2",
          "--validation.seq_len", "128", "--validation.local_batch_size", "4")
TWO_BATCHES = ("--training.local_batch_size", "4", "--validation.steps", "2")
LAYOUTS = {
    "fsdp2": ("--training.local_batch_size", "2", "--validation.steps", "1"),
    "tp2": (*TWO_BATCHES, "--parallelism.tensor_parallel_degree", "2"),
    "pp2": (*TWO_BATCHES, "--parallelism.pipeline_parallel_degree", "2"),
    # V-shaped: the last stage is on pp rank 0, and torch's eval needs validation.py's fix.
    "pp2_zbv": (*TWO_BATCHES, "--parallelism.pipeline_parallel_degree", "2",
                "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"),
}


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("validation_reference")
    return run_training(tmp, *COMMON, "--training.local_batch_size", "2",
                        "--validation.steps", "2").check()


@pytest.mark.parametrize("layout", ["fsdp2", pytest.param("tp2", marks=pytest.mark.extended),
                                    pytest.param("pp2", marks=pytest.mark.extended),
                                    pytest.param("pp2_zbv", marks=pytest.mark.slow)])
def test_validation_loss_is_the_same_under_every_layout(tmp_path, single_process, layout):
    result = run_training(tmp_path, *COMMON, *LAYOUTS[layout], nproc=2).check()
    # Validation at step 1 (always) and at validation.freq = 2; the model has changed between.
    assert len(single_process.validation_losses) == 2
    assert single_process.validation_losses[0] != single_process.validation_losses[1]
    assert result.validation_losses == pytest.approx(single_process.validation_losses,
                                                     rel=1e-6)
    # Training is untouched by the validation passes, and under PP the file written by rank 0
    # (first stage) holds the last stage's loss. Step 1's loss is bitwise one process's under
    # FSDP2 (the same two microbatch sums, module docstring); TP2's vocabulary-parallel
    # cross-entropy and PP2's microbatches round in float32 otherwise.
    if layout == "fsdp2":
        assert result.losses[0] == single_process.losses[0]
    assert result.losses == pytest.approx(single_process.losses, rel=1e-6)
    if layout.startswith("pp2"):
        assert "loss: -1.00000" not in result.output
        assert result.output.count(f"step:  1  loss: {single_process.losses[0]:8.5f}") == 2


def test_curve_file_under_dump_folder_and_rewritten_on_resume(tmp_path):
    args = ("--training.steps", "4", "--training.local_batch_size", "2", "--training.seq_len",
            "64", "--validation.enable", "--validation.freq", "2", "--validation.steps", "1",
            "--validation.local_batch_size", "2", "--validation.seq_len", "64",
            "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.folder", "ck",
            "--checkpoint.no_last_save_model_only", "--hybrid.loss_curve_file", "c/curve.jsonl")
    first = run_training(tmp_path, *args).check()
    curve = tmp_path / "outputs" / "c" / "curve.jsonl"
    assert curve.exists() and len(first.losses) == 4
    shutil.rmtree(tmp_path / "outputs" / "ck" / "step-4")
    resumed = run_training(tmp_path, *args).check()
    assert "Training starts at step 3" in resumed.output
    records = [json.loads(line) for line in curve.read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in records if "validation_loss" in r] == [1, 2, 4]
    # Steps 3-4 are the resumed run's, equal to the uninterrupted ones to float32 rounding.
    assert resumed.losses == pytest.approx(first.losses, rel=1e-6)
    assert resumed.validation_losses == pytest.approx(first.validation_losses, rel=1e-6)

"""Mamba-3 (`debug_mamba3` / `debug_mamba3_mimo`: `M-*-M-` with `m_layers = "mamba3"`) in the
real trainer: the one-process curve under FSDP2, TP2 + SP (the heads split; B, C and the angles
replicated), PP2 and CP2 in both linear modes (head exchange: the angles sent whole to each
rank; chunkwise: the state, the angle and the last token's key and input passed between
pieces) with packed documents, SISO and MIMO (rank 2, the output norm), and the TP2 run's
checkpoint resumed at TP1. The mixer against its float64 per-token reference:
tests/unit/test_mamba3.py; what TP refuses (groups) is refused there by name."""

from __future__ import annotations

import shutil

import pytest

from tests.launch import run_training

JOB = ("--training.steps", "4", "--training.seq_len", "64", "--training.local_batch_size", "4",
       "--training.global_batch_size", "8", "--training.max_norm", "1e6",
       "--hybrid.document_masking")
LAYOUTS = {
    "fsdp2": (),
    "tp2": ("--parallelism.tensor_parallel_degree", "2"),
    "pp2": ("--parallelism.pipeline_parallel_degree", "2", "--hybrid.pattern", "M-*|-M-"),
    "cp2_head_a2a": ("--parallelism.context_parallel_degree", "2"),
    "cp2_chunkwise": ("--parallelism.context_parallel_degree", "2",
                      "--parallelism.context_parallel_linear_mode", "chunkwise"),
}
# the TP2 run saves at steps 2 and 4 (with its optimizer state) for the TP1 resume
CHECKPOINT = ("--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.folder", "ck",
              "--checkpoint.no_last_save_model_only")


@pytest.mark.extended
@pytest.mark.once_per_ci
@pytest.mark.parametrize("flavor", ["debug_mamba3", "debug_mamba3_mimo"])
def test_every_layout_gives_the_one_process_curve_and_tp2_checkpoints_resume_at_tp1(
        tmp_path, reference_run, flavor):
    variant = ("--model.flavor", flavor)
    single = reference_run(*JOB, *variant).losses
    assert single[-1] < single[0]
    for name, layout in LAYOUTS.items():
        saves = CHECKPOINT if name == "tp2" else ()
        got = run_training(tmp_path / name, *JOB, *variant, *layout, *saves,
                           nproc=2).check().losses
        assert got == pytest.approx(single, rel=1e-5), name
    outputs = tmp_path / "tp2" / "outputs"
    shutil.rmtree(outputs / "ck" / "step-4")
    shutil.copytree(outputs, tmp_path / "tp1" / "outputs")
    resumed = run_training(tmp_path / "tp1", *JOB, *variant, *CHECKPOINT).check()
    assert "Training starts at step 3" in resumed.output
    assert resumed.losses == pytest.approx(single[2:], rel=1e-5)

"""LFM2's gated short convolution (`debug_short_conv`: `S-*-S-`) in the real trainer: the
one-process curve under FSDP2, TP2 + SP (channels split), PP2, CP2 in both linear modes (head
exchange: channels as heads; chunkwise: each piece reads the conv's width - 1 rows before it
and nothing else), with packed documents, and a TP2 checkpoint resumed at TP1. In the
extended run, as the other kinds' layout matrices. The layer against transformers' in float64
is tests/unit/test_short_conv.py."""

from __future__ import annotations

import shutil

import pytest

from tests.launch import run_training

# Two microbatches of 4 rows a step, documents packed with their boundaries kept; no
# gradient clipping (tests/distributed/test_hf_import.py).
JOB = ("--model.flavor", "debug_short_conv", "--training.steps", "4", "--training.seq_len",
       "64", "--training.local_batch_size", "4", "--training.global_batch_size", "8",
       "--training.max_norm", "1e6", "--hybrid.document_masking")
LAYOUTS = {
    "fsdp2": (),
    "tp2": ("--parallelism.tensor_parallel_degree", "2"),
    "pp2": ("--parallelism.pipeline_parallel_degree", "2", "--hybrid.pattern", "S-*|-S-"),
    "cp2_head_a2a": ("--parallelism.context_parallel_degree", "2"),
    "cp2_chunkwise": ("--parallelism.context_parallel_degree", "2",
                      "--parallelism.context_parallel_linear_mode", "chunkwise"),
}
CHECKPOINT = ("--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.folder", "ck",
              "--checkpoint.no_last_save_model_only")


@pytest.mark.extended
def test_every_layout_gives_the_one_process_curve_and_tp2_checkpoints_resume_at_tp1(
        tmp_path, reference_run):
    single = reference_run(*JOB).losses
    for name, layout in LAYOUTS.items():
        got = run_training(tmp_path / name, *JOB, *layout, nproc=2).check().losses
        assert got == pytest.approx(single, rel=1e-5), name
    saved = run_training(tmp_path / "tp2_saved", *JOB, *LAYOUTS["tp2"], *CHECKPOINT,
                         nproc=2).check()
    outputs = tmp_path / "tp2_saved" / "outputs"
    shutil.rmtree(outputs / "ck" / "step-4")
    shutil.copytree(outputs, tmp_path / "tp1" / "outputs")
    resumed = run_training(tmp_path / "tp1", *JOB, *CHECKPOINT).check()
    assert "Training starts at step 3" in resumed.output
    assert resumed.losses == pytest.approx(saved.losses[2:], rel=1e-5)

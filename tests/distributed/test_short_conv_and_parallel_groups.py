"""The two structures issue 58 added, in one layout matrix (their launches shared): LFM2's gated
short convolution `S` and a parallel group `(M*)` (Falcon-H1's Mamba2 and attention on one
normed input, summed), pattern `(M*)-S-`, in the real trainer. The one-process curve under
FSDP2, TP2 + SP (the conv's channels split; each group member its own TP region), PP2, CP2 in
both linear modes (head exchange: the conv's channels as heads; chunkwise: each piece reads
the conv's width - 1 rows before it and nothing else; each member's core wrapped as its kind's
rule says), with packed documents; a TP2 checkpoint resumed at TP1. In the extended run, as
the other kinds' layout matrices. The layer against transformers' Lfm2ShortConv in float64:
tests/unit/test_short_conv.py; the grammar and the group's arithmetic:
tests/unit/test_parallel_group.py."""

from __future__ import annotations

import shutil

import pytest

from tests.launch import run_training

JOB = ("--model.flavor", "debug_parallel", "--hybrid.pattern", "(M*)-S-", "--training.steps",
       "4", "--training.seq_len", "64", "--training.local_batch_size", "4",
       "--training.global_batch_size", "8", "--training.max_norm", "1e6",
       "--hybrid.document_masking")
LAYOUTS = {
    "fsdp2": (),
    "tp2": ("--parallelism.tensor_parallel_degree", "2"),
    "pp2": ("--parallelism.pipeline_parallel_degree", "2", "--hybrid.pattern", "(M*)-|S-"),
    "cp2_head_a2a": ("--parallelism.context_parallel_degree", "2"),
    "cp2_chunkwise": ("--parallelism.context_parallel_degree", "2",
                      "--parallelism.context_parallel_linear_mode", "chunkwise"),
}
CHECKPOINT = ("--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.folder", "ck",
              "--checkpoint.no_last_save_model_only")


def resume_elsewhere(tmp_path, name: str, saved_layout: tuple, saved_nproc: int,
                     resumed_layout: tuple, resumed_nproc: int) -> None:
    """Save at steps 2 and 4 under one layout, drop step 4, resume under another: the saved
    run's steps 3 and 4."""
    saved = run_training(tmp_path / f"{name}_saved", *JOB, *saved_layout, *CHECKPOINT,
                         nproc=saved_nproc).check()
    outputs = tmp_path / f"{name}_saved" / "outputs"
    shutil.rmtree(outputs / "ck" / "step-4")
    shutil.copytree(outputs, tmp_path / f"{name}_resumed" / "outputs")
    resumed = run_training(tmp_path / f"{name}_resumed", *JOB, *resumed_layout, *CHECKPOINT,
                           nproc=resumed_nproc).check()
    assert "Training starts at step 3" in resumed.output
    assert resumed.losses == pytest.approx(saved.losses[2:], rel=1e-5), name


@pytest.mark.extended
def test_every_layout_gives_the_one_process_curve_and_checkpoints_move_between_layouts(
        tmp_path, reference_run):
    single = reference_run(*JOB).losses
    for name, layout in LAYOUTS.items():
        got = run_training(tmp_path / name, *JOB, *layout, nproc=2).check().losses
        assert got == pytest.approx(single, rel=1e-5), name
    resume_elsewhere(tmp_path, "tp2_to_tp1", LAYOUTS["tp2"], 2, (), 1)

"""Parallel groups (`debug_parallel`: `(M*)-(M*)-`, Falcon-H1's layers: Mamba2 and attention on
one normed input, summed) in the real trainer: the one-process curve under FSDP2, TP2 + SP
(each member its own TP region), PP2, CP2 in both linear modes (each member's core wrapped as
its kind's rule says), with packed documents; a TP2 checkpoint resumed at TP1, and a
one-process checkpoint resumed under FSDP2. In the extended run, as the other kinds' layout
matrices. The grammar and the layer's arithmetic: tests/unit/test_parallel_group.py."""

from __future__ import annotations

import shutil

import pytest

from tests.launch import run_training

JOB = ("--model.flavor", "debug_parallel", "--training.steps", "4", "--training.seq_len",
       "64", "--training.local_batch_size", "4", "--training.global_batch_size", "8",
       "--training.max_norm", "1e6", "--hybrid.document_masking")
LAYOUTS = {
    "fsdp2": (),
    "tp2": ("--parallelism.tensor_parallel_degree", "2"),
    "pp2": ("--parallelism.pipeline_parallel_degree", "2", "--hybrid.pattern", "(M*)-|(M*)-"),
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
    resume_elsewhere(tmp_path, "single_to_fsdp2", (), 1, LAYOUTS["fsdp2"], 2)

"""Mamba1 (`debug_mamba1`: `M-*-M-` with `m_layers = "mamba1"`) in the real trainer: the
one-process curve under FSDP2, PP2, TP2 and CP2 in both linear modes (the head exchange, with
x_proj's partial sums summed over the CP group; chunkwise state passing) with packed
documents, and a TP2 checkpoint resumed at TP1 onto the same curve. The mixer against
transformers' in float64: tests/unit/test_mamba1.py; the chunkwise pieces in one process:
tests/unit/test_context_parallel_chunkwise.py."""

from __future__ import annotations

import shutil

import pytest

from tests.launch import run_training

JOB = ("--model.flavor", "debug_mamba1", "--training.steps", "4", "--training.seq_len", "64",
       "--training.local_batch_size", "4", "--training.global_batch_size", "8",
       "--training.max_norm", "1e6", "--hybrid.document_masking")
LAYOUTS = {
    "fsdp2": (),
    "pp2": ("--parallelism.pipeline_parallel_degree", "2", "--hybrid.pattern", "M-*|-M-"),
    "cp2_head_a2a": ("--parallelism.context_parallel_degree", "2"),
    "cp2_chunkwise": ("--parallelism.context_parallel_degree", "2",
                      "--parallelism.context_parallel_linear_mode", "chunkwise"),
}
TP2 = ("--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "8")
CHECKPOINT = ("--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.folder", "ck",
              "--checkpoint.no_last_save_model_only")


# On CI's reference torch leg: the layouts' code it runs is every kind's.
@pytest.mark.extended
@pytest.mark.once_per_ci
def test_fsdp2_pp2_tp2_and_cp2_give_the_one_process_curve_and_a_tp2_checkpoint_resumes_at_tp1(
        tmp_path, reference_run):
    single = reference_run(*JOB).losses
    for name, layout in LAYOUTS.items():
        got = run_training(tmp_path / name, *JOB, *layout, nproc=2).check().losses
        assert got == pytest.approx(single, rel=1e-5), name
    # TP2 (x_proj's partial sums over the channels summed inside the layer), saving at steps
    # 2 and 4; step 4 dropped, one process resumes from step 2.
    saved = run_training(tmp_path / "tp2", *JOB, *TP2, *CHECKPOINT, nproc=2).check()
    assert saved.losses == pytest.approx(single, rel=1e-5)
    outputs = tmp_path / "tp2" / "outputs"
    shutil.rmtree(outputs / "ck" / "step-4")
    shutil.copytree(outputs, tmp_path / "tp1" / "outputs")
    resumed = run_training(tmp_path / "tp1", *JOB, *CHECKPOINT).check()
    assert "Training starts at step 3" in resumed.output
    assert resumed.losses == pytest.approx(single[2:], rel=1e-5)


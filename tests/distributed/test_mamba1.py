"""Mamba1 (`debug_mamba1`: `M-*-M-` with `m_layers = "mamba1"`) in the real trainer: the
one-process curve under FSDP2 and PP2 with packed documents; tensor and context parallelism,
which it does not take yet, refused in one line before any worker starts. The mixer against
transformers' in float64: tests/unit/test_mamba1.py."""

from __future__ import annotations

import pytest

from tests.launch import run_training

JOB = ("--model.flavor", "debug_mamba1", "--training.steps", "4", "--training.seq_len", "64",
       "--training.local_batch_size", "4", "--training.global_batch_size", "8",
       "--training.max_norm", "1e6", "--hybrid.document_masking")
LAYOUTS = {
    "fsdp2": (),
    "pp2": ("--parallelism.pipeline_parallel_degree", "2", "--hybrid.pattern", "M-*|-M-"),
}


# On CI's first torch leg only: the layouts' code it runs is every kind's (77 s here).
@pytest.mark.extended
@pytest.mark.once_per_ci
def test_fsdp2_and_pp2_give_the_one_process_curve_and_tp_cp_are_refused(tmp_path,
                                                                        reference_run):
    single = reference_run(*JOB).losses
    for name, layout in LAYOUTS.items():
        got = run_training(tmp_path / name, *JOB, *layout, nproc=2).check().losses
        assert got == pytest.approx(single, rel=1e-5), name
    for name, layout, message in (
            ("tp2", ("--parallelism.tensor_parallel_degree", "2"),
             "m_layers='mamba1' under tensor parallelism is not supported yet"),
            ("cp2", ("--parallelism.context_parallel_degree", "2"),
             "context parallelism (head_a2a) is not implemented for Mamba1 ('M') layers")):
        refused = run_training(tmp_path / name, *JOB, *layout, nproc=2)
        assert refused.returncode == 2, refused.output[-3000:]
        lines = [line for line in refused.output.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and message in lines[0], refused.output[-3000:]

"""Mamba-3 (`debug_mamba3` / `debug_mamba3_mimo`: `M-*-M-` with `m_layers = "mamba3"`) in the
real trainer: the one-process curve under FSDP2 and PP2 with packed documents, SISO and MIMO
(rank 2, the output norm). The mixer against its float64 per-token reference: tests/unit/test_mamba3.py; what is
refused (TP, CP) is refused there by name."""

from __future__ import annotations

import pytest

from tests.launch import run_training

JOB = ("--training.steps", "4", "--training.seq_len", "64", "--training.local_batch_size", "4",
       "--training.global_batch_size", "8", "--training.max_norm", "1e6",
       "--hybrid.document_masking")
LAYOUTS = {
    "fsdp2": (),
    "pp2": ("--parallelism.pipeline_parallel_degree", "2", "--hybrid.pattern", "M-*|-M-"),
}


@pytest.mark.extended
@pytest.mark.once_per_ci
@pytest.mark.parametrize("flavor", ["debug_mamba3", "debug_mamba3_mimo"])
def test_fsdp2_and_pp2_give_the_one_process_curve(tmp_path, reference_run, flavor):
    variant = ("--model.flavor", flavor)
    single = reference_run(*JOB, *variant).losses
    assert single[-1] < single[0]
    for name, layout in LAYOUTS.items():
        got = run_training(tmp_path / name, *JOB, *variant, *layout, nproc=2).check().losses
        assert got == pytest.approx(single, rel=1e-5), name

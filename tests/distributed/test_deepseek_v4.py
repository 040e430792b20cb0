"""DeepSeek-V4 sliding-window attention (`W`) in the real trainer: the loss curve of one
process under FSDP2 and TP2 + SP (2 processes each).

debug_v4 ("MW-MW-") has a 16-token window in 64-token rows, so every row crosses it. The
layer's float64 checks (reference, transformers, TP split by hand) are in
tests/unit/test_deepseek_v4.py. Context parallelism is refused for W (no rule yet)."""

from __future__ import annotations

import pytest

from tests.launch import run_training

# Two microbatches of 4 rows per step: one process accumulates what two DP ranks compute.
JOB = ("--model.flavor", "debug_v4", "--training.steps", "4", "--training.seq_len", "64",
       "--training.local_batch_size", "4", "--training.global_batch_size", "8")
LAYOUTS = {
    "fsdp2": (),
    "tp2": ("--parallelism.tensor_parallel_degree", "2"),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_process_layouts_give_the_one_process_curve(tmp_path, reference_run, layout):
    single = reference_run(*JOB).losses
    result = run_training(tmp_path, *JOB, *LAYOUTS[layout], nproc=2).check()
    if layout == "tp2":
        assert "Applied tensor parallel (sequence parallel: True)" in result.output
    assert len(result.losses) == len(single) == 4
    for a, b in zip(single, result.losses, strict=True):
        assert b == pytest.approx(a, rel=1e-5)

"""DeepSeek-V4 attention in the real trainer: the loss curve of one process under FSDP2 and
TP2 + SP (2 processes each), for sliding-window attention (`W`) and heavily compressed
attention (`H`).

debug_v4 ("MW-MW-") has a 16-token window in 64-token rows, so every row crosses it;
debug_v4_hca ("MH-MW-") adds an H layer with an 8-token window and blocks of 4 tokens: 16
compressed rows a row, most of them beyond a query's window. The layers' float64 checks
(reference, transformers, TP split by hand) are in tests/unit/test_deepseek_v4.py and
test_deepseek_v4_hca.py. Context parallelism is refused for W and H (no rule yet)."""

from __future__ import annotations

import pytest

from tests.launch import run_training

# Two microbatches of 4 rows per step: one process accumulates what two DP ranks compute.
STEPS = ("--training.steps", "4", "--training.seq_len", "64",
         "--training.local_batch_size", "4", "--training.global_batch_size", "8")
LAYOUTS = {
    "fsdp2": (),
    "tp2": ("--parallelism.tensor_parallel_degree", "2"),
}


@pytest.mark.parametrize("flavor", ["debug_v4", "debug_v4_hca"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_process_layouts_give_the_one_process_curve(tmp_path, reference_run, layout, flavor):
    job = ("--model.flavor", flavor, *STEPS)
    single = reference_run(*job).losses
    result = run_training(tmp_path, *job, *LAYOUTS[layout], nproc=2).check()
    if layout == "tp2":
        assert "Applied tensor parallel (sequence parallel: True)" in result.output
    assert len(result.losses) == len(single) == 4
    for a, b in zip(single, result.losses, strict=True):
        assert b == pytest.approx(a, rel=1e-5)

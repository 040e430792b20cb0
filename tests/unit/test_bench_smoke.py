"""Smoke tests of the benchmarks.

bench/mixers_vs_transformers.py: its comparison runs at a small size and our ops agree with
transformers' torch paths (same inputs / weights), forward and gradients.
bench/gpu_check.py: the parts that run without a GPU (the no-CUDA exit, one bf16-autocast
training step).
"""

import pytest
import torch

from bench import gpu_check


@pytest.mark.parametrize("op", ["ssd", "mixer", "gdn", "mla", "dsa"])
def test_compare_small(op):
    pytest.importorskip("transformers")
    from bench.mixers_vs_transformers import compare

    # T = 200 is not a multiple of either chunk size (128 / 64), so padding is exercised too
    result = compare(op, T=200, repeats=1, batch=1)
    assert result["err_out"] < 1e-4, result
    assert result["err_grad"] < 1e-4, result
    assert result["ours_tok_s"] > 0 and result["theirs_tok_s"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without CUDA")
def test_gpu_check_exits_cleanly_without_cuda(capsys):
    assert gpu_check.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_gpu_check_training_line_on_cpu():
    result = gpu_check.train_line("debug", batch=1, seq_len=32, steps=1,
                                  device=torch.device("cpu"))
    assert result["tokens_per_s"] > 0 and result["flops_per_token"] > 0
    assert all(torch.isfinite(torch.tensor(result["losses"])))


def test_train_step_bench_matches_sizes_and_counts_flops():
    import math

    from bench.train_step import compare

    result = compare("debug", batch=1, seq_len=64, repeats=1)
    hybrid, llama = result["rows"]
    # The baseline is sized to the hybrid: non-embedding parameters within 10%.
    assert abs(llama["non_embedding_params"] / hybrid["non_embedding_params"] - 1) < 0.10
    for row in (hybrid, llama):
        # Both are freshly initialised language models: first loss near uniform over 2048 tokens.
        assert abs(row["first_loss"] - math.log(2048)) < 0.5, row
        # 6 x non-embedding parameters plus the cores, so a little above 6N.
        assert 6 * row["non_embedding_params"] < row["flops_per_token"], row
        assert row["flops_per_token"] < 7 * row["non_embedding_params"], row
        assert 0 < row["mfu"] < 1.5 and row["tokens_per_s"] > 0

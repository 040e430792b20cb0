"""Smoke tests of the benchmarks.

bench/mixers_vs_transformers.py: its comparison runs at a small size and our ops agree with
transformers' torch paths (same inputs / weights), forward and gradients.
bench/gpu_verify.py: the parts that run without a GPU (the no-CUDA exit, the parity harness with
torch-path stand-ins for the kernels, one bf16-autocast training step).
"""

from functools import partial

import pytest
import torch

from bench import gpu_verify


@pytest.mark.parametrize("op", ["ssd", "mixer", "gdn"])
def test_compare_small(op):
    pytest.importorskip("transformers")
    from bench.mixers_vs_transformers import compare

    # T = 200 is not a multiple of either chunk size (128 / 64), so padding is exercised too
    result = compare(op, T=200, repeats=1, batch=1)
    assert result["err_out"] < 1e-4, result
    assert result["err_grad"] < 1e-4, result
    assert result["ours_tok_s"] > 0 and result["theirs_tok_s"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without CUDA")
def test_gpu_verify_exits_cleanly_without_cuda(capsys):
    assert gpu_verify.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_gpu_verify_harness_compares_every_output_and_gradient():
    from titan_hybrid.ops.conv import causal_depthwise_conv1d_torch
    from titan_hybrid.ops.gated_delta import chunk_gated_delta_rule_torch
    from titan_hybrid.ops.ssd import ssd_chunked_torch

    # The torch paths stand in for the kernels: every case must pass with (near-)zero error.
    cases = gpu_verify.kernel_cases(torch.device("cpu"), ssd_kernel=ssd_chunked_torch,
                                    gdn_kernel=chunk_gated_delta_rule_torch,
                                    conv_kernel=causal_depthwise_conv1d_torch, small=True)
    assert len(cases) == 8 and all(case["passed"] for case in cases), cases
    ssd_tensors = {row["tensor"] for row in cases[0]["rows"]}
    assert ssd_tensors == {"y", "final_states", "grad:x", "grad:dt", "grad:A", "grad:B",
                           "grad:C", "grad:D", "grad:z", "grad:dt_bias", "grad:initial_states"}
    assert all(case["dispatch_uses_kernel"] for case in cases if "dispatch_uses_kernel" in case)


def test_gpu_verify_harness_fails_a_wrong_kernel():
    from titan_hybrid.ops.gated_delta import chunk_gated_delta_rule_torch

    inputs = gpu_verify.gdn_inputs(batch=1, seq_len=40, heads=2, head_dim=8, dtype=torch.float32,
                                   device="cpu", doc_lens=None, seed=0)
    kwargs = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    wrong_scale = partial(chunk_gated_delta_rule_torch, scale=0.9 * 8 ** -0.5, **kwargs)
    case = gpu_verify.compare_paths("wrong", kernel_fn=wrong_scale,
                                    torch_fn=partial(chunk_gated_delta_rule_torch, **kwargs),
                                    inputs=inputs, output_names=("o", "final_state"),
                                    tolerance=5e-3, time_reps=0)
    assert not case["passed"]


def test_gpu_verify_training_step_on_cpu():
    result = gpu_verify.measure_training("debug", batch=1, seq_len=32, warmup=1, steps=1,
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

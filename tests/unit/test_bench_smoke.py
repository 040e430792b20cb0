"""Smoke test of bench/mixers_vs_transformers.py: its comparison runs at a small size and our
ops agree with transformers' torch paths (same inputs / weights), forward and gradients."""

import pytest

pytest.importorskip("transformers")

from bench.mixers_vs_transformers import compare  # noqa: E402


@pytest.mark.parametrize("op", ["ssd", "mixer", "gdn"])
def test_compare_small(op):
    # T = 200 is not a multiple of either chunk size (128 / 64), so padding is exercised too
    result = compare(op, T=200, repeats=1, batch=1)
    assert result["err_out"] < 1e-4, result
    assert result["err_grad"] < 1e-4, result
    assert result["ours_tok_s"] > 0 and result["theirs_tok_s"] > 0

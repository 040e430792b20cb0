"""Context parallelism: zigzag shards, all-gathered K/V for attention, sequence <-> head
all-to-alls around the Mamba / GDN conv and scan. Layer-level runs compare float64 logits and
gradients with one device; trainer runs compare loss curves with one process."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launch import run_worker

WORKER = Path(__file__).with_name("cp_worker.py")


def _check(result):
    for case in ("plain", "packed"):
        assert result[case]["logits"] < 1e-12 * result[case]["logit_scale"], result
        assert result[case]["grads"] < 1e-12, result


def test_cp2_layers_match_one_device():
    """Mamba (4 heads, 2 groups per rank pair), GDN, attention and MLP; plain and packed rows."""
    _check(run_worker(WORKER, "--pattern", "M*G-M", nproc=2))


@pytest.mark.slow
def test_cp4_with_fewer_groups_than_ranks_matches_one_device():
    """cp=4 > Mamba's 2 groups and GDN's 2 key heads: ranks share a group."""
    _check(run_worker(WORKER, "--pattern", "M*G-M", "--mamba-groups", "2", nproc=4))

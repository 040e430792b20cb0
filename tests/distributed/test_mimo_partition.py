"""MIMO language-input partitioning over real gloo CP / TP groups: every rank's exact shard.
One torchrun launch per world size runs all of its cases (mimo_worker.py)."""

from pathlib import Path

import pytest

from tests.launch import run_worker

WORKER = Path(__file__).with_name("mimo_worker.py")


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    return run_worker(WORKER, nproc=2)


@pytest.fixture(scope="module")
def four_ranks() -> dict:
    return run_worker(WORKER, nproc=4)


def zigzag_by_hand(docs, cp, rank):
    out = []
    for start, length in docs:
        chunk = length // (2 * cp)
        out += [start + c * chunk + k for c in (rank, 2 * cp - 1 - rank) for k in range(chunk)]
    return out


def check_case(ranks: list[dict], expected_labels, expected_embeddings, sizes) -> None:
    """ranks: per global rank (rank = cp_rank * tp + tp_rank); expected_*: keyed by (cp, tp)."""
    for rank, result in enumerate(ranks):
        cp_rank, tp_rank = result["mesh"]
        assert result["sizes"] == sizes(cp_rank, tp_rank), rank
        assert result["embeddings_ok"] and result["labels_ok"] and result["loss_mask_ok"], rank
        assert result["label_positions"] == expected_labels[cp_rank], rank
        assert result["embedding_positions"] == expected_embeddings[(cp_rank, tp_rank)], rank


def test_cp2_zigzag(two_ranks):
    # S = 12, chunks of 3: rank 0 keeps chunks 0 and 3, rank 1 chunks 1 and 2.
    labels = {0: [0, 1, 2, 9, 10, 11], 1: [3, 4, 5, 6, 7, 8]}
    check_case(two_ranks["cp2"], labels, {(r, 0): labels[r] for r in (0, 1)},
               lambda c, t: [2, c, 1, 0])  # tp_group=None: degree 1, not the world group


def test_sp2_scatter_leaves_labels_whole(two_ranks):
    check_case(two_ranks["sp2"], {0: list(range(6))}, {(0, 0): [0, 1, 2], (0, 1): [3, 4, 5]},
               lambda c, t: [1, 0, 2, t])


def test_thd_cp2_zigzags_each_document(two_ranks):
    docs = [(0, 4), (4, 12), (16, 8)]
    labels = {r: zigzag_by_hand(docs, 2, r) for r in (0, 1)}
    assert labels[0] == [0, 3, 4, 5, 6, 13, 14, 15, 16, 17, 22, 23]
    check_case(two_ranks["thd_cp2"], labels, {(r, 0): labels[r] for r in (0, 1)},
               lambda c, t: [2, c, 1, 0])
    for result in two_ranks["thd_cp2"]:
        assert result["params_ok"]
    # Real lengths 3, 12, 5: rank 0 holds 1 + 6 + 2 real tokens, rank 1 holds 2 + 6 + 3.
    assert [r["cu_seqlens_q"] for r in two_ranks["thd_cp2"]] == [[0, 1, 7, 9], [0, 2, 8, 11]]


def test_dense_mask_rejected_under_cp2(two_ranks):
    for message in two_ranks["dense_mask_cp2"]:
        assert "dense attention_mask is not supported with context parallelism" in message
        assert "use causal masking, or packed sequences (THD" in message


@pytest.mark.slow  # four processes
def test_cp2_x_sp2(four_ranks):
    labels = {r: zigzag_by_hand([(0, 16)], 2, r) for r in (0, 1)}
    assert labels == {0: [0, 1, 2, 3, 12, 13, 14, 15], 1: [4, 5, 6, 7, 8, 9, 10, 11]}
    check_case(four_ranks["cp2_sp2"], labels,
               {(c, t): labels[c][4 * t:4 * t + 4] for c in (0, 1) for t in (0, 1)},
               lambda c, t: [2, c, 2, t])


@pytest.mark.slow  # four processes
def test_thd_cp2_x_sp2(four_ranks):
    labels = {r: zigzag_by_hand([(0, 4), (4, 12), (16, 8)], 2, r) for r in (0, 1)}
    check_case(four_ranks["thd_cp2_sp2"], labels,
               {(c, t): labels[c][6 * t:6 * t + 6] for c in (0, 1) for t in (0, 1)},
               lambda c, t: [2, c, 2, t])
    for result in four_ranks["thd_cp2_sp2"]:
        assert result["params_ok"]

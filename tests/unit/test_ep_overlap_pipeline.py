"""EP-overlap inside pipeline schedules: which actions pair up, and the progress check that
refuses a pairing that would deadlock (instead of hanging the job)."""

import pytest
from torch.distributed.pipelining.schedules import (
    FORWARD as F,
)
from torch.distributed.pipelining.schedules import (
    FULL_BACKWARD as B,
)
from torch.distributed.pipelining.schedules import (
    OVERLAP_F_B,
    _Action,
)

from titan_hybrid.parallel.ep_overlap_pipeline import check_progress, merge_backward_forward_pairs


def actions(text: str, stage: int):
    """'F0 F1 B0' -> the compute actions of one stage."""
    kinds = {"F": F, "B": B}
    return [_Action(stage, kinds[item[0]], int(item[1:])) for item in text.split()]


def pairs(merged):
    return [(a.sub_actions[0].microbatch_index, a.sub_actions[1].microbatch_index)
            for a in merged if a.computation_type == OVERLAP_F_B]


# 1F1B, 2 ranks, 4 microbatches (rank r holds stage r).
ONE_F_ONE_B = {0: actions("F0 F1 B0 F2 B1 F3 B2 B3", 0), 1: actions("F0 B0 F1 B1 F2 B2 F3 B3", 1)}


def test_backward_then_forward_neighbours_pair_up():
    merged = {rank: merge_backward_forward_pairs([None, *order, None])
              for rank, order in ONE_F_ONE_B.items()}
    # (forward mb, backward mb): forward(j) runs with the backward(i) scheduled just before it.
    assert pairs(merged[0]) == [(2, 0), (3, 1)]
    assert pairs(merged[1]) == [(1, 0), (2, 1), (3, 2)]
    assert [a.computation_type for a in merged[0]] == [F, F, OVERLAP_F_B, OVERLAP_F_B, B, B]
    check_progress(merged, lambda stage: stage, num_stages=2)


def test_forward_and_backward_of_one_microbatch_never_pair():
    assert pairs(merge_backward_forward_pairs(actions("F0 B0 F0", 0))) == []


def test_pairing_that_would_deadlock_is_refused():
    # Rank 0's forward(1) waits (inside the pair) for rank 1's gradient of mb 0, which rank 1
    # computes in a pair that waits for rank 0's forward(1) output.
    stuck = {0: [*actions("F0", 0), _Action(-1, OVERLAP_F_B, None, (*actions("F1 B0", 0),)),
                 *actions("B1", 0)],
             1: [*actions("F0", 1), _Action(-1, OVERLAP_F_B, None, (*actions("F1 B0", 1),)),
                 *actions("B1", 1)]}
    with pytest.raises(ValueError, match="expert_parallel_overlap: pairing .* would deadlock"):
        check_progress(stuck, lambda stage: stage, num_stages=2)

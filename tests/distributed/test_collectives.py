"""The context-parallel gather (parallel/collectives.all_gather) as NCCL's collectives: one
all-gather of the rank's block, a reduce-scatter for its backward, and nothing else moved or
copied. Real gloo processes (collectives_worker.py --gather)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launch import run_worker

WORKER = Path(__file__).with_name("collectives_worker.py")


def _check_gather(nproc: int) -> None:
    result = run_worker(WORKER, "--gather", nproc=nproc)
    block, others = result["block_bytes"], nproc - 1
    assert result["world"] == nproc
    assert result["output_equal"] and result["grad_close"], result
    # One collective each way. The forward hands the rank's block to the collective once and
    # takes in the other ranks' blocks; the backward's reduce-scatter hands on the gradients held
    # for the other ranks' blocks and takes in theirs for this one.
    assert result["forward"] == {"sent": [block], "received": [others * block]}
    assert result["backward"] == {"sent": [others * block], "received": [others * block]}
    # The output buffer is the gather's only tensor of the output's size: no [world, ...]
    # expanded copy of the input (the all-to-all gather made one).
    assert result["fresh_output_sized_tensors"] == 1


def test_gather_is_one_all_gather_with_a_reduce_scatter_backward():
    _check_gather(2)


@pytest.mark.slow
def test_gather_is_one_all_gather_with_a_reduce_scatter_backward_at_4_ranks():
    _check_gather(4)

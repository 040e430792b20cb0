"""The multimodal example end to end: stub vision features spliced into the hybrid LM's input,
partitioned by PartitionAdapter from explicit CP / TP groups, a real forward and backward under
context parallelism and sequence parallelism, compared with one device."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launch import run_worker

WORKER = Path(__file__).with_name("vlm_worker.py")


def _check(reports, *, all_params: bool):
    for report in reports:
        assert report["loss"] == pytest.approx(report["want"], rel=1e-6), report
        assert report["grads"] < 1e-5, report
        assert report["checked"] > 2 if all_params else report["checked"] == 2


@pytest.mark.parametrize("packed", [0, 1], ids=["rows", "packed_thd"])
def test_cp2_matches_one_device(packed):
    _check(run_worker(WORKER, "--cp", "2", "--packed", str(packed), nproc=2), all_params=True)


def test_sp2_matches_one_device():
    _check(run_worker(WORKER, "--cp", "1", "--tp", "2", nproc=2), all_params=False)


@pytest.mark.slow
def test_cp2_x_sp2_packed_matches_one_device():
    _check(run_worker(WORKER, "--cp", "2", "--tp", "2", "--packed", "1", nproc=4),
           all_params=False)

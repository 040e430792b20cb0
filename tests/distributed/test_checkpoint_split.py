"""Splitting a fused tensor into components uses the parameter's GLOBAL layout, so a DTensor
and a plain local tensor (how optimizer states may arrive) give the same pieces."""

from pathlib import Path

import pytest

from tests.launch import launch_workers

WORKER = Path(__file__).with_name("split_worker.py")


@pytest.mark.parametrize("nproc", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_components_reassemble_to_the_logical_tensor(nproc):
    proc = launch_workers(WORKER, nproc=nproc, timeout=300)
    assert proc.returncode == 0 and "RESULT ok" in proc.stdout, proc.stdout + proc.stderr[-4000:]

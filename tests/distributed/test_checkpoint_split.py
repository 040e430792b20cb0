"""Splitting a fused tensor into components uses the parameter's GLOBAL layout, so a DTensor
and a plain local tensor (how optimizer states may arrive) give the same pieces."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("split_worker.py")


@pytest.mark.parametrize("nproc", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_components_reassemble_to_the_logical_tensor(nproc):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={nproc}", str(WORKER)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and "RESULT ok" in proc.stdout, proc.stdout + proc.stderr[-4000:]

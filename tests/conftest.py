"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest

from tests.launch import TrainResult, run_training


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """`reference_run(*args, nproc=1, config=...)`: run_training(...).check() in a folder of its
    own, launched once per session for the same arguments: the reference curves that several
    tests compare against (a test whose subject is repeating a run launches it itself)."""
    done: dict[tuple, TrainResult] = {}

    def run(*args: str, nproc: int = 1, config: str = "hybrid.toml") -> TrainResult:
        key = (args, nproc, config)
        if key not in done:
            folder = tmp_path_factory.mktemp("reference")
            done[key] = run_training(folder, *args, nproc=nproc, config=config).check()
        return done[key]

    return run

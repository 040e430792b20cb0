"""Fixtures and hooks shared by the test modules."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests import ci_shards
from tests.launch import REPO_ROOT, TrainResult, run_training, start_fork_server
from tests.torchtitan_generation import INSTALLED

DISTRIBUTED = REPO_ROOT / "tests" / "distributed"
# The folders whose tests launch training runs (tests/launch.py's fork server serves them).
LAUNCHING = (DISTRIBUTED, REPO_ROOT / "tests" / "torchtitan_0_3")
# The torchtitan 0.3 adapter's tests run in the 0.3 venv (CI's 0.3 leg names the folder); under
# 0.2 they are not collected, so the default suite neither runs nor skips them.
collect_ignore = [] if INSTALLED == (0, 3) else ["torchtitan_0_3"]


def pytest_addoption(parser):
    parser.addoption(
        "--ci-shard", metavar="K/N",
        help="run only the tests of shard K of N: .ci/run runs each test on one of its torch "
             "legs (tests/ci_shards.py)")


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected theirs
def pytest_collection_modifyitems(config, items):
    durations = ci_shards.read_durations()
    shard = config.getoption("--ci-shard")
    if shard:
        index, count = (int(part) for part in shard.split("/"))
        if not 0 <= index < count:
            raise pytest.UsageError(f"--ci-shard {shard}: K must be in [0, N)")
        shards = ci_shards.plan(items, count, durations)
        keep = [item for item, item_shard in zip(items, shards) if item_shard == index]
        drop = [item for item, item_shard in zip(items, shards) if item_shard != index]
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep
    items[:] = ci_shards.longest_modules_first(items, durations)


def pytest_sessionstart(session):
    """A session that may run distributed tests starts their fork server (tests/launch.py)
    before collecting, so its imports overlap with pytest's own."""
    _triton_interpreter_without_cuda()
    if getattr(session.config.option, "numprocesses", None) and not hasattr(
            session.config, "workerinput"):
        return  # a pytest-xdist controller: its workers run the tests
    paths = [Path(session.config.invocation_params.dir, arg.split("::")[0]).resolve()
             for arg in session.config.args]
    if any(path == folder or folder in path.parents or path in folder.parents
           for path in paths for folder in LAUNCHING):
        start_fork_server()


def _triton_interpreter_without_cuda():
    """Without CUDA, the triton_interpreter tests run the GPU kernels in Triton's interpreter,
    which Triton reads when it is imported: set it before collection imports triton (through
    torchtitan), and before the fork server starts (its environment must match the tests').
    Nothing else on CPU launches a Triton kernel (tests/triton_kernels.py)."""
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


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


@pytest.fixture(scope="module")
def one_rank_mesh():
    """A one-rank gloo process group (unless one exists) and its CPU device mesh: FSDP2 and
    DTensor on one process, for the unit tests of what parallel code builds."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    if created:
        dist.destroy_process_group()

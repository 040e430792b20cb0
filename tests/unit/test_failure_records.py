"""Which worker failed first (titan_hybrid.runtime.errors: failures_recorded, first_failure),
with real processes: the records a failing worker leaves for the launcher."""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path

import pytest

from tests.launch import wait_for
from titan_hybrid.runtime import errors


@pytest.fixture
def error_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(errors.ERROR_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    return tmp_path


def fail(monkeypatch, rank: int, error: BaseException, attempt: int = 0) -> None:
    """Worker RANK's run raising ERROR, in this process."""
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))
    with pytest.raises(type(error)), errors.failures_recorded():
        raise error


def test_the_first_exception_is_named_not_the_peers_that_followed(error_dir, monkeypatch):
    fail(monkeypatch, 1, RuntimeError("a bug\nsecond line"))
    fail(monkeypatch, 0, ConnectionError("Connection closed by peer"))
    first = errors.first_failure(error_dir)
    assert (first.rank, first.pid, first.summary) == (1, os.getpid(), "RuntimeError: a bug")


def test_only_the_last_attempt_counts(error_dir, monkeypatch):
    fail(monkeypatch, 0, RuntimeError("before the restart"), attempt=0)
    fail(monkeypatch, 1, RuntimeError("after the restart"), attempt=1)
    assert errors.first_failure(error_dir).summary == "RuntimeError: after the restart"


def test_nothing_to_name_without_a_failure(error_dir, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with errors.failures_recorded():
        pass
    assert errors.first_failure(error_dir) is None
    assert not list(error_dir.iterdir())  # a finished worker leaves no note


def _noted_then_waiting(ready) -> None:
    os.environ["RANK"] = "1"
    with errors.failures_recorded():
        ready.set()
        signal.pause()  # until killed


def test_a_peer_killed_before_the_first_exception_is_named(error_dir, monkeypatch):
    # Rank 1 is a process of its own, killed -9 (it records nothing); rank 0 then fails on the
    # broken connection and records that rank 1 had ended before.
    context = multiprocessing.get_context("fork")
    ready = context.Event()
    peer = context.Process(target=_noted_then_waiting, args=(ready,))
    peer.start()
    assert ready.wait(timeout=60)
    os.kill(peer.pid, signal.SIGKILL)
    # Not reaped yet, as when its peers fail: its exit status still shows in /proc.
    assert wait_for(lambda: Path(f"/proc/{peer.pid}/stat").read_text().rsplit(")", 1)[1]
                    .split()[0] == "Z")
    fail(monkeypatch, 0, ConnectionError("Connection closed by peer"))
    peer.join()
    first = errors.first_failure(error_dir)
    assert (first.rank, first.pid, first.summary, first.exitcode) == (
        1, peer.pid, None, -signal.SIGKILL)


def test_a_peer_that_finished_is_not_named(error_dir, monkeypatch):
    context = multiprocessing.get_context("fork")
    peer = context.Process(target=_finished_as_rank_1)
    peer.start()
    peer.join()
    assert peer.exitcode == 0
    fail(monkeypatch, 0, RuntimeError("a bug after the peer finished"))
    first = errors.first_failure(error_dir)
    assert (first.rank, first.summary) == (0, "RuntimeError: a bug after the peer finished")


def _finished_as_rank_1() -> None:
    os.environ["RANK"] = "1"
    with errors.failures_recorded():
        pass

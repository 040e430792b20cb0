"""The two ways a run ends on purpose, and how each is reported.

A user error (a job field, a layout, a pattern, a checkpoint that cannot serve this job) and a
diverged run (non-finite loss or gradient norm) are not bugs: the user gets one short message,
no Python traceback, and a non-zero exit status. Anything else is a bug and keeps its traceback.

Inside torchrun workers the message is written to `$TITAN_HYBRID_ERROR_DIR/rank<R>.txt` when the
launcher (titan_hybrid.launch) set that variable, and the launcher prints it once; under a plain
torchrun the worker prints it itself.

A bug stops every worker: the one that hit it, then its peers on their broken connections. So
that the launcher names the first (torchrun's agent polls every 0.1 s and cannot order failures
that close together), each worker the launcher started runs inside `failures_recorded`: it
notes its pid at start (`rank<R>.pid`), and a failure records itself (`rank<R>.failure.json`:
the moment, the exception in one line, and the peers on this node that had already ended
without finishing, e.g. killed or crashed outside Python, which record nothing, with their exit
status where /proc shows it). `first_failure` reads them.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ERROR_DIR_ENV = "TITAN_HYBRID_ERROR_DIR"
EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3


class JobError(ValueError):
    """A user error found after the pre-flight checks (e.g. while reading a checkpoint)."""


class DivergedError(RuntimeError):
    """The loss or gradient norm of a step is not finite; the step was not applied."""


def exit_code_of(error: BaseException) -> int:
    return EXIT_DIVERGED if isinstance(error, DivergedError) else EXIT_USER_ERROR


def report_and_exit(error: BaseException) -> None:
    """Leave this process with the error's one-line report and exit status (never returns)."""
    message = f"error: {error}"
    error_dir = os.environ.get(ERROR_DIR_ENV)
    if error_dir:
        rank = os.environ.get("RANK", "0")
        (Path(error_dir) / f"rank{rank}.txt").write_text(f"{exit_code_of(error)}\n{message}")
    else:
        print(message, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit: the interpreter's teardown would run gloo's destructors, which can abort
    # (see titan_hybrid.train) and turn a clean report into a crash.
    os._exit(exit_code_of(error))


@contextlib.contextmanager
def reported_at_once():
    """A user error or a divergence raised inside is reported (one line, the exit status) here,
    before any caller (e.g. torchrun's error recorder, which would print the traceback)."""
    try:
        yield
    except (JobError, DivergedError) as error:
        report_and_exit(error)


def first_reported_error(error_dir: Path) -> tuple[int, str] | None:
    """(exit status, message) of the lowest rank that reported one, or None."""
    reports = sorted(error_dir.glob("rank*.txt"), key=lambda p: int(p.stem[len("rank"):]))
    for report in reports:
        code, _, message = report.read_text().partition("\n")
        if message:
            return int(code), message
    return None


# /proc/<pid>/stat (Linux, proc(5)), fields counted from the state (field 3): the flags (field
# 9), where PF_EXITING (include/linux/sched.h) is set when a process starts to exit, before its
# exit code is set and its files (its connections to its peers) are closed; and that exit code
# (field 52, since Linux 3.5) in waitpid's form.
STAT_FLAGS, STAT_EXIT_CODE = 9 - 3, 52 - 3
PF_EXITING = 0x4


def _rank_and_attempt() -> tuple[int, int]:
    return (int(os.environ.get("RANK", "0")),
            int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))


def _ending(pid: int) -> tuple[bool, int | None]:
    """Whether process PID has ended or is ending, and if so its exit status where it shows
    (an exit status, or minus the signal that ended it), from Linux's /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return True, None  # reaped already
    if fields[0] not in ("Z", "X", "x") and not int(fields[STAT_FLAGS]) & PF_EXITING:
        return False, None
    # 0 where the field is missing or not shown: such a worker did not finish, so unknown.
    status = int(fields[STAT_EXIT_CODE]) if len(fields) > STAT_EXIT_CODE else 0
    return True, os.waitstatus_to_exitcode(status) if status else None


def _write_atomically(path: Path, text: str) -> None:
    """A reader sees all of TEXT or no file (a peer may read it at any moment)."""
    partial = path.with_name(f"{path.name}.partial")
    partial.write_text(text)
    os.replace(partial, path)


@dataclass(frozen=True)
class WorkerNote:
    """What a worker notes at start: its process, and which attempt of the group it is in."""
    pid: int
    attempt: int
    local_rank: int


def _pid_notes(error_dir: Path) -> dict[int, WorkerNote]:
    """rank -> its worker's note."""
    notes = {}
    for note in error_dir.glob("rank*.pid"):
        with contextlib.suppress(OSError, ValueError):  # removed meanwhile: the rank finished
            notes[int(note.stem[len("rank"):])] = WorkerNote(*map(int, note.read_text().split()))
    return notes


def _ended_peers(error_dir: Path, rank: int, attempt: int) -> dict[str, int | None]:
    """The ranks of this attempt on this node, other than RANK, whose process has ended (or is
    ending) without having finished (its pid note is still there), with their exit status where
    it shows."""
    if not Path("/proc/self/stat").exists():
        return {}  # no /proc: the launcher then orders the recorded failures only
    ended = {}
    for peer, note in _pid_notes(error_dir).items():
        if peer != rank and note.attempt == attempt:
            has_ended, status = _ending(note.pid)
            if has_ended:
                ended[str(peer)] = status
    return ended


@contextlib.contextmanager
def failures_recorded():
    """Around a worker's whole run, where the launcher set $TITAN_HYBRID_ERROR_DIR (no effect
    elsewhere): an exception leaving the block is recorded for `first_failure`, then propagates
    unchanged (its traceback is printed as before); a run that ends well removes its pid
    note."""
    error_dir = os.environ.get(ERROR_DIR_ENV)
    if not error_dir:
        yield
        return
    rank, attempt = _rank_and_attempt()
    note = Path(error_dir) / f"rank{rank}.pid"
    _write_atomically(note, f"{os.getpid()} {attempt} {os.environ.get('LOCAL_RANK', '0')}")
    try:
        yield
    except SystemExit as error:
        if error.code in (0, None):
            note.unlink(missing_ok=True)
        raise
    except BaseException as error:
        # The moment first. A failure this one causes in a peer (a broken connection) comes
        # after this process exits, so after this moment. CLOCK_MONOTONIC: one clock for the
        # whole host, which no clock adjustment moves.
        moment = time.monotonic_ns()
        message = str(error).strip().splitlines()
        summary = type(error).__name__ + (f": {message[0][:300]}" if message else "")
        record = {"rank": rank, "attempt": attempt, "monotonic_ns": moment, "summary": summary,
                  "ended_before": _ended_peers(Path(error_dir), rank, attempt)}
        with contextlib.suppress(OSError):  # the launcher is gone: nobody to tell
            _write_atomically(Path(error_dir) / f"rank{rank}.failure.json", json.dumps(record))
        raise
    note.unlink(missing_ok=True)


@dataclass(frozen=True)
class FirstFailure:
    rank: int
    local_rank: int
    pid: int
    summary: str | None  # the exception in one line; None: it ended without one
    exitcode: int | None = None  # without an exception: its exit status where a peer saw it


def first_failure(error_dir: Path) -> FirstFailure | None:
    """The worker whose failure came first in the last attempt on this node: the earliest
    recorded exception, or a worker that had ended without one (killed, or crashed outside
    Python) before it. None when no worker recorded a failure (the launcher then has only
    torchrun's account)."""
    records = []
    for path in error_dir.glob("rank*.failure.json"):
        with contextlib.suppress(OSError, ValueError):
            records.append(json.loads(path.read_text()))
    notes = _pid_notes(error_dir)
    attempt = max([r["attempt"] for r in records] + [n.attempt for n in notes.values()],
                  default=0)
    records = [record for record in records if record["attempt"] == attempt]
    if not records:
        return None
    first = min(records, key=lambda record: record["monotonic_ns"])
    # A peer that had ended before the first recorded failure, and recorded none, failed
    # first: the recorded ones failed on the connections it left.
    recorded = {record["rank"] for record in records}
    unrecorded = sorted(int(peer) for peer in first["ended_before"] if int(peer) not in recorded)
    rank = unrecorded[0] if unrecorded else first["rank"]
    note = notes.get(rank, WorkerNote(pid=0, attempt=attempt, local_rank=rank))
    if unrecorded:
        return FirstFailure(rank, note.local_rank, note.pid, None,
                            first["ended_before"][str(rank)])
    return FirstFailure(rank, note.local_rank, note.pid, first["summary"])

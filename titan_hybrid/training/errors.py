"""The two ways a run ends on purpose, and how each is reported.

A user error (a job field, a layout, a pattern, a checkpoint that cannot serve this job) and a
diverged run (non-finite loss or gradient norm) are not bugs: the user gets one short message,
no Python traceback, and a non-zero exit status. Anything else is a bug and keeps its traceback.

Inside torchrun workers the message is written to `$TITAN_HYBRID_ERROR_DIR/rank<R>.txt` when the
launcher (titan_hybrid.launch) set that variable, and the launcher prints it once; under a plain
torchrun the worker prints it itself.
"""

from __future__ import annotations

import contextlib
import os
import sys
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

"""How a user error found while tyro builds the config (in a `__post_init__`) reaches the user.

Under `python -m torchtitan.train` no code of titan_hybrid's is around the parse, so the error
is reported at once: one line and the exit status (titan_hybrid.runtime.errors). tyro would
turn a ValueError into its boxed panel instead. Under titan_hybrid's own front end
(front_end.parse_job) the error reaches the caller as a ValueError, carried through tyro, which
lets other exceptions pass, and the launcher reports it.
"""

from __future__ import annotations

import contextlib
import contextvars

from titan_hybrid.runtime.errors import report_and_exit

_caller_reports = contextvars.ContextVar("titan_hybrid_caller_reports", default=False)


class _CarriedUserError(Exception):
    """A ValueError on its way out of tyro."""


def report_user_error(error: ValueError) -> None:
    """From a __post_init__: report and leave, or carry the error to the front end's caller."""
    if _caller_reports.get():
        raise _CarriedUserError(error) from None
    report_and_exit(error)


@contextlib.contextmanager
def user_errors_raised():
    """Around a parse: a user error in a config's __post_init__ raises ValueError here."""
    reset = _caller_reports.set(True)
    try:
        yield
    except _CarriedUserError as carried:
        raise carried.args[0] from None
    finally:
        _caller_reports.reset(reset)

"""What torchrun's elastic agent says about failed workers and restarts, as callbacks; and where
the rest of what it says goes (`agent_logs_to`: a file).

The agent has no public hook for these events; it logs them. These are its log records
(torch 2.11 and 2.13-2.15, `torch/distributed/elastic/multiprocessing/api.py` and
`torch/distributed/elastic/agent/server/api.py`), recognised by their format strings:
- a worker failed: "failed (exitcode: %s) local_rank: %s (pid: %s) of fn: ..." (forked
  workers) or "... of binary: ..." (worker processes): args start (exitcode, local_rank, pid);
- the group restarts: "[%s] Worker group %s. %s/%s attempts left; will restart worker group":
  args (role, state, attempts left, max restarts).
Where the agent logs at all is internal too: module loggers (`logging.getLogger(__name__)` or
torch.distributed.elastic's `get_logger`) under the package paths in AGENT_LOGGER_ROOTS.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

FAILURE_PREFIX = "failed (exitcode: %s) local_rank: %s (pid: %s)"
RESTART_SUFFIX = "attempts left; will restart worker group"
AGENT_LOGGERS = ("torch.distributed.elastic.multiprocessing.api",
                 "torch.distributed.elastic.agent.server.api")
# The loggers under which torchrun's agent, its launcher and the process handling it uses log
# (module loggers of torch.distributed.elastic / launcher / run, torch.multiprocessing.spawn).
AGENT_LOGGER_ROOTS = ("torch.distributed.elastic", "torch.distributed.launcher",
                      "torch.distributed.run", "torch.multiprocessing")


class AgentEvents(logging.Handler):
    """Calls `on_failure(local_rank, exitcode, pid)` and `on_restart(restart, max_restarts)`
    for the agent's records; install with `listen`."""

    def __init__(self, on_failure: Callable[[int, int, int], None],
                 on_restart: Callable[[int, int], None]) -> None:
        super().__init__(level=logging.INFO)
        self.on_failure, self.on_restart = on_failure, on_restart

    def emit(self, record: logging.LogRecord) -> None:
        message, args = str(record.msg), record.args or ()
        if message.startswith(FAILURE_PREFIX) and len(args) >= 3:
            exitcode, local_rank, pid = args[:3]
            self.on_failure(int(local_rank), int(exitcode), int(pid))
        elif message.endswith(RESTART_SUFFIX) and len(args) == 4:
            left, maximum = int(args[2]), int(args[3])
            self.on_restart(maximum - left + 1, maximum)

    def listen(self) -> None:
        """Receive the agent's INFO records. They still go where the agent's loggers send
        them (the launcher sends them to its log file): listening hides nothing."""
        for name in AGENT_LOGGERS:
            agent_logger = logging.getLogger(name)
            agent_logger.addHandler(self)
            agent_logger.setLevel(logging.INFO)


@contextlib.contextmanager
def agent_logs_to(path: Path, *also: str) -> Iterator[None]:
    """Inside, the records of torchrun's agent (AGENT_LOGGER_ROOTS) and of the loggers ALSO, INFO
    and up, are appended to PATH and reach no other handler (the terminal keeps the launcher's
    own lines). torch.distributed.elastic's `get_logger` sets each of its loggers to WARNING;
    they are set to INFO, the agent's account of rendezvous rounds and worker starts."""
    roots = (*AGENT_LOGGER_ROOTS, *also)
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in [*roots, *logging.root.manager.loggerDict]:
        if name.startswith(roots):
            logging.getLogger(name).setLevel(logging.INFO)
    for name in roots:
        logging.getLogger(name).addHandler(handler)
        logging.getLogger(name).propagate = False
    try:
        yield
    finally:
        for name in roots:
            logging.getLogger(name).removeHandler(handler)
            logging.getLogger(name).propagate = True
        handler.close()

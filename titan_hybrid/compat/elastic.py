"""What torchrun's elastic agent says about failed workers and restarts, as callbacks.

The agent has no public hook for these events; it logs them. These are its log records
(torch 2.11 and 2.13-2.15, `torch/distributed/elastic/multiprocessing/api.py` and
`agent/server/api.py`), recognised by their format strings:
- a worker failed: "failed (exitcode: %s) local_rank: %s (pid: %s) of fn: ..." (forked
  workers) or "... of binary: ..." (worker processes): args start (exitcode, local_rank, pid);
- the group restarts: "[%s] Worker group %s. %s/%s attempts left; will restart worker group":
  args (role, state, attempts left, max restarts).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

FAILURE_PREFIX = "failed (exitcode: %s) local_rank: %s (pid: %s)"
RESTART_SUFFIX = "attempts left; will restart worker group"
AGENT_LOGGERS = ("torch.distributed.elastic.multiprocessing.api",
                 "torch.distributed.elastic.agent.server.api")


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
        """Receive the agent's INFO records; they reach no other handler (the launcher
        prints its own lines)."""
        for name in AGENT_LOGGERS:
            agent_logger = logging.getLogger(name)
            agent_logger.addHandler(self)
            agent_logger.setLevel(logging.INFO)
            agent_logger.propagate = False

"""Where this launch sits in a job: nodes, rendezvous and restarts, from run_train.sh's
environment (docs/operating.md, "Running on a cluster").

    NNODES          nodes in the job (default 1)
    NODE_RANK       this node's index; node 0 hosts the rendezvous store (default 0)
    RDZV_ENDPOINT   host:port of the rendezvous, the same on every node (needed with NNODES > 1)
    RDZV_ID         the job's rendezvous id (default: derived from job.dump_folder, so every
                    node of one job derives the same)
    RDZV_TIMEOUT    seconds to wait for every node to join (default 600)
    MAX_RESTARTS    times torchrun's agent restarts the worker group after a worker fails
                    (default 0); restarted workers resume from the newest intact checkpoint

The engine is torchrun's: a c10d rendezvous (`--nnodes N --rdzv-backend c10d`) and its elastic
agent (`--max-restarts`). Global ranks are given out by the rendezvous in order of arrival;
NODE_RANK only decides which node hosts the store.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from dataclasses import dataclass

DEFAULT_RDZV_TIMEOUT = 600


@dataclass(frozen=True)
class Cluster:
    nnodes: int = 1
    node_rank: int = 0
    endpoint: str = "localhost:0"  # one node: a free port on this host (torchrun --standalone)
    rdzv_id: str = ""
    timeout: int = DEFAULT_RDZV_TIMEOUT
    max_restarts: int = 0

    def torchrun_args(self) -> list[str]:
        """torchrun's rendezvous and restart options for this launch."""
        conf = f"join_timeout={self.timeout}"
        if self.nnodes > 1:
            conf += f",is_host={int(self.node_rank == 0)}"
        return ["--nnodes", str(self.nnodes), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.rdzv_id,
                "--rdzv-conf", conf, "--max-restarts", str(self.max_restarts)]


def _integer(env: dict[str, str], name: str, default: int, minimum: int) -> int:
    value = env.get(name, "")
    if value == "":
        return default
    if not value.isdigit() or int(value) < minimum:
        raise ValueError(f"{name}={value} must be an integer >= {minimum}")
    return int(value)


def cluster_from_env(env: dict[str, str], dump_folder: str) -> Cluster:
    """This launch's Cluster; ValueError naming the variable for a bad value."""
    nnodes = _integer(env, "NNODES", 1, 1)
    node_rank = _integer(env, "NODE_RANK", 0, 0)
    if node_rank >= nnodes:
        raise ValueError(f"NODE_RANK={node_rank} must be below NNODES={nnodes}")
    timeout = _integer(env, "RDZV_TIMEOUT", DEFAULT_RDZV_TIMEOUT, 1)
    max_restarts = _integer(env, "MAX_RESTARTS", 0, 0)
    endpoint = env.get("RDZV_ENDPOINT", "")
    if nnodes == 1:
        return Cluster(endpoint=endpoint or "localhost:0",
                       rdzv_id=env.get("RDZV_ID") or str(uuid.uuid4()),
                       timeout=timeout, max_restarts=max_restarts)
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or int(port) == 0:
        raise ValueError(f"RDZV_ENDPOINT='{endpoint}' must be host:port (the same on every "
                         f"node) when NNODES={nnodes}")
    digest = hashlib.sha1(dump_folder.encode()).hexdigest()[:16]
    return Cluster(nnodes, node_rank, endpoint, env.get("RDZV_ID") or f"titan-hybrid-{digest}",
                   timeout, max_restarts)


def restart_count() -> int:
    """How often torchrun's agent has restarted this worker's group (0 on the first start)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

"""The process groups this process holds: c10d's registry of them.

Why a private name: torch.distributed has no public way to list the groups a process has made
(`_world.pg_map`, c10d's own registry, holds every group from creation until it is destroyed).
titan_hybrid logs the list once a run has trained, so that a group made twice or made and left
behind shows in a 2-process run, long before a thousand-rank job pays a full mesh of TCP
connections for each. Checked on torch 2.11, 2.13, 2.14 and 2.15.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.distributed_c10d import _world

import titan_hybrid.compat  # noqa: F401  (the version check)


def live_process_groups() -> list[str]:
    """`description (backend, size)` of each group this process holds, in creation order.
    The description is what the group's creator called it (`group_desc`): DeviceMesh names
    its groups `mesh_<dim>`, and a group made without one is `undefined`."""
    return [f"{group.group_desc} ({dist.get_backend(group)}, {group.size()})"
            for group in _world.pg_map]


def log_process_groups() -> None:
    """One log line: how many groups this process holds, and which (docs/operating.md,
    "Process groups", lists those a run makes)."""
    from torchtitan.tools.logging import logger

    groups = live_process_groups()
    logger.info(f"Process groups: {len(groups)}: {'; '.join(groups)}")

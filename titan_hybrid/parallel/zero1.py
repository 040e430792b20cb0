"""ZeRO-1 for the `optim` strategy: full gradients (all-reduced by `replicate`), optimizer state
sharded by parameter ownership.

Each rank owns a subset of the parameters (greedy by size, in a fixed order, so the assignment
is the same on every rank) and runs the inner optimizer on those alone; after the step every
owner broadcasts its updated parameters in one flat bucket. The update of each parameter is the
same arithmetic as the unsharded optimizer's, so the loss curve equals no_shard's bitwise.
torch's ZeroRedundancyOptimizer does the same but broadcasts DTensor parameters' storage, which
`replicate` makes DTensors; here the broadcast is on local tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.device_mesh import DeviceMesh


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def assign_owners(params: list[nn.Parameter], world_size: int) -> list[int]:
    """Greedy: largest parameters first, each to the least-loaded rank (ties: lowest rank)."""
    load = [0] * world_size
    owners = [0] * len(params)
    for index in sorted(range(len(params)), key=lambda i: (-params[i].numel(), i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[index] = rank
        load[rank] += params[index].numel()
    return owners


class ZeroOneOptimizer(torch.optim.Optimizer):
    """Wraps `optimizer_cls` so that this rank only keeps state for the parameters it owns."""

    def __init__(self, param_groups: list[dict[str, Any]], optimizer_cls, optimizer_kwargs,
                 *, mesh: DeviceMesh) -> None:
        self.group = mesh.get_group()
        self.rank, world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.all_params = [p for group in param_groups for p in group["params"]]
        self.owners = assign_owners(self.all_params, world_size)
        owner_of = {id(p): o for p, o in zip(self.all_params, self.owners)}
        owned_groups = [{**group, "params": [p for p in group["params"]
                                             if owner_of[id(p)] == self.rank]}
                        for group in param_groups]
        self.inner = optimizer_cls(owned_groups, **optimizer_kwargs)
        # Share the inner optimizer's view so torchtitan's state_dict and LR schedulers see
        # (and change) the owned parameters' groups and state.
        self.defaults = self.inner.defaults
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.inner.step(closure)
        for owner in range(dist.get_world_size(self.group)):
            tensors = [_local(p) for p, o in zip(self.all_params, self.owners) if o == owner]
            if not tensors:
                continue
            bucket = _flatten_dense_tensors(tensors)
            dist.broadcast(bucket, group=self.group,
                           group_src=owner)
            for tensor, synced in zip(tensors, _unflatten_dense_tensors(bucket, tensors)):
                tensor.copy_(synced)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Gradients of parameters owned elsewhere are still produced by backward.
        for p in self.all_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

"""ZeRO-1 for the `optim` strategy: full gradients (all-reduced by `replicate`), optimizer state
sharded by parameter ownership.

Each rank owns a subset of the parameters (greedy by size, in a fixed order, so the assignment
is the same on every rank). Before every step the gradients of parameters owned elsewhere are
dropped, so the optimizer neither updates them nor allocates state for them (Adam creates its
moments lazily); after the step each owner broadcasts its updated parameters in one flat
bucket. Each parameter's update is the same arithmetic as the unsharded optimizer's, so the loss
curve equals no_shard's bit for bit. The optimizer stays a plain torch optimizer, so torch's
optimizer state-dict utilities (and checkpoints) work unchanged; each rank's state dict holds
its own parameters' states. torch's ZeroRedundancyOptimizer does the same but broadcasts
DTensor parameters' storage, which `replicate` makes DTensors; here the broadcast is on local
tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
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


def shard_optimizer_state(optimizer: torch.optim.Optimizer, mesh: DeviceMesh) -> None:
    """Turn `optimizer` into a ZeRO-1 optimizer over the ranks of `mesh` (see module doc)."""
    group = mesh.get_group()
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    owners = assign_owners(params, world_size)

    def drop_foreign_grads(opt, args, kwargs):
        for param, owner in zip(params, owners):
            if owner != rank:
                param.grad = None

    @torch.no_grad()
    def broadcast_from_owners(opt, args, kwargs):
        for owner in range(world_size):
            tensors = [_local(p) for p, o in zip(params, owners) if o == owner]
            if not tensors:
                continue
            bucket = torch.cat([tensor.reshape(-1) for tensor in tensors])
            dist.broadcast(bucket, group=group, group_src=owner)
            synced = bucket.split([tensor.numel() for tensor in tensors])
            for tensor, values in zip(tensors, synced):
                tensor.copy_(values.view_as(tensor))

    optimizer.register_step_pre_hook(drop_foreign_grads)
    optimizer.register_step_post_hook(broadcast_from_owners)

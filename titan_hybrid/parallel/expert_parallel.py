"""Expert parallelism: each rank of the EP group holds E/ep of every MoE layer's experts, and
the tokens routed to an expert travel to its rank and back with all-to-alls.

The model's MoE sorts its (token, expert) slots by expert and calls
`experts(x_sorted, tokens_per_expert)` with the counts on the device; single-device code runs
every expert there (grouped GEMMs, no host sync). Under EP the experts module's parameters
become DTensors sharded on dim 0 (the expert dim) over the EP mesh, and two hooks around its
forward move the tokens:

    dispatch (pre-hook)   exchange the slot counts, read them on the host (the all-to-all
                          splits; EP's one sync per dispatch), all-to-all the sorted slots to
                          the ranks owning their experts, regroup the received slots by local
                          expert
    combine (post-hook)   undo the regrouping, all-to-all the expert outputs back

so the module computes on local experts only and the MoE's combine (gather back to tokens,
weighting) is untouched. Both regroupings are gathers, forward and backward
(moe.gather_rows). Backward is the same all-to-alls with the splits swapped (collectives.py).
With the EP-overlap schedule, `install_overlap_hooks` gives each dispatcher (returned by
`apply_expert_parallel`, kept in the ParallelPlan) the coordinator that lets the other
microbatch run while they are in flight.

Expert gradients arrive already summed over the EP group (every rank's tokens reach the owning
rank); data parallelism then shards experts over the ranks that hold the same experts
("efsdp", see data_parallel.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from titan_hybrid.model.model import routed_experts
from titan_hybrid.model.moe import gather_rows, inverse_permutation
from titan_hybrid.parallel.collectives import all_to_all
from titan_hybrid.parallel.tensor_parallel import use_local_views


class _Routing:
    """What dispatch learned that combine needs to send the outputs back."""

    def __init__(self, send_splits: list[int], recv_splits: list[int], by_expert: torch.Tensor,
                 by_source: torch.Tensor):
        self.send_splits = send_splits
        self.recv_splits = recv_splits
        self.by_expert = by_expert  # received slot order -> grouped by local expert
        self.by_source = by_source  # and back (its inverse permutation)


def _exchange_counts(tokens_per_expert: torch.Tensor, group) -> torch.Tensor:
    """[ep, local experts]: row s holds the slot counts rank s sends to this rank's experts.
    Exchanged on the counts' device (NCCL takes device tensors only)."""
    received = torch.empty_like(tokens_per_expert)
    dist.all_to_all_single(received, tokens_per_expert, group=group)
    return received.view(group.size(), -1)


def _group_by_local_expert(received_counts: torch.Tensor) -> torch.Tensor:
    """Indices that reorder slots received as (source rank, local expert) blocks into
    (local expert, source rank) blocks, so each local expert's slots are contiguous."""
    starts = (received_counts.flatten().cumsum(0) - received_counts.flatten()).view_as(received_counts)
    blocks = [torch.arange(start, start + count)
              for expert in range(received_counts.shape[1])
              for start, count in zip(starts[:, expert].tolist(), received_counts[:, expert].tolist())]
    return torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.int64)


class ExpertDispatcher:
    """The dispatch / combine hooks of one experts module."""

    def __init__(self, ep_mesh: DeviceMesh) -> None:
        self.group = ep_mesh.get_group()
        self.pending: list[_Routing] = []  # a stack: activation recompute nests forwards
        self.overlap = None  # the EP-overlap coordinator, set by install_overlap_hooks

    def dispatch(self, module: nn.Module, args):
        x_sorted, tokens_per_expert = args
        ep = self.group.size()
        received_counts = _exchange_counts(tokens_per_expert, self.group)
        # The all-to-all splits are host numbers: both count tables in one read.
        sent_host, received_host = torch.stack(
            (tokens_per_expert.view(ep, -1), received_counts)).cpu()
        send_splits, recv_splits = sent_host.sum(1).tolist(), received_host.sum(1).tolist()
        received = all_to_all(x_sorted, send_splits=send_splits, recv_splits=recv_splits,
                              group=self.group, overlap=self.overlap)
        by_expert = _group_by_local_expert(received_host)
        by_source = inverse_permutation(by_expert)
        by_expert, by_source = by_expert.to(x_sorted.device), by_source.to(x_sorted.device)
        self.pending.append(_Routing(send_splits, recv_splits, by_expert, by_source))
        return gather_rows(received, by_expert, by_source), received_counts.sum(0)

    def combine(self, module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        routing = self.pending.pop()
        unsorted = gather_rows(output, routing.by_source, routing.by_expert)
        # Back along the same paths: what this rank received it now sends.
        return all_to_all(unsorted, send_splits=routing.recv_splits,
                          recv_splits=routing.send_splits, group=self.group,
                          overlap=self.overlap)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> dict[str, ExpertDispatcher]:
    """Shard every MoE layer's experts over `ep_mesh` (dim 0) and route tokens with
    all-to-alls. Applied to the model on the meta device, after tensor parallelism and before
    data parallelism. With TP, `ep_mesh` is torchtitan's 2-D ("ep", "etp") mesh: experts keep
    their TP sharding (hidden units) on "etp", and each TP rank exchanges its (identical,
    replicated) tokens with the EP ranks of the same TP index. Returns the dispatchers by the
    experts modules' FQNs."""
    dispatchers = {}
    tensor_parallel = ep_mesh.ndim == 2
    for experts_name, experts in routed_experts(model).items():
        for name, param in list(experts.named_parameters(recurse=False)):
            placements = [Shard(0), *param.placements] if tensor_parallel else [Shard(0)]
            full = torch.empty(param.shape, dtype=param.dtype, device="meta")
            sharded = distribute_tensor(full, ep_mesh, placements, src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(sharded, param.requires_grad))
        # Experts are their own FSDP unit, which gathers their parameters at their forward,
        # after any outer region swapped in local views; so they swap their own (sharded
        # under TP, none has a partial gradient).
        use_local_views(experts, [(experts, set())])
        dispatcher = ExpertDispatcher(ep_mesh["ep"] if tensor_parallel else ep_mesh)
        experts.register_forward_pre_hook(dispatcher.dispatch)
        experts.register_forward_hook(dispatcher.combine)
        dispatchers[experts_name] = dispatcher
    return dispatchers

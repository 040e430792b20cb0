"""The differentiable collectives of expert and context parallelism.

`all_to_all` (an all-to-all whose backward is the reverse all-to-all) serves the MoE dispatch
and combine (expert_parallel.py) and the heads <-> sequence exchange of the recurrent kinds under
context parallelism. `all_gather` (an all-gather whose backward is a reduce-scatter) serves the
key / value gather of attention under context parallelism (context_parallel.py), the chunkwise
halos and state summaries, and the compressed rows of `C` / `H`: one all_gather_into_tensor of
the rank's block, the collective NCCL and gloo implement for it, and no per-destination copy.
`all_reduce_sum` (an all-reduce whose backward is an all-reduce) sums a partial sum over the
heads or channels a rank holds (TensorParallelPartialSum: tensor_parallel.py, and the head
exchange of context_parallel.py).

Why not torch.distributed.nn.functional: its `all_to_all_single` and `all_gather` do run on
gloo and give the same numbers (checked, forward and backward), but torch 2.13 deprecates both
(a FutureWarning at every call) in favour of torch.distributed._functional_collectives, a
private module; and the EP-overlap schedule needs each all-to-all, forward and backward, issued
asynchronously with a hand-over to the other microbatch while it is in flight (`overlap`),
which no public differentiable collective offers. Inside compiled code the exchanges are the
functional collectives instead (compat.collectives says why).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.distributed as dist

from titan_hybrid.compat.collectives import (
    traceable_all_gather,
    traceable_all_to_all,
    traceable_reduce_scatter,
)


class HandOver(Protocol):
    """What `all_to_all` calls right after issuing its collective asynchronously; it must
    wait for `work` before returning (ep_overlap.py's coordinator lets the other microbatch
    compute in between)."""

    def communicate(self, work) -> None: ...


class TrafficRecord:
    """Bytes of this rank's collectives, call by call, while `record_traffic()` is active: what
    bench/ counts communication with. `sent`: this rank's own data that it hands on to other
    ranks (an all-to-all's rows for the others; a gather's block, once, which the collective
    delivers to every other rank). `received`: data of other ranks that arrives here."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.received: list[int] = []

    def add(self, sent: int, received: int) -> None:
        self.sent.append(sent)
        self.received.append(received)


_active_records: list[TrafficRecord] = []


@contextlib.contextmanager
def record_traffic() -> Iterator[TrafficRecord]:
    record = TrafficRecord()
    _active_records.append(record)
    try:
        yield record
    finally:
        _active_records.remove(record)


def _row_bytes(x: torch.Tensor) -> int:
    return x.numel() // max(x.shape[0], 1) * x.element_size()


def _exchange(x: torch.Tensor, send_splits: list[int] | None, recv_splits: list[int] | None,
              group, overlap: HandOver | None) -> torch.Tensor:
    x = x.contiguous()
    if _active_records:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        kept = x.shape[0] // world if send_splits is None else send_splits[rank]
        arriving = x.shape[0] - kept if recv_splits is None else sum(recv_splits) - recv_splits[rank]
        for record in _active_records:
            record.add((x.shape[0] - kept) * _row_bytes(x), arriving * _row_bytes(x))
    if torch.compiler.is_compiling():  # compat.collectives: why not c10d's in-place form
        return traceable_all_to_all(x, recv_splits=recv_splits, send_splits=send_splits,
                                    group=group)
    rows = x.shape[0] if recv_splits is None else sum(recv_splits)
    out = x.new_empty((rows, *x.shape[1:]))  # contiguous, whatever x's strides were
    if overlap is None:
        dist.all_to_all_single(out, x, recv_splits, send_splits, group=group)
    else:
        overlap.communicate(dist.all_to_all_single(out, x, recv_splits, send_splits,
                                                   group=group, async_op=True))
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group, overlap):
        ctx.splits, ctx.group, ctx.overlap = (send_splits, recv_splits), group, overlap
        return _exchange(x, send_splits, recv_splits, group, overlap)

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        return _exchange(grad, recv_splits, send_splits, ctx.group, ctx.overlap), *[None] * 4


def all_to_all(x: torch.Tensor, *, group, send_splits: list[int] | None = None,
               recv_splits: list[int] | None = None,
               overlap: HandOver | None = None) -> torch.Tensor:
    """Rows x[sum(send_splits[:r]) : ...] go to rank r of `group`; returns the rows received,
    by source rank (without splits: equal blocks of dim 0). The backward sends the gradient
    back along the same paths. With `overlap`, forward and backward hand over while in flight."""
    return _AllToAll.apply(x, send_splits, recv_splits, group, overlap)


def _record_block_exchange(block: torch.Tensor, group, *, blocks_sent: int) -> None:
    if _active_records:
        others = dist.get_world_size(group) - 1
        for record in _active_records:
            record.add(blocks_sent * block.nbytes, others * block.nbytes)


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    """[world, *x.shape] from every rank's x: one all-gather into one buffer."""
    x = x.contiguous()
    _record_block_exchange(x, group, blocks_sent=1)
    world = dist.get_world_size(group)
    if torch.compiler.is_compiling():
        return traceable_all_gather(x.reshape(-1), group=group).view(world, *x.shape)
    out = x.new_empty((world, *x.shape))
    dist.all_gather_into_tensor(out.view(-1), x.view(-1), group=group)
    return out


def _sum_scatter(grad: torch.Tensor, group) -> torch.Tensor:
    """grad [world, *shape] on every rank -> this rank's block summed over all ranks."""
    grad = grad.contiguous()
    world = grad.shape[0]
    _record_block_exchange(grad[0], group, blocks_sent=world - 1)
    if torch.compiler.is_compiling():
        return traceable_reduce_scatter(grad.view(-1), group=group).view(grad.shape[1:])
    out = grad.new_empty(grad.shape[1:])
    dist.reduce_scatter_tensor(out.view(-1), grad.view(-1), op=dist.ReduceOp.SUM, group=group)
    return out


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _sum_scatter(grad, ctx.group), None


def all_gather(x: torch.Tensor, *, group) -> torch.Tensor:
    """[world, *x.shape]: every rank's x, by rank. The backward is the reduce-scatter: each rank
    gets the sum, over all ranks, of the gradients held for its block."""
    return _AllGather.apply(x, group)


class _AllReduceSum(torch.autograd.Function):
    """Summed over the group forward; the gradient summed over it too (every rank computes
    with the same total, each for its own heads)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        total = x.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


def all_reduce_sum(x: torch.Tensor, *, group) -> torch.Tensor:
    """The sum of every rank's x, on every rank; its backward sums the gradients the same way."""
    return _AllReduceSum.apply(x, group)

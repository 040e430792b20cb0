"""The differentiable collectives of expert and context parallelism: one autograd function.

`all_to_all` (an all-to-all whose backward is the reverse all-to-all) serves the MoE dispatch
and combine (expert_parallel.py), the heads <-> sequence exchange of Mamba2 / GDN under context
parallelism, and, through `all_gather`, the key / value gather of attention under context
parallelism (context_parallel.py).

Why not torch.distributed.nn.functional: its `all_to_all_single` and `all_gather` do run on
gloo and give the same numbers (checked, forward and backward), but torch 2.13 deprecates both
(a FutureWarning at every call) in favour of torch.distributed._functional_collectives, a
private module; and the EP-overlap schedule needs each all-to-all, forward and backward, issued
asynchronously with a hand-over to the other microbatch while it is in flight (`overlap`),
which no public differentiable collective offers. gloo has no reduce-scatter, which is why the
gather's backward is an all-to-all and a sum rather than a reduce-scatter. Inside compiled code
the exchange is the functional all-to-all instead (compat.collectives says why).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.distributed as dist

from titan_hybrid.compat.collectives import traceable_all_to_all


class HandOver(Protocol):
    """What `all_to_all` calls right after issuing its collective asynchronously; it must
    wait for `work` before returning (ep_overlap.py's coordinator lets the other microbatch
    compute in between)."""

    def communicate(self, work) -> None: ...


class TrafficRecord:
    """Bytes this rank sends to other ranks through `all_to_all` (and `all_gather`), call by
    call, while `record_traffic()` is active: what bench/ counts communication with."""

    def __init__(self) -> None:
        self.sent: list[int] = []


_active_records: list[TrafficRecord] = []


@contextlib.contextmanager
def record_traffic() -> Iterator[TrafficRecord]:
    record = TrafficRecord()
    _active_records.append(record)
    try:
        yield record
    finally:
        _active_records.remove(record)


def _bytes_to_others(x: torch.Tensor, send_splits: list[int] | None, group) -> int:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    kept_rows = x.shape[0] // world if send_splits is None else send_splits[rank]
    return (x.shape[0] - kept_rows) * (x.numel() // max(x.shape[0], 1)) * x.element_size()


def _exchange(x: torch.Tensor, send_splits: list[int] | None, recv_splits: list[int] | None,
              group, overlap: HandOver | None) -> torch.Tensor:
    x = x.contiguous()
    for record in _active_records:
        record.sent.append(_bytes_to_others(x, send_splits, group))
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


def all_gather(x: torch.Tensor, *, group) -> torch.Tensor:
    """[world, *x.shape]: every rank's x, by rank. The backward sums, for each rank, the
    gradients all ranks hold for its block: the all-to-all of x repeated once per rank, whose
    expand's backward is that sum."""
    world = dist.get_world_size(group)
    return all_to_all(x.unsqueeze(0).expand(world, *x.shape), group=group)

"""Collectives inside compiled graphs: torch.distributed._functional_collectives.

Why a private module: dynamo traces c10d's in-place collectives by rewriting them to these
functional ones (which return their result instead of writing into a buffer), and torch 2.11
loses that write in the backward of a custom autograd.Function: an `all_to_all_single` into a
fresh buffer comes back as the buffer's initial contents (zeros on CPU), so every gradient
through the context-parallel exchanges of a compiled layer was wrong, from the second step's
loss on. Calling the functional form directly inside traced code gives dynamo nothing to
rewrite. Checked on torch 2.11, 2.13, 2.14 and 2.15 (compiled forward and backward equal
eager, bitwise, with even and uneven splits: tests/distributed/test_compile.py).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as functional_collectives

import titan_hybrid.compat  # noqa: F401  (the version check)


def traceable_all_to_all(x: torch.Tensor, *, recv_splits: list[int] | None,
                         send_splits: list[int] | None, group) -> torch.Tensor:
    """`dist.all_to_all_single` as a value, for code that dynamo traces."""
    return functional_collectives.all_to_all_single(x, recv_splits, send_splits, group)


def traceable_all_gather(x: torch.Tensor, *, group) -> torch.Tensor:
    """`dist.all_gather_into_tensor` along dim 0, as a value, for code that dynamo traces."""
    return functional_collectives.all_gather_tensor(x, 0, group)


def traceable_reduce_scatter(x: torch.Tensor, *, group) -> torch.Tensor:
    """`dist.reduce_scatter_tensor` (sum) along dim 0, as a value, for code that dynamo
    traces."""
    return functional_collectives.reduce_scatter_tensor(x, "sum", 0, group)


def traceable_all_reduce(x: torch.Tensor, *, group) -> torch.Tensor:
    """`dist.all_reduce` (sum), as a value, for code that dynamo traces (no gradient)."""
    return functional_collectives.all_reduce(x, "sum", group)

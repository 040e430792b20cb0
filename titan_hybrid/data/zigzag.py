"""Load-balanced (zigzag) sequence sharding for context parallelism.

A sequence is cut into 2*cp equal chunks; CP rank r keeps chunks r and 2cp-1-r. Under a causal
mask the early chunk has little to attend to and the late one a lot, so every rank does the same
work. Packed rows (documents back to back, boundaries in `cu_seqlens`) are zigzagged one
document at a time, so each rank holds a piece of every document.

These functions return indices into the full row; `tensor.index_select(seq_dim, index)` shards.
"""

from __future__ import annotations

import torch


def zigzag_index(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Positions of the full sequence that CP rank `rank` keeps, in local order."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 * "
                         f"context_parallel_degree = {2 * cp} (zigzag needs 2*cp equal chunks)")
    chunk = seq_len // (2 * cp)
    early, late = rank, 2 * cp - 1 - rank
    return torch.cat((torch.arange(early * chunk, (early + 1) * chunk),
                      torch.arange(late * chunk, (late + 1) * chunk)))


def packed_zigzag_index(cu_seqlens: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Zigzag applied to each packed sequence of a row; `cu_seqlens` [n+1] holds boundaries."""
    bounds = cu_seqlens.tolist()
    pieces = []
    for index, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if (end - start) % (2 * cp):
            raise ValueError(f"packed sequence {index} has length {end - start}, not divisible "
                             f"by 2 * context_parallel_degree = {2 * cp}; pad each sequence "
                             "to a multiple of it (cu_seqlens_padded)")
        pieces.append(start + zigzag_index(end - start, cp, rank))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)

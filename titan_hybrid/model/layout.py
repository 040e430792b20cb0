"""Where each token of a batch sits: its document and its position in it.

A row of `[B, T]` tokens may hold several documents back to back (packed sequences, THD in
Megatron's terms). The model then keeps documents apart everywhere: attention masks across
them, Mamba / GDN states restart at each boundary, rotary positions restart at 0. The same
fields describe a context-parallel shard, whose tokens are not contiguous in the row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLayout:
    """`positions` [B, T]: position of each token in its document (None: 0..T-1).
    `seq_idx` [B, T]: document number of each token, non-decreasing along a row (None: one
    document per row). `rope_table` [max_seq_len, head_dim/2, 2]: the model's rotary table.

    Methods take the sequence length because with sequence parallelism the hidden state outside
    the mixers is a shard, while the mixers see the whole (CP-local) sequence."""

    positions: torch.Tensor | None
    seq_idx: torch.Tensor | None
    rope_table: torch.Tensor | None = None
    token_ids: torch.Tensor | None = None  # [B, T]: what hash-routed MoE layers choose by

    def is_plain_causal(self) -> bool:
        """One document per row and tokens in order: plain causal masking is exact."""
        return self.positions is None and self.seq_idx is None

    def rope(self, seq_len: int) -> torch.Tensor:
        """[B or 1, T, head_dim/2, 2]: the rotary table rows of each token's position."""
        if self.positions is None:
            return self.rope_table[:seq_len][None]
        return self.rope_table[self.positions.long()]

    def row_order(self, seq_len: int, device: torch.device | None = None) -> torch.Tensor:
        """[B or 1, T] key that sorts tokens into row order (documents, then positions);
        `device` is where 0..T-1 goes when the layout has no positions."""
        if self.positions is None:
            positions = torch.arange(seq_len, device=device)[None]
        else:
            positions = self.positions.long()
        if self.seq_idx is None:
            return positions
        return self.seq_idx.long() * (1 << 32) + positions


def documents_from_bos(tokens_BT: torch.Tensor, bos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq_idx, positions) of rows in which each document starts with `bos_id`; the tokens
    before a row's first BOS form document 0 (the tail of a document cut by the window)."""
    starts = tokens_BT == bos_id
    seq_idx = starts.cumsum(1)
    index = torch.arange(tokens_BT.shape[1], device=tokens_BT.device).expand_as(tokens_BT)
    start_of_doc = torch.where(starts, index, torch.zeros_like(index)).cummax(1).values
    return seq_idx.to(torch.int32), (index - start_of_doc).to(torch.int32)


def packed_layout(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq_idx, positions), each [1, T], of one packed row with boundaries `cu_seqlens` [n+1]."""
    lengths = cu_seqlens.diff().long()
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths)
    positions = torch.arange(int(cu_seqlens[-1]), device=lengths.device) - starts
    return seq_idx[None].to(torch.int32), positions[None].to(torch.int32)


def causal_document_mask(query: TokenLayout, key: TokenLayout, q_len: int, k_len: int,
                         device: torch.device) -> torch.Tensor:
    """[B, 1, Tq, Tk] True where the key is at or before the query in the same document."""
    mask = (key.row_order(k_len, device)[:, None, :]
            <= query.row_order(q_len, device)[:, :, None])
    if query.seq_idx is not None:
        mask &= key.seq_idx[:, None, :] == query.seq_idx[:, :, None]
    return mask.unsqueeze(1)

"""Context parallelism for DeepSeek-V4's compressors (`C`, `H`): every rank gets every row.

A query may see any compressed row of its document before it, and `C`'s top-k must choose
among all of them, so each rank needs the rows of the whole sequence, which are few (one per
`compress_ratio` tokens). Each rank's tokens are two zigzag pieces of every row
(data/zigzag.py); per layer and direction:

1. Token halo. A block that ends in a piece may start before it, and a `C` row also reads the
   block before its own, so each piece reads the `compressor_halo` tokens before it (ratio - 1
   for `H`, 2 * ratio - 1 for `C`) with their row order: one all-gather of every piece's last
   tokens' layer input, whatever the sequence length (ZigzagPieces.with_left_context). The
   first piece of a row gets zeros in a document of their own.
2. Local rows. The layer's own compressor runs on [halo | piece] and keeps the rows of the
   blocks whose last token lies in the piece: every block is kept by exactly one piece.
3. Rows gathered. One all-gather of the kept rows (and `C`'s indexer keys) with their last
   token's row order; every rank sorts them into row order and keeps the first
   T // ratio slots, the single-process layout: the rows in row order, then slots no query
   sees. So the indexer's scores are those of one process, ties included.

The backward is autograd's: the all-gathers return each row's and each halo token's gradient
to the rank that holds it. Traffic per layer: the halo, and T / ratio rows of head_dim (plus
index_head_dim for `C`) channels, against T tokens' keys for the attention kinds' all-gather.
"""

from __future__ import annotations

import torch
from torch import nn

from titan_hybrid.model.deepseek_v4_hca import CompressedRows
from titan_hybrid.model.layout import TokenLayout
from titan_hybrid.model.module_classes import extend_class
from titan_hybrid.parallel.collectives import all_gather
from titan_hybrid.parallel.context_parallel_chunkwise import ZigzagPieces

NOT_KEPT = torch.iinfo(torch.int64).max  # row order of a slot no piece keeps: sorts last
_OWN_DOCUMENT = -1  # seq_idx of the zeros before a row's first piece


class ContextParallelCompressedRows:
    """Mixed into the compressor's class (`install`, model/module_classes.py), so its
    parameters keep their names (checkpoint keys, FSDP units) and the layer calls it as
    before; its own forward compresses the pieces (super().forward)."""

    @classmethod
    def install(cls, compressor: nn.Module, group) -> None:
        compressor.context_parallel_group = group
        extend_class(compressor, cls)

    def forward(self, x_BTD: torch.Tensor, layout: TokenLayout | None) -> CompressedRows:
        if layout is None or layout.positions is None:
            raise ValueError("context parallel needs the positions of the local tokens: call "
                             "the model with positions= (and seq_idx= for packed documents)")
        args = self.args
        ratio, halo = args.compress_ratio, args.compressor_halo
        batch, seq_len, _ = x_BTD.shape
        pieces = ZigzagPieces(self.context_parallel_group, seq_len, batch)
        order = pieces.stack(layout.row_order(seq_len).expand(batch, -1))
        x, order, _ = pieces.with_left_context(pieces.stack(x_BTD), order, halo + 1)
        if pieces.piece[0] == 0:  # before the row's first piece: zeros, no document of ours
            order[:batch, :halo] = (_OWN_DOCUMENT << 32) + torch.arange(halo,
                                                                         device=order.device)
        local = TokenLayout(positions=order & 0xFFFFFFFF, seq_idx=order >> 32)
        rows = super().forward(x, local)
        # Kept: complete blocks whose last token lies in the piece (not in its halo).
        kept = rows.complete & (rows.last_order >= order[:, halo:halo + 1])
        last_order = torch.where(kept, rows.last_order, NOT_KEPT)
        fields = [rows.kv] + ([] if rows.index_keys is None else [rows.index_keys])
        gathered = [self._gather_pieces(pieces, field) for field in fields]
        last_order = self._gather_pieces(pieces, last_order)
        # Row order, then the slots nobody kept; as many slots as one process has.
        slots = seq_len * pieces.cp // ratio
        by_order = last_order.argsort(dim=1)[:, :slots]
        last_order = last_order.gather(1, by_order)
        gathered = [field.gather(1, by_order[..., None].expand(-1, -1, field.shape[-1]))
                    for field in gathered]
        return CompressedRows(gathered[0], gathered[1] if len(gathered) > 1 else None,
                              last_order, last_order != NOT_KEPT)

    def _gather_pieces(self, pieces: ZigzagPieces, x_PC: torch.Tensor) -> torch.Tensor:
        """[2B, C, ...] of every rank -> [B, cp * 2 * C, ...]."""
        every = all_gather(pieces.by_slot(x_PC), group=self.context_parallel_group)  # [cp, 2, B, C, ...]
        return every.movedim(2, 0).flatten(1, 3)

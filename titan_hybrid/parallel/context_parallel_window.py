"""Context parallelism for DeepSeek-V4 sliding-window attention (`W`): a halo of keys.

A query sees at most the window - 1 tokens before it. Each rank's tokens are two zigzag pieces
of every row (data/zigzag.py), so all a piece lacks is the last window - 1 keys of the
piece before it in row order: one all-gather of every piece's last window - 1 latent keys
(already rotated; the latent is also the value) and of their row order (document, position),
whatever the sequence length. Each piece then runs the layer's own windowed attention over
[halo | piece], with the halo's queries left out. The compressed kinds' rows (`C`, `H`) come
in whole (context_parallel_compressed.py) and join each piece's softmax as they are. The first piece of a row gets a halo that
no query may see. The backward is autograd's: the all-gather returns the halo keys' gradients
to the ranks that hold them.
"""

from __future__ import annotations

import torch
from torch import nn

from titan_hybrid.model.layout import TokenLayout
from titan_hybrid.parallel.context_parallel_chunkwise import ZigzagPieces

# Row-order key of a halo that no query sees: further below than any window reaches.
_UNSEEN = -(1 << 62)


class ContextParallelWindowHalo(nn.Module):
    def __init__(self, core: nn.Module, group) -> None:
        super().__init__()
        self.core, self.group = core, group

    def forward(self, q_BTHD, kv_BTD, sinks_H, layout: TokenLayout | None, extra_kv_BCD=None,
                extra_visible_BTC=None):
        if layout is None or layout.positions is None:
            raise ValueError("context parallel needs the positions of the local tokens: call "
                             "the model with positions= (and seq_idx= for packed documents)")
        window = self.core.window
        batch, seq_len = q_BTHD.shape[:2]
        pieces = ZigzagPieces(self.group, seq_len, batch)
        order = pieces.stack(layout.row_order(seq_len).expand(batch, -1))
        kv, halo_order, _ = pieces.with_left_context(pieces.stack(kv_BTD), order, window)
        halo = window - 1
        if pieces.piece[0] == 0:  # the row's first piece: nothing before it
            halo_order[:batch, :halo] = _UNSEEN
        q = pieces.stack(q_BTHD)
        q = torch.cat((q.new_zeros(q.shape[0], halo, *q.shape[2:]), q), 1)
        if extra_kv_BCD is not None:  # the compressed rows: the same for both pieces
            extra_kv_BCD = torch.cat((extra_kv_BCD, extra_kv_BCD))
            visible = pieces.stack(extra_visible_BTC)
            extra_visible_BTC = torch.cat((visible.new_zeros(visible.shape[0], halo,
                                                             visible.shape[-1]), visible), 1)
        out = self.core(q, kv, sinks_H, TokenLayout(positions=halo_order, seq_idx=None),
                        extra_kv_BCD, extra_visible_BTC)
        return pieces.unstack(out[:, halo:])

"""DeepSeek-V4 compressed sparse attention (pattern symbol `C`).

The sliding-window layer of deepseek_v4.py plus transformers' DeepseekV4CSACompressor (layer
type "compressed_sparse_attention"): every `compress_ratio` (4) tokens give one more key /
value row, pooled over overlapping windows, and a lightning indexer picks the `index_topk`
rows each query attends to, next to its window keys, in one softmax with the sink.

The compressor. kv_proj and gate_proj give each token 2 * head_dim channels, two series: Ca
(the first half, its share of the next block's row) and Cb (the second, its share of its own
block's). Row w of a document pools the 2 * ratio slots [Ca of block w - 1 | Cb of block w]:

    row_w = kv_norm( sum_slots softmax_slots(gate + position_bias[place in block]) * kv )

per channel, then RoPE rotates its trailing channels at w * ratio, as the heavily compressed
kind (deepseek_v4_hca.py: blocks count from each document's start, a query at position t sees
the (t + 1) // ratio rows of its document's blocks that end at or before it). A document's
first block has no block before it: those slots get weight 0 (transformers' -inf gate).

The indexer (transformers' DeepseekV4Indexer): a compressor of its own at index_head_dim gives
index keys k_w (same blocks, overlap and rotation); queries q_b_proj(query latent) per
indexer head, rotated at the query's position; weights weights_proj(x) / sqrt(index_n_heads):

    score[t, w] = sum_h weight[t, h] * relu(q[t, h] . k_w) / sqrt(index_head_dim)

over the rows t sees; each query keeps its top `index_topk` (all of them when it sees fewer).

Training rule of the indexer: DSA's (dsa.py, Megatron's compute_dsa_indexer_loss), with the
same args (index_*, mode, sparse_loss, indexer_loss_coeff) and the same functions
(index_scores, kl_from_target). It reads detached inputs; its loss is the KL divergence from
the main attention's distribution to softmax(score), averaged over queries, times
`indexer_loss_coeff`, added to the auxiliary loss; "dense" mode attends to every visible row.
What differs from DSA: the candidates are compressed rows, not tokens, so the target is the
heads' softmax over the visible (or, with `sparse_loss`, the picked) rows alone, summed over
heads and normalised; the window keys and the sink, which every query keeps whatever the
indexer says, are not in it; and queries that see no row yet (the first ratio - 1 of each
document) have no target and count 0 in the mean over queries (as many queries on every rank of
a layout: the ranks' means average to the whole batch's).

Parameters carry transformers' names (compressor.kv_proj, .gate_proj, .position_bias,
.kv_norm, compressor.indexer.kv_proj, .gate_proj, .position_bias, .kv_norm, .q_b_proj,
.scorer.weights_proj), so its CSA layer's state dict loads as it is
(tests/unit/test_deepseek_v4_csa.py). Legend as deepseek_v4.py; C rows, P tokens of a block,
I indexer heads, K index_head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from titan_hybrid.model.common import TensorParallelHeadSum, init_linear, upcast
from titan_hybrid.model.deepseek_v4 import SlidingWindowAttention, rotate_trailing
from titan_hybrid.model.deepseek_v4_hca import (
    CompressedRows,
    DeepseekV4CompressedAttentionArgs,
    block_last_order,
    block_tokens,
    compression_blocks,
    rotate_rows,
    validate_compressed,
)
from titan_hybrid.model.dsa import (
    MODES,
    index_scores,
    indexer_loss_log,
    kl_from_target,
    query_blocks,
    record_indexer_loss,
    trains_indexer,
)
from titan_hybrid.model.layer_kind import (
    CONTEXT,
    DATA,
    PIPELINE,
    ContextParallelRule,
    KindStatistics,
    LayerKind,
)
from titan_hybrid.model.layout import TokenLayout
from titan_hybrid.model.norms import RMSNorm


@dataclass
class DeepseekV4SparseAttentionArgs(DeepseekV4CompressedAttentionArgs):
    compress_ratio: int = 4
    index_n_heads: int = 64
    index_head_dim: int = 128  # its trailing rope_head_dim channels are rotary
    index_topk: int = 512  # compressed rows each query keeps
    mode: str = "sparse"  # "dense": attention over every visible row (indexer warm-up)
    sparse_loss: bool = False  # the indexer's KL over the picked rows only
    indexer_loss_coeff: float = 0.0  # 0: the indexer is not trained

    @property
    def compressor_halo(self) -> int:
        """A row also reads the block before its own: 2 * ratio - 1 tokens before a piece."""
        return 2 * self.compress_ratio - 1


class Blocks(NamedTuple):
    """A row's compression blocks ([B, C] each): first token index, complete, and whether the
    block before it (the row before, C - 1) belongs to the same document."""
    first: torch.Tensor
    complete: torch.Tensor
    has_previous: torch.Tensor
    tiled: bool  # one document from the row's start: blocks tile the row


def overlapping_blocks(layout: TokenLayout, batch: int, seq_len: int, ratio: int,
                       device: torch.device) -> Blocks:
    first, complete = compression_blocks(layout, seq_len, ratio, device)
    first, complete = first.expand(batch, -1), complete.expand(batch, -1)
    # Blocks tile each document and the complete ones come in row order, so a block that does
    # not start its document follows the block before it.
    if layout.positions is None:
        at = torch.arange(first.shape[1], device=device).expand(batch, -1)
        return Blocks(first, complete, complete & (at > 0), tiled=True)
    position = layout.positions.long().expand(batch, -1).gather(1, first)
    return Blocks(first, complete, complete & (position >= ratio), tiled=False)


def overlapping_pool(kv_BTE: torch.Tensor, gate_BTE: torch.Tensor, position_bias_PE: torch.Tensor,
                     blocks: Blocks) -> torch.Tensor:
    """[B, C, E / 2]: each row's softmax-gated sum over [Ca of the block before | Cb of its
    own block] (module docstring), before the norm."""
    ratio, width = position_bias_PE.shape[0], kv_BTE.shape[-1] // 2
    kv_BCPE = block_tokens(kv_BTE, blocks.first, ratio, blocks.tiled)
    # Gates in fp32, as transformers' softmax.
    gate_BCPE = upcast(block_tokens(gate_BTE, blocks.first, ratio, blocks.tiled)) + upcast(
        position_bias_PE)
    # The block before is the row before: shift the rows by one (row 0 gets zeros).
    previous_kv = F.pad(kv_BCPE[..., :width], (0, 0, 0, 0, 1, 0))[:, :-1]
    previous_gate = F.pad(gate_BCPE[..., :width], (0, 0, 0, 0, 1, 0))[:, :-1].masked_fill(
        ~blocks.has_previous[..., None, None], float("-inf"))
    kv_slots = torch.cat((previous_kv, kv_BCPE[..., width:]), dim=2)
    weights = torch.softmax(torch.cat((previous_gate, gate_BCPE[..., width:]), dim=2), dim=2)
    return (kv_slots * weights.type_as(kv_slots)).sum(2)


class OverlappingCompressor(nn.Module):
    """kv_proj / gate_proj to 2 * width, position_bias, kv_norm: one rotated row per block."""

    def __init__(self, *, dim: int, width: int, args: DeepseekV4SparseAttentionArgs) -> None:
        super().__init__()
        self.args = args
        self.kv_proj = nn.Linear(dim, 2 * width, bias=False)
        self.gate_proj = nn.Linear(dim, 2 * width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(args.compress_ratio, 2 * width))
        self.kv_norm = RMSNorm(width, eps=args.norm_eps)

    def rows(self, x_BTD: torch.Tensor, blocks: Blocks, layout: TokenLayout) -> torch.Tensor:
        pooled = overlapping_pool(self.kv_proj(x_BTD), self.gate_proj(x_BTD), self.position_bias,
                                  blocks)
        return rotate_rows(self.args, self.kv_norm(pooled), blocks.first, layout)

    def init_weights(self, *, init_std: float) -> None:
        init_linear(self.kv_proj, std=init_std)
        init_linear(self.gate_proj, std=init_std)
        nn.init.zeros_(self.position_bias)
        self.kv_norm.init_weights()


class IndexerScorer(nn.Module):
    """Holds the indexer's per-head weight projection (transformers' scorer.weights_proj)."""

    def __init__(self, *, dim: int, args: DeepseekV4SparseAttentionArgs) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(dim, args.index_n_heads, bias=False)


class CSAIndexer(OverlappingCompressor):
    def __init__(self, *, dim: int, args: DeepseekV4SparseAttentionArgs) -> None:
        super().__init__(dim=dim, width=args.index_head_dim, args=args)
        self.q_b_proj = nn.Linear(args.q_lora_rank, args.index_n_heads * args.index_head_dim,
                                  bias=False)
        self.scorer = IndexerScorer(dim=dim, args=args)

    def queries(self, x_BTD: torch.Tensor, query_latent: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(queries [B, T, I, K], head weights [B, T, I]); its keys are its `rows`."""
        args = self.args
        q = self.q_b_proj(query_latent).unflatten(-1, (args.index_n_heads, args.index_head_dim))
        weights = self.scorer.weights_proj(x_BTD) * args.index_n_heads ** -0.5
        return rotate_trailing(q, cos, sin), weights

    def init_weights(self, *, init_std: float) -> None:
        super().init_weights(init_std=init_std)
        init_linear(self.q_b_proj, std=init_std)
        init_linear(self.scorer.weights_proj, std=init_std)


class CSACompressor(OverlappingCompressor):
    def __init__(self, *, dim: int, args: DeepseekV4SparseAttentionArgs) -> None:
        super().__init__(dim=dim, width=args.head_dim, args=args)
        self.indexer = CSAIndexer(dim=dim, args=args)

    def forward(self, x_BTD: torch.Tensor, layout: TokenLayout) -> CompressedRows:
        """The rows and, from the detached input (the indexer learns from its own loss
        only), the indexer's keys of the same blocks."""
        args = self.args
        batch, seq_len, _ = x_BTD.shape
        blocks = overlapping_blocks(layout, batch, seq_len, args.compress_ratio, x_BTD.device)
        return CompressedRows(
            self.rows(x_BTD, blocks, layout), self.indexer.rows(x_BTD.detach(), blocks, layout),
            block_last_order(layout, seq_len, blocks.first, args.compress_ratio),
            blocks.complete)

    def init_weights(self, *, init_std: float) -> None:
        super().init_weights(init_std=init_std)
        self.indexer.init_weights(init_std=init_std)


def compressed_attention_target(q_BTHD: torch.Tensor, rows_BCD: torch.Tensor,
                                support_BTC: torch.Tensor, scale: float) -> torch.Tensor:
    """[B, T, C] fp32: the sum over (this rank's) heads of each head's softmax over the rows in
    `support` (0 for a query with none), in blocks of query rows (dsa.query_blocks)."""
    q, rows = upcast(q_BTHD), upcast(rows_BCD)
    batch, seq_len, heads, _ = q.shape
    sums = []
    for start, end in query_blocks(seq_len, batch * heads * rows.shape[1], causal=False):
        logits = torch.einsum("bthd,bcd->bhtc", q[:, start:end], rows) * scale
        logits = logits.masked_fill(~support_BTC[:, None, start:end], float("-inf"))
        sums.append(torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(1))
    return torch.cat(sums, dim=1)


class CompressedSparseAttention(SlidingWindowAttention):
    def __init__(self, *, dim: int, args: DeepseekV4SparseAttentionArgs) -> None:
        super().__init__(dim=dim, args=args)
        self.compressor = CSACompressor(dim=dim, args=args)
        self.head_sum = TensorParallelHeadSum()
        # The indexer's KL (before its coefficient) summed over the forwards that computed
        # it, and their count, since the metrics last read them (KIND.statistics).
        self.register_buffer("indexer_loss_sum", torch.zeros(2), persistent=False)

    # tensor_parallel_layouts: the window layer's; the compressor and its indexer serve every
    # head, so they are replicated (partial gradients, as the latent key / value head).

    def forward(self, x_BTD: torch.Tensor, layout: TokenLayout
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (output, the indexer's loss times its coefficient)."""
        args = self.args
        batch, seq_len, _ = x_BTD.shape
        query_latent, q_BTHD, kv_BTD, cos, sin = self.project(x_BTD, layout)
        no_loss = x_BTD.new_zeros((), dtype=torch.float32)
        if seq_len < args.compress_ratio:  # not one block: the window layer's attention
            return self.attend(q_BTHD, kv_BTD, cos, sin, layout), no_loss
        rows = self.compressor(x_BTD, layout)
        visible_BTC = rows.visible_to(layout, seq_len)
        # Detached: the indexer learns from its own loss only (module docstring).
        index_q, index_weights = self.compressor.indexer.queries(
            x_BTD.detach(), query_latent.detach(), cos, sin)
        used_BTC, kl = self.select_rows(q_BTHD, rows.kv, visible_BTC, index_q, rows.index_keys,
                                        index_weights)
        out = self.attend(q_BTHD, kv_BTD, cos, sin, layout, rows.kv, used_BTC)
        record_indexer_loss(self.indexer_loss_sum, kl, args)
        return out, kl * args.indexer_loss_coeff

    def select_rows(self, q_BTHD, rows_BCD, visible_BTC, index_q_BTIK, index_k_BCK,
                    index_weights_BTI) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows each query attends to [B, T, C], the indexer's KL before its coefficient)."""
        args = self.args
        train_indexer = trains_indexer(args)
        no_loss = q_BTHD.new_zeros((), dtype=torch.float32)
        keep_all = args.mode == "dense" or rows_BCD.shape[1] <= args.index_topk
        if keep_all and not train_indexer:
            return visible_BTC, no_loss
        with torch.set_grad_enabled(train_indexer):
            scores = index_scores(index_q_BTIK, index_k_BCK, index_weights_BTI, visible_BTC)
        used = visible_BTC
        if not keep_all:
            picked = scores.detach().topk(args.index_topk, dim=-1, sorted=False).indices
            # A query that sees fewer rows than k picks some -inf ones: the mask drops them.
            used = torch.zeros_like(visible_BTC).scatter_(-1, picked, True) & visible_BTC
        if not train_indexer:
            return used, no_loss
        support = used if args.sparse_loss else visible_BTC
        with torch.no_grad():
            target = self.head_sum(compressed_attention_target(
                q_BTHD.detach(), rows_BCD.detach(), support, args.head_dim ** -0.5))
            total = target.sum(-1, keepdim=True)
            target = torch.where(total > 0, target / total, 0.0)
        return used, kl_from_target(target, scores, support)

    def reset_indexer_statistics(self) -> None:
        self.indexer_loss_sum.zero_()

    def init_weights(self, *, init_std: float, out_std: float) -> None:
        super().init_weights(init_std=init_std, out_std=out_std)
        self.compressor.init_weights(init_std=init_std)
        self.reset_indexer_statistics()


def _validate(args: DeepseekV4SparseAttentionArgs, dim: int) -> None:
    validate_compressed(args, "compressed_sparse_attention")
    if args.index_head_dim < args.rope_head_dim:
        raise ValueError(f"compressed_sparse_attention: index_head_dim={args.index_head_dim} "
                         f"must be at least rope_head_dim={args.rope_head_dim} (its trailing "
                         "channels are rotary)")
    for field in ("index_n_heads", "index_topk"):
        if getattr(args, field) < 1:
            raise ValueError(f"compressed_sparse_attention: {field}={getattr(args, field)} "
                             "must be at least 1")
    if args.mode not in MODES:
        raise ValueError(f"compressed_sparse_attention: mode={args.mode!r} must be one of "
                         f"{MODES}")
    if args.indexer_loss_coeff < 0:
        raise ValueError("compressed_sparse_attention: indexer_loss_coeff="
                         f"{args.indexer_loss_coeff} must be >= 0")


def _core_flops(args: DeepseekV4SparseAttentionArgs, dim: int, seq_len: int) -> int:
    """Forward, per token (counted unmasked, as dense attention counts the whole sequence):
    QK^T and PV over the window and the picked rows, 4 * (min(window, T) + k) * head_dim per
    head, k = min(index_topk, T // ratio) (T // ratio in dense mode); the indexer's scores
    over every row, 2 * (T // ratio) * index_n_heads * index_head_dim; the two compressors'
    weighted sums over 2 * ratio slots, 4 * (head_dim + index_head_dim) (their projections
    are parameters: 6 * parameters counts them)."""
    n_rows = seq_len // args.compress_ratio
    picked = n_rows if args.mode == "dense" else min(args.index_topk, n_rows)
    keys = min(args.sliding_window, seq_len) + picked
    return (4 * keys * args.head_dim * args.n_heads
            + 2 * n_rows * args.index_n_heads * args.index_head_dim
            + 4 * (args.head_dim + args.index_head_dim))


KIND = LayerKind(
    symbol="C", args_type=DeepseekV4SparseAttentionArgs,
    build=lambda args, dim, norm_eps: CompressedSparseAttention(dim=dim, args=args),
    mixes_sequence=True, has_aux_loss=True, validate=_validate, core_flops=_core_flops,
    tensor_parallel_sizes=lambda args, dim: [
        ("compressed_sparse_attention.n_heads", args.n_heads),
        ("compressed_sparse_attention.o_groups", args.o_groups)],
    # Context parallelism: the window's key halo, and the rows and indexer keys of every piece
    # gathered, so the top-k sees the whole causal context (context_parallel_compressed.py).
    context_parallel=ContextParallelRule(core="window_core", window_halo=True,
                                         compressor="compressor"),
    high_precision_modules=("compressor",),  # its indexer included
    # transformers' layer type; the parameter names are its own (hf/deepseek_v4.py)
    # Summed over every rank that may hold other tokens or other layers.
    statistics=KindStatistics(counters=("indexer_loss_sum",),
                              summed_over=(DATA, CONTEXT, PIPELINE), per_layer=False,
                              log=indexer_loss_log("csa/indexer_loss")),
)

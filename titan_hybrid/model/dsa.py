"""DeepSeek sparse attention (DSA, DeepSeek-V3.2): pattern symbol `D`.

Multi-latent attention (model/mla.py) whose queries each attend only to the `index_topk` keys a
lightning indexer ranks highest. The indexer has its own small projections (transformers'
DeepseekV32Indexer names): per indexer head h a query wq_b(q latent), one key
k_norm(wk(x)) shared by the heads, both with non-interleaved RoPE on their first
qk_rope_head_dim channels, and a per-head weight weights_proj(x) / sqrt(index_n_heads):

    score[t, s] = sum_h  w[t, h] * relu(q[t, h] . k[s] / sqrt(index_head_dim))

over the causal, in-document keys s; the top-k of each row are the keys attention may use. With
fewer keys than index_topk a query uses all of them: DSA then equals MLA exactly. The Hadamard
rotation of DeepSeek's reference indexer is left out (orthogonal: it changes rounding only).

Training rule of the indexer (DeepSeek-V3.2-Exp section 2.1, Megatron's
compute_dsa_indexer_loss): the indexer reads detached inputs, so the language-model loss never
reaches it and its own loss reaches nothing else. Its loss is the KL divergence from the main
attention's distribution (softmax probabilities of detached queries and keys, summed over all
heads, then normalised per query) to softmax(score), averaged over queries and scaled by
`indexer_loss_coeff`, added to the model's auxiliary loss. `mode = "dense"` is the warm-up stage:
attention over all causal keys, the KL over all of them; `mode = "sparse"` attends to the top-k,
with the KL over all causal keys (Megatron's default) or, with `sparse_loss`, over the top-k on
both sides (the paper's sparse stage). Coefficient 0 (the default, as Megatron's None) leaves
the indexer untrained. Freezing the main model during warm-up is left to the optimizer setup.

Cost: the indexer's scores and its target take all heads in batched matmuls, over blocks of
query rows that bound the intermediate (BLOCK_ELEMENTS); on plain causal rows each block (the
sparse attention's too) stops at the keys up to its last row (CAUSAL_BLOCKS), so no call
scores the whole key square. Dense mode, or no more keys than index_topk, is MLA's attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_hybrid.model.common import TensorParallelHeadSum, init_linear, upcast
from titan_hybrid.model.layer_kind import (
    CONTEXT,
    DATA,
    PIPELINE,
    ContextParallelRule,
    KindStatistics,
    LayerKind,
)
from titan_hybrid.model.layout import TokenLayout, causal_document_mask
from titan_hybrid.model.mla import (
    MLAArgs,
    MultiLatentAttention,
    attend,
    expand_latents,
    mla_core_flops,
    rotary_cos_sin,
    softmax_scale,
    tensor_parallel_sizes,
    validate_mla,
)
from titan_hybrid.model.rotary import apply_rotary_pairs

INDEX_NORM_EPS = 1e-6  # DeepSeek's LayerNorm epsilon for the indexer key
MODES = ("sparse", "dense")
# The indexer's scores hold a [B, rows, index_n_heads, S] fp32 intermediate, its training
# target a [B, n_heads, rows, S] one (and the softmax's output beside it): query rows go in
# blocks whose intermediate stays within this many elements, 2**28 (1 GiB in fp32). At
# dsa_hybrid_1b's sizes (32 indexer heads, 16 heads, seq 4096, batch 2: 2**30 and 2**29) that
# is 4 and 2 blocks (4 each on plain causal rows, below), each one batched matmul of up to
# 2**28 outputs, where a per-head loop took 32 and 16 steps that each re-read a [B, T, S]
# block; far longer sequences get more, smaller blocks (down to one row) instead of running
# out of memory. A training indexer's autograd still keeps each block's ReLU output (at most
# [B, T, I, S] in all, as the per-head loop did).
BLOCK_ELEMENTS = 2**28
# Plain causal rows (the keys are the query rows themselves, in order) go in at least this
# many blocks, each over the keys up to its last row: n blocks do (n + 1) / 2n of the full
# square's work, 62.5% for 4, against MLA's causal kernel's 50% and a dense mask's 100%.
CAUSAL_BLOCKS = 4


@dataclass
class DSAArgs(MLAArgs):
    index_n_heads: int = 4
    index_head_dim: int = 32
    index_topk: int = 16
    mode: str = "sparse"  # "dense": attention over all keys (the indexer's warm-up stage)
    sparse_loss: bool = False  # the indexer's KL over the top-k keys only
    indexer_loss_coeff: float = 0.0  # 0: the indexer is not trained


class LightningIndexer(nn.Module):
    def __init__(self, *, dim: int, args: DSAArgs) -> None:
        super().__init__()
        self.args = args
        self.wq_b = nn.Linear(args.q_lora_rank, args.index_n_heads * args.index_head_dim, bias=False)
        self.wk = nn.Linear(dim, args.index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(args.index_head_dim, eps=INDEX_NORM_EPS)
        self.weights_proj = nn.Linear(dim, args.index_n_heads, bias=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rope, rest = x.split([self.args.qk_rope_head_dim, x.shape[-1] - self.args.qk_rope_head_dim], -1)
        return torch.cat((apply_rotary_pairs(rope, cos, sin, interleaved=False), rest), dim=-1)

    def forward(self, x_BTD: torch.Tensor, query_latent: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(queries [B, T, I, K], keys [B, T, K], head weights [B, T, I]) of the indexer."""
        batch, seq_len, _ = x_BTD.shape
        q = self.wq_b(query_latent).view(batch, seq_len, -1, self.args.index_head_dim)
        k = self.k_norm(self.wk(x_BTD))
        weights = self.weights_proj(x_BTD) * self.args.index_n_heads ** -0.5
        return self._rotate(q, cos, sin), self._rotate(k[:, :, None], cos, sin)[:, :, 0], weights

    def init_weights(self, *, init_std: float) -> None:
        for linear in (self.wq_b, self.wk, self.weights_proj):
            init_linear(linear, std=init_std)
        self.k_norm.reset_parameters()


def query_blocks(n_rows: int, elements_per_row: int, causal: bool) -> list[tuple[int, int]]:
    """[start, end) blocks of query rows, of near-equal size: as few as keep each block's
    intermediate (`elements_per_row` per row) within BLOCK_ELEMENTS, at least one row each,
    and at least CAUSAL_BLOCKS of them for `causal` rows (a block then needs only the keys up
    to its last row)."""
    rows_per_block = max(1, BLOCK_ELEMENTS // max(1, elements_per_row))
    count = -(-n_rows // rows_per_block)
    if causal:
        count = min(max(count, CAUSAL_BLOCKS), n_rows)
    size = -(-n_rows // count)
    return [(start, min(start + size, n_rows)) for start in range(0, n_rows, size)]


def _join_rows(blocks: list[torch.Tensor], n_keys: int, fill: float) -> torch.Tensor:
    """The [B, rows, keys <= n_keys] blocks as one [B, T, n_keys], `fill` in the keys a
    (causal) block left out."""
    padded = [F.pad(b, (0, n_keys - b.shape[-1]), value=fill) if b.shape[-1] < n_keys else b
              for b in blocks]
    return padded[0] if len(padded) == 1 else torch.cat(padded, dim=1)


def index_scores(q_BTIK: torch.Tensor, k_BSK: torch.Tensor, weights_BTI: torch.Tensor,
                 allowed_BTS: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """[B, T, S] fp32 indexer scores, -inf where the key is not causal / in-document.

    All indexer heads at once, per block of query rows (query_blocks; one block at typical
    sizes): one batched matmul gives the [B, rows * I, S] logits (scaled in its epilogue, so
    each logit rounds as bmm-then-scale), ReLU in place, and a second batched matmul sums
    the heads weighted by w. `causal`: the keys are the query rows themselves, in order
    (plain causal rows), so a block scores only the keys up to its last row."""
    q, k_BKS, w = upcast(q_BTIK), upcast(k_BSK).transpose(1, 2), upcast(weights_BTI)
    (batch, seq_len, heads, head_dim), n_keys = q.shape, k_BKS.shape[-1]
    no_offset = q.new_zeros(())
    blocks = []
    for start, end in query_blocks(seq_len, batch * heads * n_keys, causal):
        rows, keys = end - start, (end if causal else n_keys)
        logits = torch.baddbmm(no_offset, q[:, start:end].reshape(batch, rows * heads, head_dim),
                               k_BKS[..., :keys], beta=0, alpha=head_dim ** -0.5)
        relu = torch.relu_(logits).view(batch * rows, heads, keys)
        weighted = torch.bmm(w[:, start:end].reshape(batch * rows, 1, heads), relu)
        blocks.append(torch.where(allowed_BTS[:, start:end, :keys],
                                  weighted.view(batch, rows, keys), float("-inf")))
    return _join_rows(blocks, n_keys, float("-inf"))


def top_keys(scores_BTS: torch.Tensor, k: int, key: TokenLayout) -> torch.Tensor:
    """[B, T, k] indices of each row's k best keys, in no particular order (unsorted: the
    set is what counts, and it is the sorted call's set). Equal scores (ReLU makes exact
    zeros common) are ranked as in row order, whatever order the keys come in
    (context-parallel shards gather them rank by rank), so every layout picks the same keys."""
    if key.positions is None:
        return scores_BTS.topk(k, dim=-1, sorted=False).indices
    in_row_order = key.row_order(scores_BTS.shape[-1], scores_BTS.device).argsort(dim=-1)[:, None]
    in_row_order = in_row_order.expand(scores_BTS.shape[0], scores_BTS.shape[1], -1)
    best = torch.take_along_dim(scores_BTS, in_row_order, dim=-1).topk(k, dim=-1, sorted=False)
    return torch.take_along_dim(in_row_order, best.indices, dim=-1)


def attention_probability_sum(q_BTHK: torch.Tensor, k_BSHK: torch.Tensor,
                              support_BTS: torch.Tensor, scale: float,
                              causal: bool = False) -> torch.Tensor:
    """[B, T, S] fp32 sum over (this rank's) heads of the softmax attention probabilities over
    the keys in `support`: all heads in one batched matmul per block of query rows
    (query_blocks), the fp32 softmax of the [B, H, rows, S] logits, summed over heads.
    `causal` as index_scores (the left-out keys get probability 0)."""
    q_BHTK = upcast(q_BTHK).transpose(1, 2).contiguous()
    k_BHSK = upcast(k_BSHK).transpose(1, 2).contiguous()
    (batch, heads, seq_len, _), n_keys = q_BHTK.shape, k_BHSK.shape[2]
    q, k = q_BHTK.flatten(0, 1), k_BHSK.flatten(0, 1)  # [B * H, T or S, K]
    no_offset = q.new_zeros(())
    blocks = []
    for start, end in query_blocks(seq_len, batch * heads * n_keys, causal):
        rows, keys = end - start, (end if causal else n_keys)
        logits = torch.baddbmm(no_offset, q[:, start:end], k[:, :keys].transpose(1, 2),
                               beta=0, alpha=scale).view(batch, heads, rows, keys)
        logits.masked_fill_(~support_BTS[:, None, start:end, :keys], float("-inf"))
        blocks.append(torch.softmax(logits, dim=-1).sum(1))
    return _join_rows(blocks, n_keys, 0.0)


def attend_selected(q_BTHK: torch.Tensor, k_BSHK: torch.Tensor, v_BSHV: torch.Tensor,
                    used_BTS: torch.Tensor, scale: float, causal: bool,
                    all_keys_rows: int) -> torch.Tensor:
    """attend() over the keys in `used`. `causal` rows (index_scores) run in query_blocks,
    each over the keys up to its last row only (the later ones are never used): the kernel
    then skips most of the masked upper triangle, as MLA's causal call does, instead of
    scoring every key; a first block whose rows keep all their causal keys (rows below
    `all_keys_rows`) is MLA's plain causal call."""
    if not causal:
        return attend(q_BTHK, k_BSHK, v_BSHV, used_BTS[:, None], scale)
    batch, seq_len, heads, _ = q_BTHK.shape
    outs = []
    for start, end in query_blocks(seq_len, batch * heads * seq_len, causal=True):
        plain = start == 0 and end <= all_keys_rows  # is_causal: top-left aligned
        mask = None if plain else used_BTS[:, None, start:end, :end]
        outs.append(attend(q_BTHK[:, start:end], k_BSHK[:, :end], v_BSHV[:, :end], mask, scale))
    return torch.cat(outs, dim=1)


def kl_from_target(target_BTS: torch.Tensor, scores_BTS: torch.Tensor,
                   support_BTS: torch.Tensor) -> torch.Tensor:
    """Mean over queries of KL(target || softmax(scores)) over the keys in `support`; a query
    with none (a DeepSeek-V4 `C` query that sees no compressed row yet) counts 0, so that
    every layout's ranks, each holding as many queries, average alike."""
    outside = ~support_BTS
    log_q = torch.log_softmax(scores_BTS.masked_fill(outside, float("-inf")), dim=-1)
    log_q = log_q.masked_fill(outside, 0.0)  # target is 0 there: no 0 * -inf
    kl = torch.xlogy(target_BTS, target_BTS) - target_BTS * log_q
    return kl.sum(-1).mean()


def trains_indexer(args: DSAArgs) -> bool:
    """The indexer learns (and its loss is computed) in training forwards with coeff > 0."""
    return args.indexer_loss_coeff > 0 and torch.is_grad_enabled()


def record_indexer_loss(counter: torch.Tensor, kl: torch.Tensor, args: DSAArgs) -> None:
    """Add (KL, 1) to a layer's `indexer_loss_sum` counter (KindStatistics) in a forward that
    computed the KL. Which forwards count in the log (not validation's) is
    titan_hybrid.training.kind_statistics' rule, the same for every kind."""
    if trains_indexer(args):
        with torch.no_grad():
            value = kl.detach().to(counter.dtype)
            counter += torch.stack((value, torch.ones_like(value)))


class SparseLatentAttentionCore(nn.Module):
    """Top-k selection, attention over the selected keys, and the indexer's KL divergence
    (before its coefficient; 0 when the indexer does not train)."""

    def __init__(self, args: DSAArgs) -> None:
        super().__init__()
        self.args = args
        self.head_sum = TensorParallelHeadSum()

    def forward(self, q_BTHK: torch.Tensor, latent_BSC: torch.Tensor, k_rope_BSR: torch.Tensor,
                kv_up_weight: torch.Tensor, index_q_BTIK: torch.Tensor, index_k_BSK: torch.Tensor,
                index_weights_BTI: torch.Tensor, query: TokenLayout,
                key: TokenLayout) -> tuple[torch.Tensor, torch.Tensor]:
        args, scale = self.args, softmax_scale(self.args)
        k, v = expand_latents(latent_BSC, k_rope_BSR, kv_up_weight, args)
        causal = query is key and query.is_plain_causal()  # as MLA's core
        allowed = causal_document_mask(query, key, q_BTHK.shape[1], k.shape[1], k.device)
        allowed = allowed[:, 0].expand(q_BTHK.shape[0], -1, -1)
        train_indexer = trains_indexer(args)
        no_loss = q_BTHK.new_zeros((), dtype=torch.float32)
        # Dense, or no more keys than the top-k: every causal key is used, so this is MLA's
        # attention call (a plain causal one where MLA's is), and the scores serve the KL only.
        keep_all = args.mode == "dense" or k.shape[1] <= args.index_topk
        if keep_all:
            out, used = attend(q_BTHK, k, v, None if causal else allowed[:, None], scale), allowed
            if not train_indexer:
                return out, no_loss
        with torch.set_grad_enabled(train_indexer):
            scores = index_scores(index_q_BTIK, index_k_BSK, index_weights_BTI, allowed, causal)
        if not keep_all:
            picked = top_keys(scores.detach(), args.index_topk, key)
            # A row with fewer valid keys than k picks some -inf ones: the mask drops them.
            used = torch.zeros_like(allowed).scatter_(-1, picked, True).logical_and_(allowed)
            out = attend_selected(q_BTHK, k, v, used, scale, causal, args.index_topk)
            if not train_indexer:
                return out, no_loss
        support = used if args.sparse_loss else allowed
        with torch.no_grad():
            target = attention_probability_sum(q_BTHK, k, support, scale, causal)
            target = self.head_sum(target)
            target = target / target.sum(-1, keepdim=True)
        return out, kl_from_target(target, scores, support)


class DeepSeekSparseAttention(MultiLatentAttention):
    core_type = SparseLatentAttentionCore

    def __init__(self, *, dim: int, args: DSAArgs) -> None:
        super().__init__(dim=dim, args=args)
        self.indexer = LightningIndexer(dim=dim, args=args)
        # The indexer's KL (before its coefficient) summed over the forwards that computed
        # it, and their count, since the metrics last read them (KIND.statistics).
        self.register_buffer("indexer_loss_sum", torch.zeros(2), persistent=False)

    def forward(self, x_BTD: torch.Tensor, layout: TokenLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (output, the indexer's loss times its coefficient)."""
        query_latent = self.query_latent(x_BTD)
        cos, sin = rotary_cos_sin(self.args, layout, x_BTD.shape[1], x_BTD)
        q, latent, k_rope = self.project(x_BTD, query_latent, cos, sin)
        # Detached: the indexer learns from its own loss only (module docstring).
        index_q, index_k, weights = self.indexer(x_BTD.detach(), query_latent.detach(), cos, sin)
        out, kl = self.core(q, latent, k_rope, self.kv_b_proj.weight, index_q, index_k, weights,
                            layout, layout)
        record_indexer_loss(self.indexer_loss_sum, kl, self.args)
        return self.output(out, x_BTD), kl * self.args.indexer_loss_coeff

    def reset_indexer_statistics(self) -> None:
        self.indexer_loss_sum.zero_()

    def init_weights(self, *, init_std: float, out_std: float) -> None:
        super().init_weights(init_std=init_std, out_std=out_std)
        self.indexer.init_weights(init_std=init_std)
        self.reset_indexer_statistics()


def _validate(args: DSAArgs, dim: int) -> None:
    validate_mla(args, dim, "dsa")
    if not args.rotary:
        raise ValueError("dsa: rotary=False is not supported: DeepSeek-V3.2's indexer rotates "
                         "its keys (an unrotated DSA, GLM-5.3-Flash's, is not built yet)")
    if args.q_lora_rank is None:
        raise ValueError("dsa: q_lora_rank=None is not supported: the indexer's queries read the "
                         "low-rank query latent (as DeepSeek-V3.2's)")
    if args.index_head_dim < args.qk_rope_head_dim:
        raise ValueError(f"dsa: index_head_dim={args.index_head_dim} must be at least "
                         f"qk_rope_head_dim={args.qk_rope_head_dim} (its first channels are rotary)")
    for field in ("index_n_heads", "index_topk"):
        if getattr(args, field) < 1:
            raise ValueError(f"dsa: {field}={getattr(args, field)} must be at least 1")
    if args.mode not in MODES:
        raise ValueError(f"dsa: mode={args.mode!r} must be one of {MODES}")
    if args.indexer_loss_coeff < 0:
        raise ValueError(f"dsa: indexer_loss_coeff={args.indexer_loss_coeff} must be >= 0")


def _core_flops(args: DSAArgs, dim: int, seq_len: int) -> int:
    """Megatron's count: attention over min(seq_len / 2, index_topk) keys per query on
    average (the top-k, or the causal half when shorter), plus the indexer's causal scores:
    min(T, 2K) * n_heads * (dn + dr + dv) + T * index_n_heads * index_head_dim per token."""
    keys = seq_len if args.mode == "dense" else min(seq_len, 2 * args.index_topk)
    return mla_core_flops(args, keys) // 2 + seq_len * args.index_n_heads * args.index_head_dim


def indexer_loss_log(metric: str):
    """The log of an indexer's KL before its coefficient under the name `metric`, averaged over
    layers and microbatches (as Megatron logs it), from the counters summed over layers and
    ranks."""
    def log(sums: dict[str, torch.Tensor]) -> dict[str, float]:
        loss_sum, count = sums["indexer_loss_sum"].tolist()
        return {metric: loss_sum / count} if count else {}
    return log


KIND = LayerKind(
    symbol="D", args_type=DSAArgs,
    build=lambda args, dim, norm_eps: DeepSeekSparseAttention(dim=dim, args=args),
    mixes_sequence=True, has_aux_loss=True, validate=_validate,
    core_flops=_core_flops, tensor_parallel_sizes=tensor_parallel_sizes("dsa"),
    high_precision_modules=("indexer",),
    # The indexer's top-k must see every causal key: its keys are gathered with the latents.
    context_parallel=ContextParallelRule(core="core", gather=("latent_BSC", "k_rope_BSR",
                                                              "index_k_BSK")),
    # Summed over every rank that may hold other tokens or other layers.
    statistics=KindStatistics(counters=("indexer_loss_sum",),
                              summed_over=(DATA, CONTEXT, PIPELINE), per_layer=False,
                              log=indexer_loss_log("dsa/indexer_loss")),
)

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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_hybrid.model.attention import apply_rotary_pairs, causal_document_mask
from titan_hybrid.model.common import TensorParallelHeadSum, init_linear, upcast
from titan_hybrid.model.layer_kind import ContextParallelRule, LayerKind
from titan_hybrid.model.layout import TokenLayout
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

INDEX_NORM_EPS = 1e-6  # DeepSeek's LayerNorm epsilon for the indexer key
MODES = ("sparse", "dense")


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


def index_scores(q_BTIK: torch.Tensor, k_BSK: torch.Tensor, weights_BTI: torch.Tensor,
                 allowed_BTS: torch.Tensor) -> torch.Tensor:
    """[B, T, S] fp32 indexer scores, -inf where the key is not causal / in-document.

    One indexer head at a time: without gradients (the indexer untrained) this holds one
    [B, T, S] score block instead of one per head (64 heads in DeepSeek-V3.2)."""
    q, k_BKS, w = upcast(q_BTIK), upcast(k_BSK).transpose(1, 2), upcast(weights_BTI)
    scale = q.shape[-1] ** -0.5
    scores = None
    for head in range(q.shape[2]):
        term = F.relu(torch.bmm(q[:, :, head], k_BKS) * scale) * w[:, :, head, None]
        scores = term if scores is None else scores + term
    return scores.masked_fill(~allowed_BTS, float("-inf"))


def top_keys(scores_BTS: torch.Tensor, k: int, key: TokenLayout) -> torch.Tensor:
    """[B, T, k] indices of each row's k best keys. Equal scores (ReLU makes exact zeros
    common) are ranked as in row order, whatever order the keys come in (context-parallel
    shards gather them rank by rank), so every layout picks the same keys."""
    if key.positions is None:
        return scores_BTS.topk(k, dim=-1).indices
    in_row_order = key.row_order(scores_BTS.shape[-1], scores_BTS.device).argsort(dim=-1)[:, None]
    in_row_order = in_row_order.expand(scores_BTS.shape[0], scores_BTS.shape[1], -1)
    best = torch.take_along_dim(scores_BTS, in_row_order, dim=-1).topk(k, dim=-1).indices
    return torch.take_along_dim(in_row_order, best, dim=-1)


def attention_probability_sum(q_BTHK: torch.Tensor, k_BSHK: torch.Tensor,
                              support_BTS: torch.Tensor, scale: float) -> torch.Tensor:
    """[B, T, S] fp32 sum over (this rank's) heads of the softmax attention probabilities over
    the keys in `support`, one head at a time (one [B, T, S] block, not one per head)."""
    total = None
    for head in range(q_BTHK.shape[2]):
        logits = torch.bmm(upcast(q_BTHK[:, :, head]), upcast(k_BSHK[:, :, head]).transpose(1, 2))
        probs = torch.softmax((logits * scale).masked_fill(~support_BTS, float("-inf")), dim=-1)
        total = probs if total is None else total + probs
    return total


def kl_from_target(target_BTS: torch.Tensor, scores_BTS: torch.Tensor,
                   support_BTS: torch.Tensor) -> torch.Tensor:
    """Mean over queries of KL(target || softmax(scores)) over the keys in `support`."""
    log_q = torch.log_softmax(scores_BTS.masked_fill(~support_BTS, float("-inf")), dim=-1)
    log_q = log_q.masked_fill(~support_BTS, 0.0)  # target is 0 there: no 0 * -inf
    kl = torch.xlogy(target_BTS, target_BTS) - target_BTS * log_q
    return kl.sum(-1).mean()


def trains_indexer(args: DSAArgs) -> bool:
    """The indexer learns (and its loss is computed) in training forwards with coeff > 0."""
    return args.indexer_loss_coeff > 0 and torch.is_grad_enabled()


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
        allowed = causal_document_mask(query, key, q_BTHK.shape[1], k.shape[1], k.device)
        allowed = allowed[:, 0].expand(q_BTHK.shape[0], -1, -1)
        train_indexer = trains_indexer(args)
        if args.mode == "dense" and not train_indexer:  # the scores would go unused
            return attend(q_BTHK, k, v, allowed[:, None], scale), q_BTHK.new_zeros(
                (), dtype=torch.float32)
        with torch.set_grad_enabled(train_indexer):
            scores = index_scores(index_q_BTIK, index_k_BSK, index_weights_BTI, allowed)
        used = allowed
        if args.mode == "sparse":
            picked = top_keys(scores.detach(), min(args.index_topk, k.shape[1]), key)
            # A row with fewer valid keys than k picks some -inf ones: the mask drops them.
            used = torch.zeros_like(allowed).scatter(-1, picked, True) & allowed
        out = attend(q_BTHK, k, v, used[:, None], scale)
        if not train_indexer:
            return out, out.new_zeros((), dtype=torch.float32)
        support = used if args.sparse_loss else allowed
        with torch.no_grad():
            target = self.head_sum(attention_probability_sum(q_BTHK, k, support, scale))
            target = target / target.sum(-1, keepdim=True)
        return out, kl_from_target(target, scores, support)


class DeepSeekSparseAttention(MultiLatentAttention):
    core_type = SparseLatentAttentionCore

    def __init__(self, *, dim: int, args: DSAArgs) -> None:
        super().__init__(dim=dim, args=args)
        self.indexer = LightningIndexer(dim=dim, args=args)
        # The indexer's KL (before its coefficient) summed over the forwards that trained it,
        # and their count, since titan_hybrid.metrics last read them.
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
        if trains_indexer(self.args):
            with torch.no_grad():
                value = kl.detach().to(self.indexer_loss_sum.dtype)
                self.indexer_loss_sum += torch.stack((value, torch.ones_like(value)))
        return self.o_proj(out.flatten(2)), kl * self.args.indexer_loss_coeff

    def reset_indexer_statistics(self) -> None:
        self.indexer_loss_sum.zero_()

    def init_weights(self, *, init_std: float, out_std: float) -> None:
        super().init_weights(init_std=init_std, out_std=out_std)
        self.indexer.init_weights(init_std=init_std)
        self.reset_indexer_statistics()


def _validate(args: DSAArgs, dim: int) -> None:
    validate_mla(args, dim, "dsa")
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


KIND = LayerKind(
    symbol="D", name="dsa", title="DeepSeek sparse attention", args_type=DSAArgs,
    build=lambda args, dim, norm_eps: DeepSeekSparseAttention(dim=dim, args=args),
    mixes_sequence=True, has_aux_loss=True, excludes=("*",), validate=_validate,
    core_flops=_core_flops, tensor_parallel_sizes=tensor_parallel_sizes("dsa"),
    # The indexer's top-k must see every causal key: its keys are gathered with the latents.
    context_parallel=ContextParallelRule(core="core", gather=("latent_BSC", "k_rope_BSR",
                                                              "index_k_BSK")),
)

"""Causal grouped-query self-attention with rotary position embeddings.

Queries see the keys at or before them in their own document (see model/layout.py). The softmax
itself is `CausalAttentionCore`, a module without parameters, so that context parallelism can
hand it the keys and values of the whole sequence (titan_hybrid.parallel.context_parallel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_hybrid.model.common import (
    REPLICATED_ON_LOCAL_SHARDS,
    TPLayout,
    init_linear,
    sharded,
)
from titan_hybrid.model.layer_kind import ContextParallelRule, LayerKind
from titan_hybrid.model.layout import TokenLayout, causal_document_mask
from titan_hybrid.model.norms import AcrossHeadsRMSNorm, RMSNorm
from titan_hybrid.model.rotary import apply_rotary_pairs


@dataclass
class AttentionArgs:
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 64
    rope_theta: float = 10000.0
    use_rope: bool = True  # Nemotron-H's attention layers have no position embedding
    # True: rotate channel pairs (2i, 2i+1) (torchtitan's llama); False: (i, i + R/2), the
    # "rotate half" of transformers' checkpoints (Bamba, Qwen, ...).
    rope_interleave: bool = True
    # The share of each head's channels that rotates, the first ones (transformers'
    # partial_rotary_factor: 0.5 in Bamba); the others pass through unrotated.
    rotary_fraction: float = 1.0
    # Per-head RMS norms of queries and keys before the rotary embedding (Qwen3), scaling by
    # 1 + weight when zero-centred (Qwen3-Next / Qwen3.5).
    qk_norm: bool = False
    qk_norm_zero_centered: bool = False
    # "head": the q / k norms normalise each head (one weight of head_dim for all heads);
    # "projection": all heads' channels together, weight [heads * head_dim] (OLMo Hybrid).
    qk_norm_scope: str = "head"
    # A sigmoid gate on each head's output, computed with the queries: wq's rows are each
    # head's [query | gate] (Qwen3-Next / Qwen3.5's q_proj).
    output_gate: bool = False
    # The softmax's scale of q . k; None: 1 / sqrt(head_dim) (Granite 4.0 sets its own,
    # attention_multiplier).
    softmax_scale: float | None = None
    # Falcon-H1's µP multipliers, kept as scalars: the keys times key_multiplier (before
    # their norm and rotation), the layer's input times input_multiplier and its output times
    # output_multiplier (attention_in_multiplier / attention_out_multiplier).
    key_multiplier: float = 1.0
    input_multiplier: float = 1.0
    output_multiplier: float = 1.0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rotary_fraction)


class CausalAttentionCore(nn.Module):
    def __init__(self, scale: float | None = None) -> None:
        super().__init__()
        self.scale = scale  # None: SDPA's 1 / sqrt(head_dim)

    def forward(self, q_BTHD: torch.Tensor, k_BSHD: torch.Tensor, v_BSHD: torch.Tensor,
                query: TokenLayout, key: TokenLayout) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q_BTHD, k_BSHD, v_BSHD))
        gqa = q.shape[1] != k.shape[1]
        if query is key and query.is_plain_causal():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa,
                                                 scale=self.scale)
        else:
            mask = causal_document_mask(query, key, q.shape[2], k.shape[2], q.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa,
                                                 scale=self.scale)
        return out.transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, *, dim: int, args: AttentionArgs, norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.use_rope, self.rope_interleave = args.use_rope, args.rope_interleave
        self.rotary_dim, self.output_gate = args.rotary_dim, args.output_gate
        self.multipliers = (args.input_multiplier, args.key_multiplier, args.output_multiplier)
        self.wq = nn.Linear(dim, self.n_heads * self.head_dim * (2 if self.output_gate else 1),
                            bias=False)
        self.wk = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, dim, bias=False)
        self.q_norm = self.k_norm = None
        self.qk_norm_across_heads = args.qk_norm_scope == "projection"
        if args.qk_norm and self.qk_norm_across_heads:
            self.q_norm, self.k_norm = (AcrossHeadsRMSNorm(heads * self.head_dim, eps=norm_eps)
                                        for heads in (self.n_heads, self.n_kv_heads))
        elif args.qk_norm:
            self.q_norm, self.k_norm = (
                RMSNorm(self.head_dim, eps=norm_eps, zero_centered=args.qk_norm_zero_centered)
                for _ in range(2))
        self.core = CausalAttentionCore(args.softmax_scale)

    def tensor_parallel_layouts(self) -> dict[str, TPLayout]:
        # Query / key / value projections split by (kv) heads (wq's rows by [query | gate]
        # head), the output projection by rows; the q / k norms, one weight for every head,
        # apply to each rank's own heads.
        layouts = {"wq.weight": sharded(0), "wk.weight": sharded(0), "wv.weight": sharded(0),
                   "wo.weight": sharded(1)}
        if self.q_norm is not None:
            # Across heads, each head's channels have weights of their own: split with them.
            norm_layout = sharded(0) if self.qk_norm_across_heads else REPLICATED_ON_LOCAL_SHARDS
            layouts.update({"q_norm.weight": norm_layout, "k_norm.weight": norm_layout})
        return layouts

    def forward(self, x_BTD: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        batch, seq_len, _ = x_BTD.shape
        input_multiplier, key_multiplier, output_multiplier = self.multipliers
        if input_multiplier != 1.0:
            x_BTD = x_BTD * input_multiplier
        # -1 instead of the head count: under tensor parallelism each rank holds fewer heads.
        q = self.wq(x_BTD).view(batch, seq_len, -1, self.head_dim * (1 + self.output_gate))
        if self.output_gate:
            q, gate = q.chunk(2, dim=-1)
        k = self.wk(x_BTD).view(batch, seq_len, -1, self.head_dim)
        if key_multiplier != 1.0:
            k = k * key_multiplier
        v = self.wv(x_BTD).view(batch, seq_len, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            q, k = (self._rotate(t, layout.rope(seq_len)) for t in (q, k))
        out = self.core(q, k, v, layout, layout)
        if self.output_gate:
            out = out * torch.sigmoid(gate)
        out = self.wo(out.reshape(batch, seq_len, -1))
        return out if output_multiplier == 1.0 else out * output_multiplier

    def _rotate(self, x_BTHD: torch.Tensor, table_BTR2: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of the first `rotary_dim` channels of each head (the table's)."""
        rotary = x_BTHD[..., :self.rotary_dim]
        rotated = apply_rotary_pairs(rotary, table_BTR2[..., 0], table_BTR2[..., 1],
                                     interleaved=self.rope_interleave)
        if self.rotary_dim == self.head_dim:
            return rotated
        return torch.cat((rotated, x_BTHD[..., self.rotary_dim:]), dim=-1)

    def init_weights(self, *, init_std: float, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            init_linear(linear, std=init_std)
        init_linear(self.wo, std=out_std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.init_weights()


def _validate(args: AttentionArgs, dim: int) -> None:
    if args.use_rope and (args.rotary_dim % 2 or not 0 < args.rotary_fraction <= 1):
        raise ValueError(f"attention: head_dim={args.head_dim} x rotary_fraction="
                         f"{args.rotary_fraction} = {args.rotary_dim} rotated channels must be "
                         "even and at most head_dim (rotary embeddings rotate channel pairs)")
    if args.n_heads % args.n_kv_heads:
        raise ValueError(f"attention: n_heads={args.n_heads} is not divisible by "
                         f"n_kv_heads={args.n_kv_heads}")
    if args.qk_norm_scope not in ("head", "projection") or (
            args.qk_norm_scope == "projection" and args.qk_norm_zero_centered):
        raise ValueError(f"attention: qk_norm_scope '{args.qk_norm_scope}' must be 'head' or "
                         "'projection' (the latter without qk_norm_zero_centered)")


def _core_flops(args: AttentionArgs, dim: int, seq_len: int) -> int:
    """QK^T and PV over the full (unmasked) sequence, 2 * 2 * T * head_dim per head forward,
    as torchtitan and Megatron count it."""
    return 4 * seq_len * args.head_dim * args.n_heads


KIND = LayerKind(
    symbol="*", args_type=AttentionArgs,
    build=lambda args, dim, norm_eps: Attention(dim=dim, args=args, norm_eps=norm_eps),
    mixes_sequence=True, validate=_validate, core_flops=_core_flops,
    tensor_parallel_sizes=lambda args, dim: [("attention.n_heads", args.n_heads),
                                             ("attention.n_kv_heads", args.n_kv_heads)],
    context_parallel=ContextParallelRule(core="core", gather=("k_BSHD", "v_BSHD")),
)

"""Multi-latent attention (MLA, DeepSeek-V2 / V3): pattern symbol `+`.

Queries come from a low-rank projection with its own RMSNorm (or one full-rank projection when
`q_lora_rank` is None); keys and values from a compressed latent of `kv_lora_rank` channels
(with its RMSNorm) that `kv_b_proj` expands per head, plus one rotary key part shared by all
heads. Each head's query / key is [qk_nope_head_dim channels without position | the
qk_rope_head_dim rotary channels]. Submodules carry transformers' DeepseekV3Attention names, so
its weights load as they are (tests/unit/test_mla_dsa.py).

Differences from Megatron's MLATransformerConfig defaults: the latent norms are always there
(Megatron's `qk_layernorm=False` drops them; DeepSeek's models have them), no biases, no
dropout. The softmax is `LatentAttentionCore`, a module without parameters that receives the
compressed latents: context parallelism all-gathers those (kv_lora_rank + qk_rope_head_dim
channels per token) instead of the expanded keys and values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_hybrid.model.common import TPLayout, init_linear, sharded, upcast
from titan_hybrid.model.layer_kind import ContextParallelRule, LayerKind
from titan_hybrid.model.layout import TokenLayout, causal_document_mask
from titan_hybrid.model.norms import RMSNorm
from titan_hybrid.model.rotary import apply_rotary_pairs

LATENT_NORM_EPS = 1e-6  # DeepSeek's (transformers hard-codes it for both latent norms)


@dataclass
class MLAArgs:
    n_heads: int = 4
    q_lora_rank: int | None = 64  # None: one full-rank query projection (DeepSeek-V2-Lite)
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    rope_theta: float = 10000.0
    # True: rotary pairs are channels (2i, 2i+1) (DeepSeek-V3's checkpoints); False: (i, i + d/2).
    rope_interleave: bool = True
    # YaRN context extension (transformers' rope_type "yarn"); factor 1.0 is plain RoPE.
    yarn_factor: float = 1.0
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    # False: no position encoding at all (Kimi Linear's MLA, whose KDA layers carry the
    # positions): the "rotary" slices stay as they are, one key slice shared by all heads.
    rotary: bool = True
    # A sigmoid gate per head on the attention's output, from its own projection of the
    # layer's input (`g_proj`: dim -> n_heads; Ling 3.0's bailing_hybrid MLA).
    output_gate: bool = False

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


# --------------------------------------------------------------------------- rotary (YaRN)
def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rotary_frequencies(args: MLAArgs, dtype: torch.dtype, device) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dr / 2], attention factor) of the rotary part, YaRN included:
    low frequencies are interpolated by the factor, high ones kept, with a linear ramp
    between the dimensions that turn beta_fast and beta_slow times over the original length."""
    dim, base, factor = args.qk_rope_head_dim, args.rope_theta, args.yarn_factor
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=dtype, device=device) / dim)
    if factor == 1.0:
        return 1.0 / pos_freqs, 1.0

    def correction_dim(rotations: float) -> float:
        length = args.yarn_original_max_position_embeddings
        return dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(args.yarn_beta_fast)), 0)
    high = min(math.ceil(correction_dim(args.yarn_beta_slow)), dim - 1)
    high = high + 0.001 if low == high else high  # transformers' guard against 0 / 0
    ramp = ((torch.arange(dim // 2, dtype=dtype, device=device) - low) / (high - low)).clamp(0, 1)
    inv_freq = ramp / (factor * pos_freqs) + (1 - ramp) / pos_freqs
    if args.yarn_mscale and args.yarn_mscale_all_dim:
        attention_factor = (_yarn_mscale(factor, args.yarn_mscale)
                            / _yarn_mscale(factor, args.yarn_mscale_all_dim))
    else:
        attention_factor = _yarn_mscale(factor)
    return inv_freq, attention_factor


def softmax_scale(args: MLAArgs) -> float:
    """1 / sqrt(qk_head_dim), times YaRN's mscale(factor, mscale_all_dim)^2 when set."""
    scale = args.qk_head_dim ** -0.5
    if args.yarn_factor != 1.0 and args.yarn_mscale_all_dim:
        scale *= _yarn_mscale(args.yarn_factor, args.yarn_mscale_all_dim) ** 2
    return scale


def rotary_cos_sin(args: MLAArgs, layout: TokenLayout, seq_len: int,
                   like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B or 1, T, dr / 2] of each token's position, in at least fp32, scaled by
    YaRN's attention factor. Computed per call from the positions: dr / 2 frequencies."""
    dtype = upcast(like).dtype
    inv_freq, factor = rotary_frequencies(args, dtype, like.device)
    if layout.positions is None:
        positions = torch.arange(seq_len, device=like.device, dtype=dtype)[None]
    else:
        positions = layout.positions.to(dtype)
    angles = positions[..., None] * inv_freq
    return angles.cos() * factor, angles.sin() * factor


# --------------------------------------------------------------------------- core
def expand_latents(latent_BSC: torch.Tensor, k_rope_BSR: torch.Tensor, kv_up_weight: torch.Tensor,
                   args: MLAArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [B, S, H, dn + dr] and values [B, S, H, dv] of the heads whose rows `kv_up_weight`
    holds (under tensor parallelism, the rank's heads)."""
    kv = F.linear(latent_BSC, kv_up_weight).unflatten(-1, (-1, args.qk_nope_head_dim + args.v_head_dim))
    k_nope, v = kv.split([args.qk_nope_head_dim, args.v_head_dim], dim=-1)
    k_rope = k_rope_BSR[:, :, None].expand(-1, -1, k_nope.shape[2], -1)
    return torch.cat((k_nope, k_rope), dim=-1), v


def attend(q_BTHK: torch.Tensor, k_BSHK: torch.Tensor, v_BSHV: torch.Tensor,
           mask_B1TS: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Softmax attention [B, T, H, dv]; mask None means plain causal."""
    q, k, v = (t.transpose(1, 2) for t in (q_BTHK, k_BSHK, v_BSHV))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1TS, is_causal=mask_B1TS is None,
                                         scale=scale)
    return out.transpose(1, 2)


class LatentAttentionCore(nn.Module):
    """Causal in-document softmax attention over keys / values expanded from the latents."""

    def __init__(self, args: MLAArgs) -> None:
        super().__init__()
        self.args = args

    def forward(self, q_BTHK: torch.Tensor, latent_BSC: torch.Tensor, k_rope_BSR: torch.Tensor,
                kv_up_weight: torch.Tensor, query: TokenLayout, key: TokenLayout) -> torch.Tensor:
        k, v = expand_latents(latent_BSC, k_rope_BSR, kv_up_weight, self.args)
        plain = query is key and query.is_plain_causal()
        mask = None if plain else causal_document_mask(query, key, q_BTHK.shape[1], k.shape[1],
                                                          k.device)
        return attend(q_BTHK, k, v, mask, softmax_scale(self.args))


# --------------------------------------------------------------------------- layer
class MultiLatentAttention(nn.Module):
    core_type = LatentAttentionCore

    def __init__(self, *, dim: int, args: MLAArgs) -> None:
        super().__init__()
        self.args = args
        q_out = args.n_heads * args.qk_head_dim
        if args.q_lora_rank is None:
            self.q_proj = nn.Linear(dim, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(dim, args.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(args.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(args.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(args.kv_lora_rank,
                                   args.n_heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.o_proj = nn.Linear(args.n_heads * args.v_head_dim, dim, bias=False)
        self.g_proj = nn.Linear(dim, args.n_heads, bias=False) if args.output_gate else None
        self.core = self.core_type(args)

    def tensor_parallel_layouts(self) -> dict[str, TPLayout]:
        # Tensor parallelism splits the heads (rows are head-major, so a plain dim-0 split
        # gives whole heads); the down-projections and latent norms are replicated (Megatron).
        query_up = "q_proj" if self.args.q_lora_rank is None else "q_b_proj"
        gate = {"g_proj.weight": sharded(0)} if self.g_proj is not None else {}
        return {f"{query_up}.weight": sharded(0), "kv_b_proj.weight": sharded(0),
                "o_proj.weight": sharded(1), **gate}

    def query_latent(self, x_BTD: torch.Tensor) -> torch.Tensor | None:
        """The normed low-rank query (None without q_lora_rank)."""
        return None if self.args.q_lora_rank is None else self.q_a_layernorm(self.q_a_proj(x_BTD))

    def project(self, x_BTD: torch.Tensor, query_latent: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor):
        """(queries [B, T, H, dn + dr], latent [B, T, C], rotary key [B, T, dr]), rotated."""
        args = self.args
        batch, seq_len, _ = x_BTD.shape
        q = self.q_proj(x_BTD) if query_latent is None else self.q_b_proj(query_latent)
        q_nope, q_rope = q.view(batch, seq_len, -1, args.qk_head_dim).split(
            [args.qk_nope_head_dim, args.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x_BTD).split(
            [args.kv_lora_rank, args.qk_rope_head_dim], dim=-1)
        if args.rotary:
            q_rope = apply_rotary_pairs(q_rope, cos, sin, interleaved=args.rope_interleave)
            k_rope = apply_rotary_pairs(k_rope[:, :, None], cos, sin,
                                        interleaved=args.rope_interleave)[:, :, 0]
        return torch.cat((q_nope, q_rope), dim=-1), self.kv_a_layernorm(latent), k_rope

    def forward(self, x_BTD: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        cos, sin = rotary_cos_sin(self.args, layout, x_BTD.shape[1], x_BTD)
        q, latent, k_rope = self.project(x_BTD, self.query_latent(x_BTD), cos, sin)
        out = self.core(q, latent, k_rope, self.kv_b_proj.weight, layout, layout)
        return self.output(out, x_BTD)

    def output(self, out_BTHV: torch.Tensor, x_BTD: torch.Tensor) -> torch.Tensor:
        """o_proj of the heads' outputs, each times its sigmoid gate first (output_gate; in
        fp32, as bailing_hybrid computes it)."""
        if self.g_proj is not None:
            gate = torch.sigmoid(upcast(self.g_proj(x_BTD))).to(out_BTHV.dtype)
            out_BTHV = out_BTHV * gate[..., None]
        return self.o_proj(out_BTHV.flatten(2))

    def init_weights(self, *, init_std: float, out_std: float) -> None:
        for module in self.children():
            if isinstance(module, RMSNorm):
                module.init_weights()
            elif isinstance(module, nn.Linear):
                init_linear(module, std=out_std if module is self.o_proj else init_std)


def validate_mla(args: MLAArgs, dim: int, name: str = "mla") -> None:
    for field in ("n_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if getattr(args, field) < 1:
            raise ValueError(f"{name}: {field}={getattr(args, field)} must be at least 1")
    if args.q_lora_rank is not None and args.q_lora_rank < 1:
        raise ValueError(f"{name}: q_lora_rank={args.q_lora_rank} must be at least 1 (or None "
                         "for a full-rank query projection)")
    if args.qk_rope_head_dim % 2:
        raise ValueError(f"{name}: qk_rope_head_dim={args.qk_rope_head_dim} must be even "
                         "(rotary embeddings rotate channel pairs)")
    if args.yarn_factor < 1.0:
        raise ValueError(f"{name}: yarn_factor={args.yarn_factor} must be at least 1.0 (1.0: "
                         "plain RoPE)")


def mla_core_flops(args: MLAArgs, keys_per_query: int) -> int:
    """Forward FLOPs per query of QK^T and PV over `keys_per_query` keys, per head
    2 * (dn + dr) + 2 * dv per key."""
    return 2 * keys_per_query * args.n_heads * (args.qk_head_dim + args.v_head_dim)


def _core_flops(args: MLAArgs, dim: int, seq_len: int) -> int:
    """Megatron's count (megatron/core/models/hybrid/layers/flops.py): causal, so a query sees
    seq_len / 2 keys on average: seq_len * n_heads * (dn + dr + dv) per token forward."""
    return mla_core_flops(args, seq_len) // 2


def tensor_parallel_sizes(name: str):
    return lambda args, dim: [(f"{name}.n_heads", args.n_heads)]


KIND = LayerKind(
    symbol="+", args_type=MLAArgs,
    build=lambda args, dim, norm_eps: MultiLatentAttention(dim=dim, args=args),
    mixes_sequence=True, validate=validate_mla, core_flops=_core_flops,
    tensor_parallel_sizes=tensor_parallel_sizes("mla"),
    # Queries stay local; the compressed latents and rotary keys are all-gathered.
    context_parallel=ContextParallelRule(core="core", gather=("latent_BSC", "k_rope_BSR")),
)

"""DeepSeek-V4 attention: sliding-window attention (pattern symbol `W`).

The attention of every DeepSeek-V4 layer, here without the compressed branches (transformers'
layer type "sliding_attention"; the compressed kinds add their keys to this one's through
`extra_keys`, deepseek_v4_hca.py):

- queries from a low-rank projection: q_a_proj, its RMSNorm q_a_norm, q_b_proj to all heads,
  then an RMS norm without weight over each head's channels;
- one latent head that is both the key and the value of every head (multi-query attention):
  kv_proj and its RMSNorm kv_norm;
- each head's channels are [no position | rope_head_dim rotary channels]: RoPE (interleaved
  pairs (2i, 2i+1), plain theta) rotates the trailing channels of queries and of the latent.
  The latent is also the value, so the output carries the key's rotation; the inverse rotation
  at the query's own position (angle -t) turns that into a rotation by the relative distance;
- a learned sink per head: one more logit in the softmax whose probability is dropped, so a
  query may give less than all of its attention to the keys;
- each query sees the `sliding_window` tokens of its document that end at itself (a query at
  position t sees keys at positions s with t - window < s <= t, transformers'
  sliding_window_overlay);
- a grouped low-rank output projection: the heads form o_groups groups of consecutive heads,
  o_a_proj takes each group to o_lora_rank channels with its own block, o_b_proj mixes them.

Parameters carry transformers' DeepseekV4Attention names, so its attention weights load as
they are (tests/unit/test_deepseek_v4.py). Legend: B batch, T tokens, H heads, D head_dim,
R rope_head_dim, G groups, N query blocks, Q queries per block, K keys per block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_hybrid.model.common import TPLayout, init_linear, sharded, upcast
from titan_hybrid.model.layer_kind import ContextParallelRule, LayerKind
from titan_hybrid.model.layout import TokenLayout
from titan_hybrid.model.norms import RMSNorm
from titan_hybrid.model.rotary import apply_rotary_pairs


@dataclass
class DeepseekV4AttentionArgs:
    n_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64  # the trailing rotary channels of each head
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024  # channels of each group after o_a_proj
    sliding_window: int = 128  # keys a query sees, itself included
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6  # all of the layer's RMS norms (transformers: rms_norm_eps)

    @property
    def group_width(self) -> int:
        """Channels of one output group: n_heads / o_groups heads."""
        return self.n_heads // self.o_groups * self.head_dim

    def rotary_frequencies(self, dtype: torch.dtype, device: torch.device
                           ) -> tuple[torch.Tensor, float]:
        """(inverse frequency of each rotary pair [R / 2], factor on cos and sin): plain RoPE,
        theta^(-2i/R) and 1 (transformers' "main" table; the compressed kinds may scale theirs,
        deepseek_v4_hca.py)."""
        return plain_inverse_frequencies(self.rope_theta, self.rope_head_dim, dtype, device), 1.0


# --------------------------------------------------------------------------- rotary
def rotary_cos_sin(args: DeepseekV4AttentionArgs, layout: TokenLayout, seq_len: int,
                   like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B or 1, T, R / 2] of each token's position in its document, in at least fp32
    (angles of long positions need it). The rotary channels are fewer than the model's
    attention head (its `layout.rope_table`), so the layer computes its own R / 2 angles."""
    if layout.positions is None:
        return rotary_cos_sin_at(args, torch.arange(seq_len, device=like.device)[None], like)
    return rotary_cos_sin_at(args, layout.positions, like)


def rotary_cos_sin_at(args: DeepseekV4AttentionArgs, positions: torch.Tensor,
                      like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [*positions.shape, R / 2] of the angles at `positions`, in at least fp32."""
    dtype = upcast(like).dtype
    inv_freq, scale = args.rotary_frequencies(dtype, like.device)
    angles = positions.to(dtype)[..., None] * inv_freq
    if scale == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * scale, angles.sin() * scale


def plain_inverse_frequencies(theta: float, dim: int, dtype: torch.dtype,
                              device: torch.device) -> torch.Tensor:
    """[dim / 2]: theta^(-2i/dim), the angle per position of rotary pair i."""
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=dtype, device=device) / dim)


def yarn_inverse_frequencies(theta: float, dim: int, factor: float, original_positions: int,
                             beta_fast: float, beta_slow: float, dtype: torch.dtype,
                             device: torch.device) -> torch.Tensor:
    """[dim / 2]: YaRN's inverse frequencies (arXiv 2309.00071, "NTK-by-parts"), as
    transformers' yarn rope (with its correction range rounded outwards).

    A pair whose wavelength fits many times into the `original_positions` of pretraining keeps
    its frequency (extrapolation); one that turns less than once there is divided by `factor`
    (interpolation); between, a linear ramp in the pair index blends the two. Pair i turns
    L * f_i / (2 pi) times over L positions, f_i = theta^(-2i/dim): it turns r times at
    i(r) = dim * ln(L / (2 pi r)) / (2 ln theta). The ramp runs from i(beta_fast) (floored,
    at least 0) to i(beta_slow) (ceiled, at most dim - 1); pairs below it extrapolate, pairs
    above interpolate."""
    plain = plain_inverse_frequencies(theta, dim, dtype, device)

    def pair_turning(turns: float) -> float:
        return dim * math.log(original_positions / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(pair_turning(beta_fast)), 0)
    high = min(math.ceil(pair_turning(beta_slow)), dim - 1)
    if high == low:
        high += 0.001  # a step instead of a ramp, as transformers
    pair = torch.arange(dim // 2, dtype=dtype, device=device)
    interpolated = ((pair - low) / (high - low)).clamp(0, 1)  # 0: keep, 1: divide by factor
    return plain * (1 - interpolated) + plain / factor * interpolated


def rotate_trailing(x_BTHD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing R channels of each head (interleaved pairs); the rest pass."""
    rope_dim = 2 * cos.shape[-1]
    plain, rope = x_BTHD.split([x_BTHD.shape[-1] - rope_dim, rope_dim], dim=-1)
    return torch.cat((plain, apply_rotary_pairs(rope, cos, sin, interleaved=True)), dim=-1)


# --------------------------------------------------------------------------- core
def sliding_window_attention(q_BTHD: torch.Tensor, kv_BTD: torch.Tensor, sinks_H: torch.Tensor,
                             layout: TokenLayout, window: int, scale: float,
                             extra_kv_BCD: torch.Tensor | None = None,
                             extra_visible_BTC: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T, H, D]: softmax attention of each query over the keys of its document at most
    `window - 1` positions before it, with a sink logit per head; `kv_BTD` is every head's key
    and value.

    `extra_kv_BCD`: C more keys (also values) that every query may see where
    `extra_visible_BTC` says so (the compressed rows of DeepSeek-V4's compressed kinds); they
    join the window's keys and the sink in one softmax.

    Queries go in blocks of `window` rows; a block reads only the window - 1 keys before its
    first row and its own rows, so scores take [B, H, T, 2 * window - 1] instead of [T, T]."""
    batch, seq_len, _, _ = q_BTHD.shape
    block = min(window, seq_len)
    n_blocks = -(-seq_len // block)
    before = window - 1 if n_blocks > 1 else 0  # one block: no keys before the row's start
    after = n_blocks * block - seq_len
    span = before + block
    # Tokens in row order (documents, then positions): a key is visible when its order is
    # at most window - 1 below the query's. Documents are 2**32 apart in that order, so this
    # also keeps queries in their own document. Padding sits far below every real token.
    order = layout.row_order(seq_len, q_BTHD.device).expand(batch, seq_len)
    far_below = -(1 << 62)
    query_order = F.pad(order, (0, after), value=far_below).view(batch, n_blocks, block)
    key_order = F.pad(order, (before, after), value=far_below).unfold(1, span, block)
    distance_BNQK = query_order[..., :, None] - key_order[..., None, :]
    visible_BN1QK = ((distance_BNQK >= 0) & (distance_BNQK < window))[:, :, None]

    q_BNQHD = F.pad(q_BTHD, (0, 0, 0, 0, 0, after)).view(batch, n_blocks, block,
                                                           *q_BTHD.shape[2:])
    kv_BNDK = F.pad(kv_BTD, (0, 0, before, after)).unfold(1, span, block)
    scores_BNHQK = torch.einsum("bnqhd,bndk->bnhqk", q_BNQHD, kv_BNDK)
    # The softmax in fp32 (bf16 logits lose the small differences that matter).
    logits = [(upcast(scores_BNHQK) * scale).masked_fill(~visible_BN1QK, float("-inf"))]
    if extra_kv_BCD is not None:
        extra_scores_BNHQC = torch.einsum("bnqhd,bcd->bnhqc", q_BNQHD, extra_kv_BCD)
        # Padding queries see no extra key.
        extra_visible_BN1QC = F.pad(extra_visible_BTC, (0, 0, 0, after)).view(
            batch, n_blocks, 1, block, -1)
        logits.append((upcast(extra_scores_BNHQC) * scale).masked_fill(~extra_visible_BN1QC,
                                                                       float("-inf")))
    sinks = upcast(sinks_H).to(logits[0].dtype)[:, None, None].expand(*logits[0].shape[:-1], 1)
    # Every row sees itself (real rows) or its sink: never a row of -inf only.
    probs = torch.softmax(torch.cat((*logits, sinks), dim=-1), dim=-1).type_as(kv_BTD)
    out_BNQHD = torch.einsum("bnhqk,bndk->bnqhd", probs[..., :span], kv_BNDK)
    if extra_kv_BCD is not None:
        out_BNQHD = out_BNQHD + torch.einsum("bnhqc,bcd->bnqhd", probs[..., span:-1],
                                             extra_kv_BCD)
    return out_BNQHD.flatten(1, 2)[:, :seq_len]


class WindowCore(nn.Module):
    """The part of the layer that runs along the sequence (no parameters; the sinks come in as
    an argument), so context parallelism can wrap it: parallel/context_parallel_window.py
    gives each rank's queries the window's keys held by the rank before."""

    def __init__(self, window: int, scale: float) -> None:
        super().__init__()
        self.window, self.scale = window, scale

    def forward(self, q_BTHD, kv_BTD, sinks_H, layout: TokenLayout, extra_kv_BCD=None,
                extra_visible_BTC=None) -> torch.Tensor:
        return sliding_window_attention(q_BTHD, kv_BTD, sinks_H, layout, self.window,
                                        self.scale, extra_kv_BCD, extra_visible_BTC)


class GroupedLinear(nn.Module):
    """Block-diagonal projection [..., G, in] -> [..., G, out]: each group through its own
    [out, in] block of `weight` [G * out, in] (rows group by group, as transformers'
    DeepseekV4GroupedLinear stores them)."""

    def __init__(self, in_features: int, out_features: int, groups: int) -> None:
        super().__init__()
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(groups * out_features, in_features))

    def forward(self, x_BTGI: torch.Tensor) -> torch.Tensor:
        # -1 groups: under tensor parallelism the rank holds whole groups, fewer of them.
        weight_GOI = self.weight.view(-1, self.out_features, self.weight.shape[-1])
        return torch.einsum("btgi,goi->btgo", x_BTGI, weight_GOI)

    def init_weights(self, *, std: float) -> None:
        nn.init.trunc_normal_(self.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


# --------------------------------------------------------------------------- layer
class SlidingWindowAttention(nn.Module):
    def __init__(self, *, dim: int, args: DeepseekV4AttentionArgs) -> None:
        super().__init__()
        self.args = args
        self.q_a_proj = nn.Linear(dim, args.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(args.q_lora_rank, eps=args.norm_eps)
        self.q_b_proj = nn.Linear(args.q_lora_rank, args.n_heads * args.head_dim, bias=False)
        self.kv_proj = nn.Linear(dim, args.head_dim, bias=False)
        self.kv_norm = RMSNorm(args.head_dim, eps=args.norm_eps)
        self.o_a_proj = GroupedLinear(args.group_width, args.o_lora_rank, args.o_groups)
        self.o_b_proj = nn.Linear(args.o_groups * args.o_lora_rank, dim, bias=False)
        self.sinks = nn.Parameter(torch.empty(args.n_heads))
        self.window_core = WindowCore(args.sliding_window, args.head_dim ** -0.5)

    def tensor_parallel_layouts(self) -> dict[str, TPLayout]:
        # Heads split: q_b_proj's rows and the sinks are head-major; o_a_proj's rows are group
        # by group and a group is consecutive heads, so whole groups go with their heads, and
        # o_b_proj's inputs with them. The latent key / value head and the query's low-rank
        # part serve every head: replicated (their gradients are partial sums over the ranks).
        return {"q_b_proj.weight": sharded(0), "sinks": sharded(0),
                "o_a_proj.weight": sharded(0), "o_b_proj.weight": sharded(1)}

    def forward(self, x_BTD: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        _, q_BTHD, kv_BTD, cos, sin = self.project(x_BTD, layout)
        extra_kv_BCD, extra_visible_BTC = self.extra_keys(x_BTD, layout)
        return self.attend(q_BTHD, kv_BTD, cos, sin, layout, extra_kv_BCD, extra_visible_BTC)

    def project(self, x_BTD: torch.Tensor, layout: TokenLayout):
        """(query latent [B, T, q_lora_rank], rotated queries [B, T, H, D], rotated latent
        key / value [B, T, D], cos, sin)."""
        args = self.args
        batch, seq_len, _ = x_BTD.shape
        cos, sin = rotary_cos_sin(args, layout, seq_len, x_BTD)
        query_latent = self.q_a_norm(self.q_a_proj(x_BTD))
        q = self.q_b_proj(query_latent).view(batch, seq_len, -1, args.head_dim)
        # Each head's query RMS-normed without a weight (transformers' q_b_norm), in fp32.
        q = F.rms_norm(upcast(q), (args.head_dim,), eps=args.norm_eps).type_as(q)
        q_BTHD = rotate_trailing(q, cos, sin)
        kv_BTD = rotate_trailing(self.kv_norm(self.kv_proj(x_BTD))[:, :, None], cos, sin)[:, :, 0]
        return query_latent, q_BTHD, kv_BTD, cos, sin

    def attend(self, q_BTHD, kv_BTD, cos, sin, layout: TokenLayout, extra_kv_BCD=None,
               extra_visible_BTC=None) -> torch.Tensor:
        """The attention core and the output projection, [B, T, dim]."""
        batch, seq_len = q_BTHD.shape[:2]
        out = self.window_core(q_BTHD, kv_BTD, self.sinks, layout, extra_kv_BCD,
                               extra_visible_BTC)
        # The value carried the key's rotation by its own position s; rotating back by the
        # query's t leaves a rotation by s - t, as the reference does.
        out = rotate_trailing(out, cos, -sin)
        grouped_BTGI = out.reshape(batch, seq_len, -1, self.args.group_width)
        return self.o_b_proj(self.o_a_proj(grouped_BTGI).flatten(2))

    def extra_keys(self, x_BTD: torch.Tensor, layout: TokenLayout
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Keys beyond the window, [B, C, D], and which queries see them, [B, T, C]: none here;
        the compressed kinds (deepseek_v4_hca.py) add their compressed rows."""
        return None, None

    def init_weights(self, *, init_std: float, out_std: float) -> None:
        for linear in (self.q_a_proj, self.q_b_proj, self.kv_proj):
            init_linear(linear, std=init_std)
        self.o_a_proj.init_weights(std=init_std)
        init_linear(self.o_b_proj, std=out_std)
        self.q_a_norm.init_weights()
        self.kv_norm.init_weights()
        nn.init.zeros_(self.sinks)  # transformers' init: the sink starts at logit 0


def validate_shapes(args: DeepseekV4AttentionArgs, name: str) -> None:
    """ValueError, naming the args section `name`, for shapes the layer cannot take."""
    for field in ("n_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
                  "sliding_window"):
        if getattr(args, field) < 1:
            raise ValueError(f"{name}: {field}={getattr(args, field)} must be at least 1")
    if args.rope_head_dim % 2 or not 0 < args.rope_head_dim <= args.head_dim:
        raise ValueError(f"{name}: rope_head_dim={args.rope_head_dim} must be even (rotary "
                         f"embeddings rotate channel pairs) and in 2..head_dim={args.head_dim}")
    if args.n_heads % args.o_groups:
        raise ValueError(f"{name}: n_heads={args.n_heads} is not divisible by "
                         f"o_groups={args.o_groups} (each output group takes whole heads)")


def _validate(args: DeepseekV4AttentionArgs, dim: int) -> None:
    validate_shapes(args, "window_attention")


def _core_flops(args: DeepseekV4AttentionArgs, dim: int, seq_len: int) -> int:
    """QK^T and PV over the window (counted unmasked, as dense attention counts the whole
    sequence): 2 * 2 * min(window, T) * head_dim per head and token, forward."""
    return 4 * min(args.sliding_window, seq_len) * args.head_dim * args.n_heads


KIND = LayerKind(
    symbol="W", args_type=DeepseekV4AttentionArgs,
    build=lambda args, dim, norm_eps: SlidingWindowAttention(dim=dim, args=args),
    mixes_sequence=True, validate=_validate, core_flops=_core_flops,
    tensor_parallel_sizes=lambda args, dim: [("window_attention.n_heads", args.n_heads),
                                             ("window_attention.o_groups", args.o_groups)],
    # Context parallelism: each rank's pieces read the window's keys from the piece before
    # them (parallel/context_parallel_window.py).
    context_parallel=ContextParallelRule(core="window_core", window_halo=True),
    # transformers' layer type; the parameter names are its own (hf/deepseek_v4.py)
)

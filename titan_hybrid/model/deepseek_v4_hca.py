"""DeepSeek-V4 heavily compressed attention (pattern symbol `H`).

The sliding-window layer of deepseek_v4.py (pattern symbol `W`: low-rank queries, one latent
head as key and value, partial RoPE with its inverse on the output, sinks, grouped output
projection, the window of the last `sliding_window` tokens) plus transformers'
DeepseekV4HCACompressor (layer type "heavily_compressed_attention"): every `compress_ratio`
consecutive tokens pool into one more key / value row, and each query attends to its window
keys and to the compressed rows it may see in one softmax, with the sink.

The compressor, for each block of `compress_ratio` tokens j (no overlap, no indexer):

    row = kv_norm( sum_j softmax_j(gate_proj(x_j) + position_bias[j]) * kv_proj(x_j) )

the softmax over the block's tokens per channel, `position_bias` [ratio, head_dim] a learned
logit for each place in the block; then RoPE rotates the row's trailing channels at the
position of the block's first token (block w of a document: w * ratio).

Which rows a query sees, and how blocks align (ours; transformers has one document a row):
- blocks count from the start of each document: block w of a document holds its positions
  w * ratio .. (w + 1) * ratio - 1, so a block never mixes two documents; a document's
  trailing partial block is not compressed;
- a query at position t of a document sees the rows of its own document's complete blocks
  that end at or before it: (t + 1) // ratio rows (transformers' block_bias); they overlap
  its window keys, which it sees as well.

The whole layer, queries and window keys included, rotates with `rope_theta`: transformers
gives compressed layers their own "compress" rotary table (config.compress_rope_theta) for
everything, so this section's `rope_theta` is that base (its default, 160000, is
transformers'). That table may be YaRN-scaled (transformers: rope scaling of type yarn in the
config applies to the "compress" table only; the sliding layers' "main" table stays plain):
`rope_scaling_factor` above 1 turns it on, with `original_max_position_embeddings`,
`beta_fast`, `beta_slow` and `attention_factor` (a factor on cos and sin, which transformers'
V4 config sets to 1 for yarn unless given); deepseek_v4.yarn_inverse_frequencies has the math.

Parameters carry transformers' DeepseekV4Attention names (compressor.kv_proj, .gate_proj,
.position_bias, .kv_norm), so its HCA layer's state dict loads as it is
(tests/unit/test_deepseek_v4_hca.py). Legend as in deepseek_v4.py; C compressed rows, P
tokens of a block (`compress_ratio`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from titan_hybrid.model.common import init_linear, upcast
from titan_hybrid.model.deepseek_v4 import (
    DeepseekV4AttentionArgs,
    SlidingWindowAttention,
    rotary_cos_sin_at,
    rotate_trailing,
    validate_shapes,
    yarn_inverse_frequencies,
)
from titan_hybrid.model.layer_kind import ContextParallelRule, LayerKind
from titan_hybrid.model.layout import TokenLayout
from titan_hybrid.model.norms import RMSNorm


@dataclass
class DeepseekV4CompressedAttentionArgs(DeepseekV4AttentionArgs):
    compress_ratio: int = 128  # tokens pooled into one compressed row
    rope_theta: float = 160000.0  # transformers' compress_rope_theta: the whole layer uses it
    # YaRN on this layer's table (transformers' rope_parameters of rope_type "yarn"; V4
    # checkpoints: factor 16). A factor of 1 is plain RoPE and ignores the rest.
    rope_scaling_factor: float = 1.0  # transformers' "factor"
    original_max_position_embeddings: int = 65536  # the pretraining length YaRN extends
    beta_fast: float = 32.0  # pairs turning more often than this over it keep their frequency
    beta_slow: float = 1.0  # pairs turning less often than this are divided by the factor
    attention_factor: float = 1.0  # on cos and sin (transformers' V4 yarn default: 1)

    def rotary_frequencies(self, dtype: torch.dtype, device: torch.device
                           ) -> tuple[torch.Tensor, float]:
        """transformers' "compress" table: plain, or YaRN-scaled when the factor is not 1."""
        if self.rope_scaling_factor == 1.0:
            return super().rotary_frequencies(dtype, device)
        inv_freq = yarn_inverse_frequencies(
            self.rope_theta, self.rope_head_dim, self.rope_scaling_factor,
            self.original_max_position_embeddings, self.beta_fast, self.beta_slow, dtype,
            device)
        return inv_freq, self.attention_factor

    @property
    def compressor_halo(self) -> int:
        """Tokens before a block's first that its row reads, plus the rest of a block that
        ends in a context-parallel piece but starts before it: ratio - 1 (no overlap)."""
        return self.compress_ratio - 1


def compression_blocks(layout: TokenLayout, seq_len: int, ratio: int, device: torch.device
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(first token index [B or 1, C], complete [B or 1, C]) of each row's compression blocks,
    C = T // ratio slots (no row holds more complete blocks), complete blocks first; an
    incomplete slot's index is a valid token (its row is computed, then never seen).

    A block starts at each position that is a multiple of `ratio` whose document goes on for
    `ratio - 1` more tokens in the row."""
    n_slots = seq_len // ratio
    if layout.positions is None:  # one document from the row's start: blocks tile the row
        first = torch.arange(n_slots, device=device)[None] * ratio
        return first, torch.ones_like(first, dtype=torch.bool)
    order = layout.row_order(seq_len, device)
    positions = layout.positions.long()
    # The row order of the token ratio - 1 later is ratio - 1 above only in the same document
    # (documents are 2**32 apart); past the row's end nothing is.
    last_order = torch.nn.functional.pad(order, (0, ratio - 1), value=-1)[:, ratio - 1:]
    starts = (positions % ratio == 0) & (last_order - order == ratio - 1)
    # The starts in row order, then the other tokens: the first C are the complete blocks.
    index = torch.arange(seq_len, device=device).expand_as(starts)
    sort_key = torch.where(starts, index, index + seq_len)
    first = sort_key.sort(dim=1).values[:, :n_slots]
    complete = first < seq_len
    return torch.where(complete, first, 0), complete


def block_tokens(x_BTE: torch.Tensor, first_BC: torch.Tensor, ratio: int, tiled: bool
                 ) -> torch.Tensor:
    """[B, C, P, E]: the `ratio` tokens of each block from its first token's index; `tiled`:
    the blocks tile the row from its start (a view, no gather)."""
    n_rows = first_BC.shape[1]
    if tiled:
        return x_BTE[:, :n_rows * ratio].unflatten(1, (n_rows, ratio))
    token_BN1 = (first_BC[..., None] + torch.arange(ratio, device=x_BTE.device)).flatten(1)
    return x_BTE.gather(1, token_BN1[..., None].expand(-1, -1, x_BTE.shape[-1])).unflatten(
        1, (n_rows, ratio))


def rotate_rows(args: DeepseekV4CompressedAttentionArgs, rows_BCD: torch.Tensor,
                first_BC: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
    """Rotate each compressed row at its block's first position in its document
    (transformers: block index * ratio)."""
    if layout.positions is None:
        first_position_BC = first_BC
    else:
        first_position_BC = layout.positions.long().expand(first_BC.shape[0], -1).gather(
            1, first_BC)
    cos, sin = rotary_cos_sin_at(args, first_position_BC, rows_BCD)
    return rotate_trailing(rows_BCD[:, :, None], cos, sin)[:, :, 0]


class CompressedRows(NamedTuple):
    """A compressor's rows: every block slot of the rows ([B, C, ...]), complete or not."""
    kv: torch.Tensor  # [B, C, D] rotated key / value rows
    index_keys: torch.Tensor | None  # [B, C, K] the `C` indexer's keys of the same blocks
    last_order: torch.Tensor  # [B, C] TokenLayout.row_order of each block's last token
    complete: torch.Tensor  # [B, C] the slot holds a complete block

    def visible_to(self, layout: TokenLayout, seq_len: int) -> torch.Tensor:
        """[B, T, C]: each query sees its document's complete blocks whose last token is at or
        before it ((t + 1) // ratio rows at position t). Documents are 2**32 apart in row
        order, so the same document is the same order >> 32."""
        order_BT1 = layout.row_order(seq_len, self.kv.device)[..., None]
        last_order_B1C = self.last_order[:, None, :]
        return ((last_order_B1C <= order_BT1) & (last_order_B1C >> 32 == order_BT1 >> 32)
                & self.complete[:, None, :])


def block_last_order(layout: TokenLayout, seq_len: int, first_BC: torch.Tensor,
                     ratio: int) -> torch.Tensor:
    """[B, C]: the row order of each block's last token (ratio - 1 after its first)."""
    order_BT = layout.row_order(seq_len, first_BC.device).expand(first_BC.shape[0], -1)
    return order_BT.gather(1, first_BC) + ratio - 1


class HCACompressor(nn.Module):
    """Pools each block of `compress_ratio` tokens of a document into one key / value row
    (module docstring); transformers' DeepseekV4HCACompressor's parameters."""

    def __init__(self, *, dim: int, args: DeepseekV4CompressedAttentionArgs) -> None:
        super().__init__()
        self.args = args
        self.kv_proj = nn.Linear(dim, args.head_dim, bias=False)
        self.gate_proj = nn.Linear(dim, args.head_dim, bias=False)
        self.position_bias = nn.Parameter(torch.empty(args.compress_ratio, args.head_dim))
        self.kv_norm = RMSNorm(args.head_dim, eps=args.norm_eps)

    def forward(self, x_BTD: torch.Tensor, layout: TokenLayout) -> CompressedRows:
        args = self.args
        ratio = args.compress_ratio
        batch, seq_len, _ = x_BTD.shape
        first_BC, complete_BC = compression_blocks(layout, seq_len, ratio, x_BTD.device)
        first_BC, complete_BC = first_BC.expand(batch, -1), complete_BC.expand(batch, -1)
        tiled = layout.positions is None
        kv_BCPD = block_tokens(self.kv_proj(x_BTD), first_BC, ratio, tiled)
        gate_BCPD = block_tokens(self.gate_proj(x_BTD), first_BC, ratio, tiled)
        # Each channel's weights over the block's tokens, in fp32 as transformers' softmax.
        weights_BCPD = torch.softmax(upcast(gate_BCPD) + upcast(self.position_bias), dim=2)
        rows_BCD = self.kv_norm((kv_BCPD * weights_BCPD.type_as(kv_BCPD)).sum(2))
        rows_BCD = rotate_rows(args, rows_BCD, first_BC, layout)
        return CompressedRows(rows_BCD, None, block_last_order(layout, seq_len, first_BC, ratio),
                              complete_BC)

    def init_weights(self, *, init_std: float) -> None:
        init_linear(self.kv_proj, std=init_std)
        init_linear(self.gate_proj, std=init_std)
        nn.init.zeros_(self.position_bias)  # transformers' init: a plain softmax of the gates
        self.kv_norm.init_weights()


class HeavilyCompressedAttention(SlidingWindowAttention):
    """The sliding-window layer whose queries also see the compressor's rows."""

    def __init__(self, *, dim: int, args: DeepseekV4CompressedAttentionArgs) -> None:
        super().__init__(dim=dim, args=args)
        self.compressor = HCACompressor(dim=dim, args=args)

    # tensor_parallel_layouts: the window layer's; the compressor serves every head, so it is
    # replicated (partial gradients, as the latent key / value head).

    def extra_keys(self, x_BTD: torch.Tensor, layout: TokenLayout
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if x_BTD.shape[1] < self.args.compress_ratio:
            return None, None  # not one block: the window layer's attention
        rows = self.compressor(x_BTD, layout)
        return rows.kv, rows.visible_to(layout, x_BTD.shape[1])

    def init_weights(self, *, init_std: float, out_std: float) -> None:
        super().init_weights(init_std=init_std, out_std=out_std)
        self.compressor.init_weights(init_std=init_std)


def validate_compressed(args: DeepseekV4CompressedAttentionArgs, name: str) -> None:
    """ValueError, naming the args section `name`, for what the compressed kinds cannot take."""
    validate_shapes(args, name)
    if args.compress_ratio < 1:
        raise ValueError(f"{name}: compress_ratio={args.compress_ratio} must be at least 1")
    if args.rope_scaling_factor < 1:
        raise ValueError(f"{name}: rope_scaling_factor={args.rope_scaling_factor} must be at "
                         "least 1 (1: no YaRN)")
    if args.rope_scaling_factor != 1 and args.original_max_position_embeddings < 1:
        raise ValueError(f"{name}: original_max_position_embeddings="
                         f"{args.original_max_position_embeddings} must be at least 1")


def _validate(args: DeepseekV4CompressedAttentionArgs, dim: int) -> None:
    validate_compressed(args, "heavily_compressed_attention")


def _core_flops(args: DeepseekV4CompressedAttentionArgs, dim: int, seq_len: int) -> int:
    """Forward, per token: QK^T and PV over the window, 4 * min(window, T) * head_dim per head,
    and over every compressed row of the row, 4 * (T // ratio) * head_dim per head (both
    counted unmasked, as dense attention counts the whole sequence); the compressor's
    weighted sum, 2 * head_dim (its projections are parameters: 6 * parameters counts them)."""
    keys = min(args.sliding_window, seq_len) + seq_len // args.compress_ratio
    return 4 * keys * args.head_dim * args.n_heads + 2 * args.head_dim


KIND = LayerKind(
    symbol="H", args_type=DeepseekV4CompressedAttentionArgs,
    build=lambda args, dim, norm_eps: HeavilyCompressedAttention(dim=dim, args=args),
    mixes_sequence=True, validate=_validate, core_flops=_core_flops,
    tensor_parallel_sizes=lambda args, dim: [
        ("heavily_compressed_attention.n_heads", args.n_heads),
        ("heavily_compressed_attention.o_groups", args.o_groups)],
    # Context parallelism: the window's key halo, and the rows of every piece gathered
    # (parallel/context_parallel_compressed.py).
    context_parallel=ContextParallelRule(core="window_core", window_halo=True,
                                         compressor="compressor"),
    high_precision_modules=("compressor",),
    # transformers' layer type; the parameter names are its own (hf/deepseek_v4.py)
)

"""Gated short convolution (`S`, LFM2's `Lfm2ShortConv`).

in_proj: hidden -> [B | C | x] (D each); the input gate B * x; a depthwise causal conv of
width `conv_width` over it, without activation; the output gate C * conv; out_proj. Legend: B
batch (in shapes), T time, D hidden, C channels, W conv width.

The conv is the core (model/recurrent.py's ConvolutionCore), so context parallelism cuts it by
channel (head_a2a: each channel a head of width 1) or passes each piece its width - 1 rows
before it (chunkwise); tensor parallelism splits every part by channel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from titan_hybrid.model.common import TPLayout, init_depthwise_conv, init_linear, sharded
from titan_hybrid.model.layer_kind import (
    HEADS,
    ContextParallelRule,
    HeadChannels,
    LayerKind,
)
from titan_hybrid.model.layout import TokenLayout
from titan_hybrid.model.recurrent import ConvolutionCore


@dataclass
class ShortConvArgs:
    conv_width: int = 3
    # Biases on in_proj, the conv and out_proj (LFM2's conv_bias); not under tensor
    # parallelism, whose partial outputs would each add out_proj's bias.
    bias: bool = False


# in_proj's components in order, by checkpoint-key suffix.
IN_PROJ_PARTS = (".b", ".c", ".x")


class ShortConv(nn.Module):
    def __init__(self, *, dim: int, args: ShortConvArgs) -> None:
        super().__init__()
        self.args = args
        parts = {part: dim for part in IN_PROJ_PARTS}
        self.fused_parts = {"in_proj.weight": parts, **({"in_proj.bias": parts} if args.bias
                                                       else {})}
        self.in_proj = nn.Linear(dim, 3 * dim, bias=args.bias)
        self.conv1d = nn.Conv1d(dim, dim, args.conv_width, groups=dim, bias=args.bias)
        self.out_proj = nn.Linear(dim, dim, bias=args.bias)
        self.conv = ConvolutionCore(args)

    def tensor_parallel_layouts(self) -> dict[str, TPLayout]:
        conv = {"conv1d.weight": sharded(0), **({"conv1d.bias": sharded(0)}
                                                 if self.args.bias else {})}
        return {**{name: sharded(0, parts) for name, parts in self.fused_parts.items()}, **conv,
                "out_proj.weight": sharded(1)}

    def forward(self, x_BTD: torch.Tensor, layout: TokenLayout | None = None) -> torch.Tensor:
        b, c, x = self.in_proj(x_BTD).chunk(3, -1)
        y = self.conv(b * x, self.conv1d.weight.squeeze(1), self.conv1d.bias, layout)
        return self.out_proj(c * y)

    def init_weights(self, *, init_std: float, out_std: float) -> None:
        init_linear(self.in_proj, std=init_std)
        init_linear(self.out_proj, std=out_std)
        init_depthwise_conv(self.conv1d)


def _validate(args: ShortConvArgs, dim: int) -> None:
    if args.conv_width < 1:
        raise ValueError(f"short_conv: conv_width={args.conv_width} must be >= 1")


def _validate_tensor_parallel(args: ShortConvArgs) -> None:
    if args.bias:
        raise ValueError("short_conv.bias=True under tensor parallelism: each rank's partial "
                         "output would add out_proj's bias; use tensor_parallel_degree 1")


def _head_channels(args: ShortConvArgs, tensors: dict) -> HeadChannels:
    """The conv's input and its weight (and bias) by channel: each channel a head of width
    1, its own group."""
    channels = tensors["conv_weight_CW"].shape[0]
    per_channel = ((1, HEADS),)
    sliced = {"conv_weight_CW": per_channel}
    if tensors["conv_bias_C"] is not None:
        sliced["conv_bias_C"] = per_channel
    return HeadChannels(channels, channels, exchanged={"x_BTC": per_channel}, sliced=sliced)


KIND = LayerKind(
    symbol="S", args_type=ShortConvArgs,
    build=lambda args, dim, norm_eps: ShortConv(dim=dim, args=args),
    mixes_sequence=True, validate=_validate,
    # The conv's multiply-adds are its weight's (2 W per channel and token), which 6 *
    # parameters counts: no core FLOPs beyond them.
    tensor_parallel_sizes=lambda args, dim: [("dim (short_conv channels)", dim)],
    validate_tensor_parallel=_validate_tensor_parallel,
    context_parallel=ContextParallelRule(
        core="conv",
        head_groups=lambda args, dim: (("dim (short_conv channels)", dim),
                                       ("dim (short_conv channels)", dim)),
        head_channels=_head_channels),
)

"""Mamba1 mixer (mamba_ssm's `Mamba`, transformers' MambaMixer / FalconMambaMixer /
JambaMambaMixer), what `M` builds with `hybrid.m_layers = "mamba1"`.

in_proj: hidden -> [x | z] (d_inner each); a depthwise causal conv with bias over x, then SiLU;
x_proj: x -> [dt (rank R) | B | C] (N each, shared by every channel), with RMS norms of dt, B
and C as the families have them (`dt_bc_norm`: none, weightless as Falcon-Mamba's, weighted as
Jamba's `dt_layernorm` / `b_layernorm` / `c_layernorm`); dt_proj: R -> d_inner with bias; the
selective scan (ops/selective_scan.py) with A = -exp(A_log) [d_inner, N], a decay per channel
and state entry, D, and the gate: y * silu(z); out_proj. Parameter names are transformers'.
Legend: B batch, T time, D hidden, C d_inner channels, R dt rank, N state size.

Tensor parallelism splits the channels: in_proj's x and z parts, the conv, dt_proj's rows, A_log,
D and out_proj's columns. x_proj contracts over the channels, so each rank's output is a partial
sum of dt, B and C, which every channel uses: it is marked TensorParallelPartialSum (summed over
the TP group, forward and backward), and the dt / B / C norms after it are replicated.
Everything from the conv to the gate is the core (SelectiveScanCore, model/recurrent.py's
DiagonalDecayCore), so context parallelism cuts it by channel (head_a2a: each channel a head of
width 1, x_proj's partial sums summed over the CP group as well) or passes each piece the state
entering it (chunkwise: parallel/context_parallel_chunkwise.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from titan_hybrid.model.common import (
    TensorParallelPartialSum,
    TPLayout,
    init_depthwise_conv,
    init_dt_bias,
    init_linear,
    sharded,
    upcast,
)
from titan_hybrid.model.layer_kind import HEADS, ContextParallelRule, HeadChannels, LayerKind
from titan_hybrid.model.layout import TokenLayout
from titan_hybrid.model.norms import RMSNorm
from titan_hybrid.model.recurrent import DiagonalDecayCore
from titan_hybrid.model.symbols import MIXER, LayerSymbol
from titan_hybrid.ops.selective_scan import selective_scan

DT_BC_NORMS = ("none", "weightless", "weighted")
# The mixer's tensors under transformers' names (MambaMixer's, which Falcon-Mamba's and Jamba's
# share), and the weighted norms' (Jamba's).
PARAMETERS = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "x_proj.weight",
              "dt_proj.weight", "dt_proj.bias", "A_log", "D", "out_proj.weight")
WEIGHTED_NORMS = ("dt_layernorm.weight", "b_layernorm.weight", "c_layernorm.weight")
IN_PROJ_PARTS = (".x", ".z")  # in_proj's components, as its split state dict names them


@dataclass
class Mamba1Args:
    d_state: int = 16
    expand: int = 2
    conv_width: int = 4
    dt_rank: int = 0  # 0: ceil(dim / 16), as mamba_ssm's "auto"
    # RMS norms of x_proj's dt, B and C: "none" (Mamba), "weightless" (Falcon-Mamba),
    # "weighted" (Jamba)
    dt_bc_norm: Literal["none", "weightless", "weighted"] = "none"
    # those norms' epsilon; 0: the model's norm_eps
    norm_eps: float = 0.0
    dt_min: float = 1e-3
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4

    def d_inner(self, dim: int) -> int:
        return self.expand * dim

    def rank(self, dim: int) -> int:
        return self.dt_rank or math.ceil(dim / 16)


class SelectiveScanCore(DiagonalDecayCore):
    """Mamba1's part that runs along time (model/recurrent.py's DiagonalDecayCore): the conv
    with bias and SiLU over x, x_proj to [dt | B | C] and their norms, dt_proj, and the
    selective scan with D and the gate. Its parameters come in as arguments, each by channel
    in its rows (x_proj's weight transposed: [C, R + 2N]), so that tensor and context
    parallelism cut them by channel. x_proj contracts over the channels, so a rank that holds
    some of them (TP's shard, head exchange's 1/cp) has a partial sum of dt, B and C: it is
    marked TensorParallelPartialSum, summed over the TP group, and over the CP group under the
    head exchange (parallel/context_parallel.py)."""

    conv_input = "x_BTC"

    def __init__(self, args: Mamba1Args, eps: float) -> None:
        super().__init__(args)
        self.eps = eps
        self.x_proj_sum = TensorParallelPartialSum()

    def forward(self, x_BTC: torch.Tensor, z_BTC: torch.Tensor, conv_weight_CW: torch.Tensor,
                conv_bias_C: torch.Tensor, x_proj_weight_CR: torch.Tensor,
                dt_proj_weight_CR: torch.Tensor, dt_proj_bias_C: torch.Tensor,
                A_log: torch.Tensor, D: torch.Tensor, dt_norm_weight: torch.Tensor | None,
                b_norm_weight: torch.Tensor | None, c_norm_weight: torch.Tensor | None,
                layout: TokenLayout | None) -> torch.Tensor:
        seq_idx = None if layout is None else layout.seq_idx
        x = self.conv(x_BTC, conv_weight_CW, conv_bias_C, seq_idx)
        return self.scan(x, seq_idx, z_BTC, x_proj_weight_CR, dt_proj_weight_CR, dt_proj_bias_C,
                         A_log, D, dt_norm_weight, b_norm_weight, c_norm_weight)

    def _dt_b_c(self, x_conv_BTC, x_proj_weight_CR, dt_proj_weight_CR, dt_norm_weight,
                b_norm_weight, c_norm_weight):
        """dt before its bias [B, T, C], B and C [B, T, N] of the conv's output."""
        args = self.args
        rank = dt_proj_weight_CR.shape[1]
        dt, B, C = self.x_proj_sum(x_conv_BTC @ x_proj_weight_CR).split(
            [rank, args.d_state, args.d_state], -1)
        if args.dt_bc_norm != "none":
            weights = (dt_norm_weight, b_norm_weight, c_norm_weight)
            dt, B, C = (self._rms_norm(t, w) for t, w in zip((dt, B, C), weights, strict=True))
        return F.linear(dt, dt_proj_weight_CR), B, C  # dt_proj's bias enters the softplus

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """RMSNorm's arithmetic (model/norms.py), weightless without a weight."""
        normed = F.rms_norm(upcast(x), (x.shape[-1],), eps=self.eps)
        return (normed if weight is None else normed * upcast(weight)).type_as(x)

    def scan(self, x_conv_BTC, seq_idx, z_BTC, x_proj_weight_CR, dt_proj_weight_CR,
             dt_proj_bias_C, A_log, D, dt_norm_weight, b_norm_weight, c_norm_weight,
             initial_state=None, return_final_state=False):
        dt, B, C = self._dt_b_c(x_conv_BTC, x_proj_weight_CR, dt_proj_weight_CR,
                                dt_norm_weight, b_norm_weight, c_norm_weight)
        return selective_scan(x_conv_BTC, dt, -torch.exp(upcast(A_log)), B, C, D=D, z_BTD=z_BTC,
                              dt_bias=dt_proj_bias_C, dt_softplus=True, seq_idx=seq_idx,
                              initial_state=initial_state,
                              return_final_state=return_final_state)

    def step_sizes(self, x_conv_BTC, x_proj_weight_CR, dt_proj_weight_CR, dt_proj_bias_C, A_log,
                   dt_norm_weight, b_norm_weight, c_norm_weight):
        dt, _, _ = self._dt_b_c(x_conv_BTC, x_proj_weight_CR, dt_proj_weight_CR,
                                dt_norm_weight, b_norm_weight, c_norm_weight)
        return F.softplus(upcast(dt) + upcast(dt_proj_bias_C)), -torch.exp(upcast(A_log))


class Mamba1Mixer(nn.Module):
    def __init__(self, *, dim: int, args: Mamba1Args, norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.args = args
        inner, rank, state = args.d_inner(dim), args.rank(dim), args.d_state
        self.eps = args.norm_eps or norm_eps
        self.in_proj = nn.Linear(dim, 2 * inner, bias=False)
        self.fused_parts = {"in_proj.weight": {part: inner for part in IN_PROJ_PARTS}}
        self.conv1d = nn.Conv1d(inner, inner, args.conv_width, groups=inner, bias=True)
        self.x_proj = nn.Linear(inner, rank + 2 * state, bias=False)
        self.dt_proj = nn.Linear(rank, inner, bias=True)
        self.A_log = nn.Parameter(torch.empty(inner, state, dtype=torch.float32))
        self.D = nn.Parameter(torch.empty(inner, dtype=torch.float32))
        self.out_proj = nn.Linear(inner, dim, bias=False)
        if args.dt_bc_norm == "weighted":  # Jamba's names
            self.dt_layernorm = RMSNorm(rank, eps=self.eps)
            self.b_layernorm = RMSNorm(state, eps=self.eps)
            self.c_layernorm = RMSNorm(state, eps=self.eps)
        self.core = SelectiveScanCore(args, self.eps)

    def tensor_parallel_layouts(self) -> dict[str, TPLayout]:
        by_channel = ("conv1d.weight", "conv1d.bias", "dt_proj.weight", "dt_proj.bias",
                      "A_log", "D")
        return {"in_proj.weight": sharded(0, self.fused_parts["in_proj.weight"]),
                **{name: sharded(0) for name in by_channel},
                "x_proj.weight": sharded(1), "out_proj.weight": sharded(1)}

    def forward(self, x_BTD: torch.Tensor, layout: TokenLayout | None = None) -> torch.Tensor:
        x, z = self.in_proj(x_BTD).chunk(2, -1)
        # the dt / B / C norms' weights (Jamba's), or None
        norm_weights = [getattr(self, f"{name}_layernorm").weight
                        if hasattr(self, f"{name}_layernorm") else None
                        for name in ("dt", "b", "c")]
        y = self.core(x, z, self.conv1d.weight.squeeze(1), self.conv1d.bias,
                      self.x_proj.weight.t(), self.dt_proj.weight, self.dt_proj.bias, self.A_log,
                      self.D, *norm_weights, layout)
        return self.out_proj(y)

    def init_weights(self, *, init_std: float, out_std: float) -> None:
        args = self.args
        init_linear(self.in_proj, std=init_std)
        init_linear(self.x_proj, std=init_std)
        init_linear(self.out_proj, std=out_std)
        init_depthwise_conv(self.conv1d)
        rank = self.dt_proj.weight.shape[1]
        bound = rank ** -0.5  # mamba_ssm's dt_init "random"
        nn.init.uniform_(self.dt_proj.weight, -bound, bound)
        init_dt_bias(self.dt_proj.bias, dt_min=args.dt_min, dt_max=args.dt_max,
                     dt_floor=args.dt_init_floor)
        with torch.no_grad():
            # S4D-real: A = -(1 .. N) for every channel
            self.A_log.copy_(torch.log(torch.arange(1, args.d_state + 1, dtype=torch.float32,
                                                    device=self.A_log.device)).expand_as(
                self.A_log))
        nn.init.ones_(self.D)
        for name in ("dt_layernorm", "b_layernorm", "c_layernorm"):
            if hasattr(self, name):
                getattr(self, name).init_weights()


def _validate(args: Mamba1Args, dim: int) -> None:
    for field in ("d_state", "expand", "conv_width"):
        if getattr(args, field) < 1:
            raise ValueError(f"mamba1: {field}={getattr(args, field)} must be at least 1")
    if args.dt_rank < 0:
        raise ValueError(f"mamba1: dt_rank={args.dt_rank} must be >= 0 (0: ceil(dim / 16))")
    if args.dt_bc_norm not in DT_BC_NORMS:
        raise ValueError(f"mamba1: dt_bc_norm '{args.dt_bc_norm}' is not one of "
                         f"{', '.join(DT_BC_NORMS)}")


def _core_flops(args: Mamba1Args, dim: int, seq_len: int) -> int:
    """The scan's FLOPs per token, forward, per channel and state entry: the state's update
    (a multiply-add, elementwise) and the read-out C . h (a multiply-add, the product that
    torch's FLOP counter sees)."""
    return args.d_inner(dim) * args.d_state * (2 + 2)


def _head_channels(args: Mamba1Args, tensors: dict) -> HeadChannels:
    """Every per-token argument and every channel-wise parameter by channel: each channel a
    head of width 1, its own group (x_proj's partial sums are summed over the CP group); the
    dt / B / C norms' weights whole."""
    channels = tensors["conv_weight_CW"].shape[0]
    per_channel = ((1, HEADS),)
    return HeadChannels(
        channels, channels, exchanged={"x_BTC": per_channel, "z_BTC": per_channel},
        sliced={name: per_channel for name in (
            "conv_weight_CW", "conv_bias_C", "x_proj_weight_CR", "dt_proj_weight_CR",
            "dt_proj_bias_C", "A_log", "D")},
        whole=("dt_norm_weight", "b_norm_weight", "c_norm_weight"))


KIND = LayerKind(
    symbol="M", variant=LayerSymbol(symbol="M", name="mamba1", title="Mamba1", namespace=MIXER),
    args_type=Mamba1Args,
    build=lambda args, dim, norm_eps: Mamba1Mixer(dim=dim, args=args, norm_eps=norm_eps),
    mixes_sequence=True, validate=_validate, core_flops=_core_flops,
    full_precision_params=("A_log", "D"),
    context_parallel=ContextParallelRule(
        core="core",
        head_groups=lambda args, dim: (("mamba1 d_inner (channels)", args.d_inner(dim)),
                                       ("mamba1 d_inner (channels)", args.d_inner(dim))),
        head_channels=_head_channels),
)

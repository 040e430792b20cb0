"""Mamba2 mixer (Megatron / mamba_ssm layout).

in_proj: hidden -> [z | x | B | C | dt] (d_inner, d_inner, G*N, G*N, H), depthwise causal conv
over [x | B | C] then SiLU, SSD scan, gated grouped RMSNorm norm(y * silu(z)), out_proj.
Legend: B batch, T time, D hidden, H heads, P head dim, G groups, N state size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_hybrid.model.common import (
    TPLayout,
    init_depthwise_conv,
    init_linear,
    init_ssm_decay,
    sharded,
    upcast,
)
from titan_hybrid.model.layer_kind import (
    GROUPS,
    HEADS,
    ContextParallelRule,
    HeadChannels,
    LayerKind,
)
from titan_hybrid.model.layout import TokenLayout
from titan_hybrid.model.norms import GatedGroupRMSNorm
from titan_hybrid.model.recurrent import ScalarDecayCore
from titan_hybrid.ops.mamba_core import core_runs_fused as mamba2_core_runs
from titan_hybrid.ops.mamba_core import mamba2_core, split_xbc
from titan_hybrid.ops.ssd import discretized_dt, mamba_chunk_scan_combined


@dataclass
class MambaArgs:
    d_state: int = 128
    head_dim: int = 64
    n_groups: int = 8
    expand: int = 2
    conv_width: int = 4
    chunk_size: int = 128
    dt_min: float = 1e-3
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    a_init_range: tuple[float, float] = (1.0, 16.0)
    dt_limit: tuple[float, float] = (0.0, float("inf"))  # clamp of softplus(dt + dt_bias)
    # The SSM heads, when the inner width is not expand * dim (Nemotron 3 Nano: 64 heads of
    # 64 on a 2688-wide model); 0: expand * dim / head_dim.
    num_heads: int = 0
    # False: the output is y * silu(z), without the grouped RMS norm (Falcon-H1's released
    # models, mamba_rms_norm = false); the layer then has no norm weight.
    gated_norm: bool = True
    # Falcon-H1's µP multipliers, kept as scalars: the layer's input times input_multiplier
    # (ssm_in_multiplier), in_proj's [z | x | B | C | dt] each times its own (its mup_vector's
    # ssm_multipliers), the output times output_multiplier (ssm_out_multiplier).
    input_multiplier: float = 1.0
    in_proj_multipliers: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)
    output_multiplier: float = 1.0

    def d_inner(self, dim: int) -> int:
        return self.num_heads * self.head_dim if self.num_heads else self.expand * dim

    def n_heads(self, dim: int) -> int:
        return self.d_inner(dim) // self.head_dim


# The fused parameters' components, in order: in_proj [z | x | B | C | dt], conv [x | B | C].
FUSED_COMPONENTS = {"in_proj.weight": (".z", ".x", ".B", ".C", ".dt"),
                    "conv1d.weight": (".x", ".B", ".C"), "conv1d.bias": (".x", ".B", ".C")}


def fused_component_sizes(args: MambaArgs, dim: int) -> dict[str, dict[str, int]]:
    """{fused parameter: {component: rows}} (FUSED_COMPONENTS with their sizes): the one
    definition that the layer, its TP layout and the Hugging Face format read."""
    group_state = args.n_groups * args.d_state
    rows = {".z": args.d_inner(dim), ".x": args.d_inner(dim), ".B": group_state,
            ".C": group_state, ".dt": args.n_heads(dim)}
    return {name: {part: rows[part] for part in parts} for name, parts in FUSED_COMPONENTS.items()}


class ConvAndScan(ScalarDecayCore):
    """Mamba2's part that runs along time (model/recurrent.py's ScalarDecayCore): causal conv
    over [x | B | C], SiLU, and the SSD scan. Everything in it is per channel / per head, and
    the per-head parameters come in as arguments. Sizes come from the tensors (TP / CP
    shards)."""

    conv_input = "xbc_BTC"

    def forward(self, xbc_BTC: torch.Tensor, dt_BTH: torch.Tensor, conv_weight_CW: torch.Tensor,
                conv_bias_C: torch.Tensor, A_log: torch.Tensor, D: torch.Tensor,
                dt_bias: torch.Tensor, layout: TokenLayout | None) -> torch.Tensor:
        seq_idx = None if layout is None else layout.seq_idx
        xbc = self.conv(xbc_BTC, conv_weight_CW, conv_bias_C, seq_idx)
        return self.scan(xbc, seq_idx, dt_BTH=dt_BTH, A_log=A_log, D=D, dt_bias=dt_bias)

    def split_xbc(self, xbc_BTC: torch.Tensor, n_heads: int):
        """The conv output's x [B, T, H, P], B and C [B, T, G, N]."""
        return split_xbc(xbc_BTC, n_heads, self.args.head_dim, self.args.d_state)

    def scan(self, x_conv_BTC, seq_idx, return_final_states=False, *, dt_BTH, A_log, D,
             dt_bias):
        args = self.args
        x, b, c = self.split_xbc(x_conv_BTC, A_log.shape[0])
        return mamba_chunk_scan_combined(
            x, dt_BTH, self.decay_rate(A_log), b, c, args.chunk_size, D=D, dt_bias=dt_bias,
            seq_idx=seq_idx, dt_softplus=True, dt_limit=args.dt_limit,
            return_final_states=return_final_states)

    @staticmethod
    def decay_rate(A_log: torch.Tensor) -> torch.Tensor:
        return -torch.exp(upcast(A_log))

    def log_decay(self, dtype, *, dt_BTH, A_log, dt_bias) -> torch.Tensor:
        """dt * A, as the scan computes it."""
        dt = discretized_dt(dt_BTH, dt_bias, True, self.args.dt_limit, dtype)
        return dt * self.decay_rate(A_log).to(dtype)

    def readout(self, x_conv_BTC, *, A_log):
        """C [B, T, G, N] of the conv's output."""
        return self.split_xbc(x_conv_BTC, A_log.shape[0])[2]


class Mamba2Mixer(nn.Module):
    def __init__(self, *, dim: int, args: MambaArgs, norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.args = args
        self.d_inner, self.n_heads = args.d_inner(dim), args.n_heads(dim)
        self.fused_parts = fused_component_sizes(args, dim)
        in_size, conv_size = (sum(self.fused_parts[name].values())
                              for name in ("in_proj.weight", "conv1d.weight"))

        self.in_proj = nn.Linear(dim, in_size, bias=False)
        self.conv1d = nn.Conv1d(conv_size, conv_size, args.conv_width, groups=conv_size,
                                bias=True)
        self.A_log = nn.Parameter(torch.empty(self.n_heads, dtype=torch.float32))
        self.D = nn.Parameter(torch.empty(self.n_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(self.n_heads))
        self.norm = (GatedGroupRMSNorm(self.d_inner, group_size=self.d_inner // args.n_groups,
                                       eps=norm_eps) if args.gated_norm else None)
        # Whether the layer is Mamba2's as mamba_ssm computes it (one fused op on CUDA).
        self.plain = args.gated_norm and (args.input_multiplier, args.output_multiplier,
                                          *args.in_proj_multipliers) == (1.0,) * 7
        self.out_proj = nn.Linear(self.d_inner, dim, bias=False)

        self.conv_and_scan = ConvAndScan(args)

    def tensor_parallel_layouts(self) -> dict[str, TPLayout]:
        # Every per-channel / per-head tensor is split with the heads, including the norm
        # weight (a norm by name, but sharded).
        per_head = ("A_log", "D", "dt_bias") + (("norm.weight",) if self.norm is not None
                                                 else ())
        return {**{name: sharded(0, parts) for name, parts in self.fused_parts.items()},
                "out_proj.weight": sharded(1), **{name: sharded(0) for name in per_head}}

    def forward(self, x_BTD: torch.Tensor, layout: TokenLayout | None = None) -> torch.Tensor:
        # Local sizes derive from the local tensors, so the same code runs on a TP shard.
        n_heads = self.A_log.shape[0]
        d_inner = n_heads * self.args.head_dim
        args = self.args
        if args.input_multiplier != 1.0:
            x_BTD = x_BTD * args.input_multiplier
        zxbcdt = self.in_proj(x_BTD)
        if any(multiplier != 1.0 for multiplier in args.in_proj_multipliers):
            zxbcdt = zxbcdt * self._in_proj_scale(zxbcdt, d_inner, n_heads)
        if (self.plain and type(self.conv_and_scan) is ConvAndScan
                and mamba2_core_runs(zxbcdt)):
            # One op from in_proj's output to out_proj's input, whose backward writes in_proj's
            # gradient in place (titan_hybrid.ops.mamba_core); the same kernels as below.
            return self.out_proj(mamba2_core(
                zxbcdt, self.conv1d.weight.squeeze(1), self.conv1d.bias,
                ConvAndScan.decay_rate(self.A_log), self.D, self.dt_bias, self.norm.weight,
                seq_idx=None if layout is None else layout.seq_idx, head_dim=args.head_dim,
                state_size=args.d_state, chunk_size=args.chunk_size, dt_limit=args.dt_limit,
                norm_group_size=self.norm.group_size, norm_eps=self.norm.eps))
        z, xbc, dt = zxbcdt.split([d_inner, self.conv1d.weight.shape[0], n_heads], -1)
        y_BTHP = self.conv_and_scan(xbc, dt, self.conv1d.weight.squeeze(1), self.conv1d.bias,
                                    self.A_log, self.D, self.dt_bias, layout)
        y = y_BTHP.flatten(-2)
        out = self.out_proj(self.norm(y, z) if self.norm is not None else y * F.silu(z))
        return out if args.output_multiplier == 1.0 else out * args.output_multiplier

    def _in_proj_scale(self, zxbcdt: torch.Tensor, d_inner: int, n_heads: int) -> torch.Tensor:
        """[in_proj's width]: each component's multiplier over its (local) rows."""
        group_state = (self.conv1d.weight.shape[0] - d_inner) // 2
        sizes = (d_inner, d_inner, group_state, group_state, n_heads)
        return torch.cat([zxbcdt.new_full((size,), multiplier) for size, multiplier
                          in zip(sizes, self.args.in_proj_multipliers)])

    def init_weights(self, *, init_std: float, out_std: float) -> None:
        args = self.args
        init_linear(self.in_proj, std=init_std)
        init_linear(self.out_proj, std=out_std)
        init_depthwise_conv(self.conv1d)
        init_ssm_decay(self.A_log, self.dt_bias, a_range=args.a_init_range, dt_min=args.dt_min,
                       dt_max=args.dt_max, dt_floor=args.dt_init_floor)
        nn.init.ones_(self.D)
        if self.norm is not None:
            self.norm.init_weights()


def _validate(args: MambaArgs, dim: int) -> None:
    if args.d_inner(dim) % args.head_dim:
        raise ValueError(f"mamba: d_inner = expand*dim = {args.d_inner(dim)} is not divisible by "
                         f"mamba.head_dim={args.head_dim}")
    if args.num_heads < 0:
        raise ValueError(f"mamba: num_heads={args.num_heads} must be >= 0 (0: expand * dim / "
                         "head_dim)")
    if args.n_heads(dim) % args.n_groups:
        raise ValueError(f"mamba: nheads={args.n_heads(dim)} is not divisible by "
                         f"mamba.n_groups={args.n_groups} (each group must own whole heads)")


def _head_channels(args: MambaArgs, tensors: dict) -> HeadChannels:
    """ConvAndScan's arguments by head: the conv's channels [x | B | C] (exchanged, and its
    weight and bias rows), dt and the per-head parameters."""
    heads = tensors["A_log"].shape[0]
    groups = (tensors["xbc_BTC"].shape[-1] - heads * args.head_dim) // (2 * args.d_state)
    conv = ((args.head_dim, HEADS), (args.d_state, GROUPS), (args.d_state, GROUPS))
    per_head = ((1, HEADS),)
    return HeadChannels(heads, groups, exchanged={"xbc_BTC": conv, "dt_BTH": per_head},
                        sliced=dict(conv_weight_CW=conv, conv_bias_C=conv, A_log=per_head,
                                    D=per_head, dt_bias=per_head))


def _core_flops(args: MambaArgs, dim: int, seq_len: int) -> int:
    """SSD per head per token, forward: intra-chunk C B^T and scores @ x (2 * Q * (N + P)),
    chunk-state contribution and state read-out (2 * 2 * N * P)."""
    chunk = min(args.chunk_size, seq_len)
    return args.n_heads(dim) * (2 * chunk * (args.d_state + args.head_dim)
                                + 4 * args.d_state * args.head_dim)


KIND = LayerKind(
    symbol="M", args_type=MambaArgs,
    build=lambda args, dim, norm_eps: Mamba2Mixer(dim=dim, args=args, norm_eps=norm_eps),
    mixes_sequence=True, validate=_validate, core_flops=_core_flops,
    full_precision_params=("A_log", "D", "dt_bias"),
    tensor_parallel_sizes=lambda args, dim: [("mamba.nheads", args.n_heads(dim)),
                                             ("mamba.n_groups", args.n_groups)],
    context_parallel=ContextParallelRule(
        core="conv_and_scan",
        head_groups=lambda args, dim: (("mamba.nheads", args.n_heads(dim)),
                                       ("mamba.n_groups", args.n_groups)),
        head_channels=_head_channels),
)

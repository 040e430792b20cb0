"""Gated DeltaProduct mixer (Megatron-LM's GatedDeltaProductMixer, #6074), what `M` builds with
`hybrid.m_layers = "gdp"` (Megatron's `gdp_stack_spec`).

in_proj: hidden -> [z | V_0 .. V_{n-1} | K_0 .. K_{n-1} | Q | b_0 .. b_{n-1} | a] (Megatron's
`zVKQba`: H*P, n x H*P, n x G*N, G*N, n x H, H), n = num_householder; a depthwise causal conv
over [V.. | K.. | Q] then SiLU; q, k L2-normalised, each of the G key groups shared by its value
heads; beta_j = sigmoid(b_j); one decay per token g = -exp(A_log) * softplus(a + dt_bias) in
fp32; n Householder steps a token (ops/gated_delta_product.py); the gated group RMSNorm of
Mamba2 (norm(o * silu(z)), groups of H*P / G); out_proj. No D, no conv bias. Legend: B batch,
T time, H value heads of P channels, G key groups of N channels (Megatron's mamba_num_heads,
mamba_head_dim, mamba_num_groups, mamba_state_dim).
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
from titan_hybrid.model.recurrent import DeltaRuleCore, delta_rule_flops
from titan_hybrid.model.symbols import MIXER, LayerSymbol
from titan_hybrid.ops.gated_delta import CHUNK_SIZE
from titan_hybrid.ops.gated_delta_product import chunk_gated_delta_product


@dataclass
class GDPArgs:
    num_householder: int = 3  # Householder steps a token (Megatron's gdp_num_householder)
    d_state: int = 128  # key / query head dim N (mamba_state_dim)
    head_dim: int = 64  # value head dim P (mamba_head_dim)
    n_groups: int = 8  # key / query heads G (mamba_num_groups)
    num_heads: int = 0  # value heads H (mamba_num_heads); 0: 2 * dim / head_dim
    conv_width: int = 4
    dt_min: float = 1e-3
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    a_init_range: tuple[float, float] = (0.0, 16.0)  # Megatron's GDP default (Mamba2: 1 to 16)
    norm_eps: float = 1e-5  # the gated output norm's (Megatron fixes it)

    def n_heads(self, dim: int) -> int:
        return self.num_heads or 2 * dim // self.head_dim


def fused_component_sizes(args: GDPArgs, dim: int) -> dict[str, dict[str, int]]:
    """{fused parameter: {component: rows}}, Megatron's split keys in its order."""
    n, heads = args.num_householder, args.n_heads(dim)
    inner, group_state = heads * args.head_dim, args.n_groups * args.d_state
    conv = {**{f".V{j}": inner for j in range(n)}, **{f".K{j}": group_state for j in range(n)},
            ".Q": group_state}
    return {"in_proj.weight": {".z": inner, **conv, **{f".b{j}": heads for j in range(n)},
                               ".a": heads},
            "conv1d.weight": conv}


class ConvAndDeltaProduct(DeltaRuleCore):
    """GDP's part that runs along time (model/recurrent.py's DeltaRuleCore) with n Householder
    steps a token: the inputs of the steps interleaved along time (fla's layout), so the delta
    rule's state passing holds. `qkv_BTC` is [V.. | K.. | Q], `beta_BTH` [b_0 .. b_{n-1}],
    `alpha_BTH` the decay logit a."""

    def delta_rule_inputs(self, qkv_BTC, alpha_BTH, beta_BTH, A_log, dt_bias):
        """(q [B, T, G, N], k [B, T*n, G, N], v [B, T*n, H, P], g [B, T, H], beta [B, T*n, H])."""
        args, n, heads = self.args, self.args.num_householder, A_log.shape[0]
        inner = heads * args.head_dim
        group_state = (qkv_BTC.shape[-1] - n * inner) // (n + 1)
        values, keys, q = qkv_BTC.split([n * inner, n * group_state, group_state], -1)

        def steps(x, width):  # [B, T, n * C] -> [B, T*n, C / width, width]
            return x.unflatten(-1, (n, -1, width)).flatten(1, 2)

        g = -torch.exp(upcast(A_log)) * F.softplus(upcast(alpha_BTH) + upcast(dt_bias))
        beta = torch.sigmoid(beta_BTH).unflatten(-1, (n, heads)).flatten(1, 2)
        return (q.unflatten(-1, (-1, args.d_state)), steps(keys, args.d_state),
                steps(values, args.head_dim), g, beta)

    def delta_rule(self, q, k, v, g, beta, seq_idx, initial_state=None,
                   output_final_state=False):
        return chunk_gated_delta_product(q, k, v, g, beta, self.args.num_householder,
                                         seq_idx=seq_idx, initial_state=initial_state,
                                         output_final_state=output_final_state,
                                         use_qk_l2norm_in_kernel=True)


class GatedDeltaProductMixer(nn.Module):
    def __init__(self, *, dim: int, args: GDPArgs, norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.args = args
        heads = args.n_heads(dim)
        self.d_inner = heads * args.head_dim
        self.fused_parts = fused_component_sizes(args, dim)
        in_size, conv_size = (sum(self.fused_parts[name].values())
                              for name in ("in_proj.weight", "conv1d.weight"))
        self.in_proj = nn.Linear(dim, in_size, bias=False)
        self.conv1d = nn.Conv1d(conv_size, conv_size, args.conv_width, groups=conv_size,
                                bias=False)
        self.A_log = nn.Parameter(torch.empty(heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(heads))
        self.norm = GatedGroupRMSNorm(self.d_inner, group_size=self.d_inner // args.n_groups,
                                      eps=args.norm_eps)
        self.out_proj = nn.Linear(self.d_inner, dim, bias=False)
        self.conv_and_delta_product = ConvAndDeltaProduct(args)

    def tensor_parallel_layouts(self) -> dict[str, TPLayout]:
        # Heads and groups split; the norm's groups are whole groups of a rank's heads.
        return {**{name: sharded(0, parts) for name, parts in self.fused_parts.items()},
                "out_proj.weight": sharded(1),
                **{name: sharded(0) for name in ("A_log", "dt_bias", "norm.weight")}}

    def forward(self, x_BTD: torch.Tensor, layout: TokenLayout | None = None) -> torch.Tensor:
        heads = self.A_log.shape[0]  # local counts under TP
        inner, n = heads * self.args.head_dim, self.args.num_householder
        z, qkv, beta, alpha = self.in_proj(x_BTD).split(
            [inner, self.conv1d.weight.shape[0], n * heads, heads], -1)
        o_BTHP = self.conv_and_delta_product(qkv, alpha, beta, self.conv1d.weight.squeeze(1),
                                             self.A_log, self.dt_bias, layout)
        return self.out_proj(self.norm(o_BTHP.flatten(-2), z))

    def init_weights(self, *, init_std: float, out_std: float) -> None:
        args = self.args
        init_linear(self.in_proj, std=init_std)
        init_linear(self.out_proj, std=out_std)
        init_depthwise_conv(self.conv1d)
        init_ssm_decay(self.A_log, self.dt_bias, a_range=args.a_init_range, dt_min=args.dt_min,
                       dt_max=args.dt_max, dt_floor=args.dt_init_floor)
        self.norm.init_weights()


def _validate(args: GDPArgs, dim: int) -> None:
    if args.num_householder < 1:
        raise ValueError(f"gdp: num_householder={args.num_householder} must be >= 1 (1: GDN's "
                         "single step)")
    if args.num_heads < 0 or args.n_heads(dim) < 1:
        raise ValueError(f"gdp: num_heads={args.num_heads} must be >= 0 (0: 2 * dim / "
                         f"head_dim) and give at least one head")
    if args.n_heads(dim) % args.n_groups:
        raise ValueError(f"gdp: {args.n_heads(dim)} value heads are not divisible by "
                         f"gdp.n_groups={args.n_groups} (each group must own whole heads)")


def _head_channels(args: GDPArgs, tensors: dict) -> HeadChannels:
    """ConvAndDeltaProduct's arguments by head: [V.. | K.. | Q] over value heads (V) and key
    groups (K, Q), exchanged with the gates; the conv's rows and the per-head parameters kept."""
    n, heads = args.num_householder, tensors["A_log"].shape[0]
    groups = ((tensors["qkv_BTC"].shape[-1] - n * heads * args.head_dim)
              // ((n + 1) * args.d_state))
    qkv = ((args.head_dim, HEADS),) * n + ((args.d_state, GROUPS),) * (n + 1)
    per_head = ((1, HEADS),)
    return HeadChannels(heads, groups,
                        exchanged={"qkv_BTC": qkv, "alpha_BTH": per_head,
                                   "beta_BTH": per_head * n},
                        sliced={"conv_weight_CW": qkv, "A_log": per_head, "dt_bias": per_head})


def _core_flops(args: GDPArgs, dim: int, seq_len: int) -> int:
    """The chunked gated delta rule over the T*n rows of the steps, per value head per token:
    GDN's count (model/gdn.py) n times."""
    n = args.num_householder
    return n * args.n_heads(dim) * delta_rule_flops(args.d_state, args.head_dim,
                                                    min(CHUNK_SIZE, seq_len * n))


KIND = LayerKind(
    symbol="M", variant=LayerSymbol(symbol="M", name="gdp", title="gated DeltaProduct",
                                    namespace=MIXER),
    args_type=GDPArgs,
    build=lambda args, dim, norm_eps: GatedDeltaProductMixer(dim=dim, args=args),
    mixes_sequence=True, validate=_validate, core_flops=_core_flops,
    full_precision_params=("A_log", "dt_bias"),
    tensor_parallel_sizes=lambda args, dim: [("gdp heads", args.n_heads(dim)),
                                             ("gdp.n_groups", args.n_groups)],
    context_parallel=ContextParallelRule(
        core="conv_and_delta_product",
        head_groups=lambda args, dim: (("gdp heads", args.n_heads(dim)),
                                       ("gdp.n_groups", args.n_groups)),
        head_channels=_head_channels),
)

"""Gated DeltaNet-2 mixer (Megatron-LM's GatedDeltaNet2, #5765 on the GDN base of #5843), what
`G` builds with `g_layers = "gdn2"` (Megatron's experimental_attention_variant "gdn2").

in_proj: hidden -> [q | k | v | z | f | b | w] (Hk*K, Hk*K, Hv*V, Hv*V, Hk*K, Hk*K, Hv*V: all
full rank, Megatron's split names); a depthwise causal conv over [q | k | v] then SiLU; q, k
L2-normalised, each key head shared by its value heads; a decay per key channel
g = -exp(A_log) * softplus(f + dt_bias) (A_log one per key head, dt_bias one per key channel),
an erase gate b = sigmoid(b) per key channel and a write gate w = sigmoid(w) per value channel
(ops/gdn2.py); GDN's per-head gated RMSNorm (norm, then silu(z)); out_proj. Its args section
has GDN's fields (Megatron's linear_* config, the same for both). Legend as model/gdn.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_hybrid.model.common import (
    REPLICATED_ON_LOCAL_SHARDS,
    TPLayout,
    init_depthwise_conv,
    init_linear,
    init_ssm_decay,
    sharded,
    upcast,
)
from titan_hybrid.model.gdn import ConvAndDeltaRule, GDNArgs, delta_rule_flops
from titan_hybrid.model.layer_kind import (
    GROUPS,
    HEADS,
    ContextParallelRule,
    HeadChannels,
    LayerKind,
)
from titan_hybrid.model.layout import TokenLayout
from titan_hybrid.model.norms import HeadGatedRMSNorm
from titan_hybrid.model.symbols import SYMBOL_VARIANTS
from titan_hybrid.ops.gated_delta import CHUNK_SIZE
from titan_hybrid.ops.gdn2 import chunk_gdn2


class ConvAndGDN2Rule(ConvAndDeltaRule):
    """GDN's conv and delta-rule core (model/gdn.py) with GDN2's gates: `alpha_BTH` is f
    [B, T, Hk*K], `beta_BTH` the erase and write logits [b | w] [B, T, Hk*K + Hv*V], and
    `dt_bias` one per key channel; context parallelism wraps it as it wraps GDN's."""

    def delta_rule_inputs(self, qkv_BTC, alpha_BTH, beta_BTH, A_log, dt_bias):
        """(q, k, g, b [B, T, Hv, K], v [B, T, Hv, V], the gates (b, w)), key heads repeated
        to their value heads."""
        args = self.args
        key_heads, key_dim = A_log.shape[0], args.key_head_dim
        value_dim = qkv_BTC.shape[-1] - 2 * key_heads * key_dim
        q, k, v = qkv_BTC.split([key_heads * key_dim, key_heads * key_dim, value_dim], -1)
        erase, write = beta_BTH.split([key_heads * key_dim, value_dim], -1)
        repeat = value_dim // args.value_head_dim // key_heads

        def per_value_head(x):  # [B, T, Hk*K] -> [B, T, Hv, K]
            return x.unflatten(-1, (key_heads, key_dim)).repeat_interleave(repeat, dim=2)

        # Decay in fp32: exp of a long cumulative sum of these is taken inside the op.
        g = (-torch.exp(upcast(A_log)).repeat_interleave(key_dim)
             * F.softplus(upcast(alpha_BTH) + upcast(dt_bias)))
        gates = (per_value_head(torch.sigmoid(erase)),
                 torch.sigmoid(write).unflatten(-1, (-1, args.value_head_dim)))
        return (per_value_head(q), per_value_head(k),
                v.unflatten(-1, (-1, args.value_head_dim)), per_value_head(g), gates)

    def delta_rule(self, q, k, v, g, gates, seq_idx, initial_state=None,
                   output_final_state=False):
        erase, write = gates
        if write.shape[-1] < v.shape[-1]:  # chunkwise CP's identity columns: v = 0 there
            write = F.pad(write, (0, v.shape[-1] - write.shape[-1]))
        return chunk_gdn2(q, k, v, g, erase, write, seq_idx=seq_idx,
                          initial_state=initial_state, output_final_state=output_final_state,
                          use_qk_l2norm_in_kernel=True)


class GatedDeltaNet2(nn.Module):
    def __init__(self, *, dim: int, args: GDNArgs, norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.args = args
        key_dim = args.n_key_heads * args.key_head_dim
        value_dim = args.n_value_heads * args.value_head_dim
        in_parts = {".query": key_dim, ".key": key_dim, ".value": value_dim, ".z": value_dim,
                    ".f": key_dim, ".b": key_dim, ".w": value_dim}
        conv_parts = {".query": key_dim, ".key": key_dim, ".value": value_dim}
        self.fused_parts = {"in_proj.weight": in_parts, "conv1d.weight": conv_parts}
        in_size, conv_size = sum(in_parts.values()), sum(conv_parts.values())
        self.in_proj = nn.Linear(dim, in_size, bias=False)
        self.conv1d = nn.Conv1d(conv_size, conv_size, args.conv_width, groups=conv_size,
                                bias=False)
        self.A_log = nn.Parameter(torch.empty(args.n_key_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(key_dim))
        self.norm = HeadGatedRMSNorm(args.value_head_dim, eps=args.norm_eps or norm_eps)
        self.out_proj = nn.Linear(value_dim, dim, bias=False)
        self.conv_and_gdn2_rule = ConvAndGDN2Rule(args)

    def tensor_parallel_layouts(self) -> dict[str, TPLayout]:
        return {**{name: sharded(0, parts) for name, parts in self.fused_parts.items()},
                "out_proj.weight": sharded(1), "A_log": sharded(0), "dt_bias": sharded(0),
                "norm.weight": REPLICATED_ON_LOCAL_SHARDS}

    def forward(self, x_BTD: torch.Tensor, layout: TokenLayout | None = None) -> torch.Tensor:
        args = self.args
        key_heads = self.A_log.shape[0]  # local count under TP
        key_dim = key_heads * args.key_head_dim
        value_dim = key_heads * args.n_value_heads // args.n_key_heads * args.value_head_dim
        qkv, z, f, erase_write = self.in_proj(x_BTD).split(
            [2 * key_dim + value_dim, value_dim, key_dim, key_dim + value_dim], -1)
        o_BTHV = self.conv_and_gdn2_rule(qkv, f, erase_write, self.conv1d.weight.squeeze(1),
                                         self.A_log, self.dt_bias, layout)
        return self.out_proj(self.norm(o_BTHV, z.view_as(o_BTHV)).flatten(-2))

    def init_weights(self, *, init_std: float, out_std: float) -> None:
        init_linear(self.in_proj, std=init_std)
        init_linear(self.out_proj, std=out_std)
        init_depthwise_conv(self.conv1d)
        init_ssm_decay(self.A_log, self.dt_bias, a_range=(1.0, 16.0), dt_min=1e-3, dt_max=0.1,
                       dt_floor=1e-4)
        self.norm.init_weights()


def _validate(args: GDNArgs, dim: int) -> None:
    if args.n_value_heads % args.n_key_heads:
        raise ValueError(f"gdn2: n_value_heads={args.n_value_heads} is not divisible by "
                         f"n_key_heads={args.n_key_heads}")
    if args.allow_neg_eigval:
        raise ValueError("gdn2: allow_neg_eigval=True has no meaning for GDN2 (Megatron's "
                         "erase gate is a sigmoid)")


def _head_channels(args: GDNArgs, tensors: dict) -> HeadChannels:
    """ConvAndGDN2Rule's arguments by head: q, k, f, b and dt_bias by key head, v and w by value
    head, A_log one per key head."""
    groups = tensors["A_log"].shape[0]
    heads = ((tensors["qkv_BTC"].shape[-1] - 2 * groups * args.key_head_dim)
             // args.value_head_dim)
    key, value = (args.key_head_dim, GROUPS), (args.value_head_dim, HEADS)
    return HeadChannels(heads, groups,
                        exchanged={"qkv_BTC": (key, key, value), "alpha_BTH": (key,),
                                   "beta_BTH": (key, value)},
                        sliced={"conv_weight_CW": (key, key, value), "A_log": ((1, GROUPS),),
                                "dt_bias": (key,)})


def _core_flops(args: GDNArgs, dim: int, seq_len: int) -> int:
    """GDN's chunked count (the same products, the gates elementwise) per value head."""
    return args.n_value_heads * delta_rule_flops(args.key_head_dim, args.value_head_dim,
                                                 min(CHUNK_SIZE, seq_len))


KIND = LayerKind(
    symbol="G", variant=SYMBOL_VARIANTS["gdn2"], args_type=GDNArgs,
    build=lambda args, dim, norm_eps: GatedDeltaNet2(dim=dim, args=args, norm_eps=norm_eps),
    mixes_sequence=True, validate=_validate, core_flops=_core_flops,
    full_precision_params=("A_log", "dt_bias"),
    tensor_parallel_sizes=lambda args, dim: [("gdn2.n_key_heads", args.n_key_heads),
                                             ("gdn2.n_value_heads", args.n_value_heads)],
    context_parallel=ContextParallelRule(
        core="conv_and_gdn2_rule",
        head_groups=lambda args, dim: (("gdn2.n_value_heads", args.n_value_heads),
                                       ("gdn2.n_key_heads", args.n_key_heads)),
        head_channels=_head_channels, state_passing="delta_rule"),
)

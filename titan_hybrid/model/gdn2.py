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

from titan_hybrid.model.common import upcast
from titan_hybrid.model.gdn import GatedDeltaNet, GDNArgs, check_heads
from titan_hybrid.model.layer_kind import (
    GROUPS,
    HEADS,
    ContextParallelRule,
    HeadChannels,
    LayerKind,
)
from titan_hybrid.model.recurrent import DeltaRuleCore, delta_rule_flops
from titan_hybrid.model.symbols import SELF_ATTENTION, LayerSymbol
from titan_hybrid.ops.gated_delta import CHUNK_SIZE
from titan_hybrid.ops.gdn2 import chunk_gdn2


class ConvAndGDN2Rule(DeltaRuleCore):
    """GDN2's part that runs along time (model/recurrent.py's DeltaRuleCore) with GDN2's gates:
    `alpha_BTH` is f [B, T, Hk*K], `beta_BTH` the erase and write logits [b | w]
    [B, T, Hk*K + Hv*V], and `dt_bias` one per key channel."""

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


class GatedDeltaNet2(GatedDeltaNet):
    """GDN's layer (projections, conv, norm, TP layouts, init) with GDN2's gates."""

    core_type = ConvAndGDN2Rule

    @staticmethod
    def gate_parts(args: GDNArgs) -> dict[str, int]:
        """The decay's logit f and the erase gate b per key channel, the write gate w per value
        channel (Megatron's split names)."""
        key_dim = args.n_key_heads * args.key_head_dim
        return {".f": key_dim, ".b": key_dim, ".w": args.n_value_heads * args.value_head_dim}

    @staticmethod
    def decay_rows(args: GDNArgs) -> tuple[int, int]:
        """A_log one per key head, dt_bias one per key channel."""
        return args.n_key_heads, args.n_key_heads * args.key_head_dim

    def gate_widths(self, key_dim: int, value_dim: int) -> list[int]:
        """[f | b w]: the erase and write gates stay one piece, as the core takes them."""
        return [key_dim, key_dim + value_dim]

    @staticmethod
    def core_gates(f, erase_and_write):
        return f, erase_and_write


def _validate(args: GDNArgs, dim: int) -> None:
    check_heads(args, "gdn2")
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
    symbol="G", args_type=GDNArgs,
    variant=LayerSymbol(symbol="G", name="gdn2", title="gated DeltaNet-2",
                        namespace=SELF_ATTENTION),
    build=lambda args, dim, norm_eps: GatedDeltaNet2(dim=dim, args=args, norm_eps=norm_eps),
    mixes_sequence=True, validate=_validate, core_flops=_core_flops,
    full_precision_params=("A_log", "dt_bias"),
    tensor_parallel_sizes=lambda args, dim: [("gdn2.n_key_heads", args.n_key_heads),
                                             ("gdn2.n_value_heads", args.n_value_heads)],
    context_parallel=ContextParallelRule(
        core="conv_and_delta_rule",
        head_groups=lambda args, dim: (("gdn2.n_value_heads", args.n_value_heads),
                                       ("gdn2.n_key_heads", args.n_key_heads)),
        head_channels=_head_channels),
)

"""Gated DeltaNet mixer (Qwen3-Next / Megatron layout).

in_proj: hidden -> [q | k | v | z | beta | alpha] (Hk*K, Hk*K, Hv*V, Hv*V, Hv, Hv); depthwise
causal conv over [q | k | v] then SiLU; q, k L2-normalised, each key head shared by its value heads;
g = -exp(A_log) * softplus(alpha + dt_bias) in fp32; beta = sigmoid(beta) (times 2 with
allow_neg_eigval); gated delta rule;
per-head gated RMSNorm; out_proj. Legend: B batch, T time, Hk/Hv key/value heads, K/V head dims.
"""

from __future__ import annotations

from dataclasses import dataclass

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
from titan_hybrid.model.layer_kind import (
    GROUPS,
    HEADS,
    ContextParallelRule,
    HeadChannels,
    LayerKind,
)
from titan_hybrid.model.layout import TokenLayout
from titan_hybrid.model.norms import HeadGatedRMSNorm
from titan_hybrid.model.recurrent import DeltaRuleCore, delta_rule_flops
from titan_hybrid.ops.gated_delta import CHUNK_SIZE, chunk_gated_delta_rule


@dataclass
class GDNArgs:
    key_head_dim: int = 128
    value_head_dim: int = 128
    n_key_heads: int = 16
    n_value_heads: int = 32
    conv_width: int = 4
    # beta = 2 * sigmoid(...), so the delta rule's eigenvalues reach [-1, 1] (OLMo Hybrid's
    # linear_allow_neg_eigval; DeltaProduct / "negative eigenvalues" in fla).
    allow_neg_eigval: bool = False
    # The gated output norm's epsilon; 0: the model's norm_eps (OLMo Hybrid fixes it at 1e-5).
    norm_eps: float = 0.0


class ConvAndDeltaRule(DeltaRuleCore):
    """GDN's part that runs along time (model/recurrent.py's DeltaRuleCore): the conv over
    [q | k | v], SiLU, and the gated delta rule, per head, with the per-head parameters as
    arguments. Sizes come from the tensors (TP / CP shards)."""

    def delta_rule_inputs(self, qkv_BTC, alpha_BTH, beta_BTH, A_log, dt_bias):
        """(q, k [B, T, Hk, K], v [B, T, Hv, V], log decay g, beta [B, T, Hv]) from the conv
        output and the gates."""
        args = self.args
        n_value_heads = A_log.shape[0]
        value_dim = n_value_heads * args.value_head_dim
        key_dim = (qkv_BTC.shape[-1] - value_dim) // 2
        q, k, v = qkv_BTC.split([key_dim, key_dim, value_dim], -1)
        # Key heads stay shared by their value heads: the op reads them grouped (fla's GVA).
        q_BTHK = q.unflatten(-1, (-1, args.key_head_dim))
        k_BTHK = k.unflatten(-1, (-1, args.key_head_dim))
        v_BTHV = v.unflatten(-1, (n_value_heads, -1))
        # Decay in fp32: exp of a long cumulative sum of these is taken inside the kernel.
        g = -torch.exp(upcast(A_log)) * F.softplus(upcast(alpha_BTH) + upcast(dt_bias))
        beta = torch.sigmoid(beta_BTH)
        return q_BTHK, k_BTHK, v_BTHV, g, 2 * beta if self.args.allow_neg_eigval else beta

    def delta_rule(self, q, k, v, g, beta, seq_idx, initial_state=None,
                   output_final_state=False):
        return chunk_gated_delta_rule(q, k, v, g, beta, seq_idx=seq_idx,
                                      initial_state=initial_state,
                                      output_final_state=output_final_state,
                                      use_qk_l2norm_in_kernel=True)


class GatedDeltaNet(nn.Module):
    """GDN. A variant (GDN2, model/gdn2.py) changes the gates: `gate_parts` (in_proj's
    components after [q | k | v | z]), `decay_rows` (A_log's and dt_bias's rows), `core_type`,
    and `gate_widths` / `core_gates` (how in_proj's gate columns split into the core's gate
    logits)."""

    core_type = ConvAndDeltaRule

    @staticmethod
    def gate_parts(args: GDNArgs) -> dict[str, int]:
        """beta and the decay's logit alpha, one per value head."""
        return {".beta": args.n_value_heads, ".alpha": args.n_value_heads}

    @staticmethod
    def decay_rows(args: GDNArgs) -> tuple[int, int]:
        return args.n_value_heads, args.n_value_heads

    def gate_widths(self, key_dim: int, value_dim: int) -> list[int]:
        """Widths of the pieces in_proj's gate columns split into, from the rank's key_dim and
        value_dim (TP shards): [beta | alpha]. One split with [q | k | v] and z, so the
        backward joins the gradients with one cat."""
        heads = value_dim // self.args.value_head_dim
        return [heads, heads]

    @staticmethod
    def core_gates(beta, alpha):
        """(alpha, beta) of the core from the gate pieces."""
        return alpha, beta

    def __init__(self, *, dim: int, args: GDNArgs, norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.args = args
        key_dim = args.n_key_heads * args.key_head_dim
        value_dim = args.n_value_heads * args.value_head_dim
        in_parts = {".query": key_dim, ".key": key_dim, ".value": value_dim, ".z": value_dim,
                    **self.gate_parts(args)}
        conv_parts = {".query": key_dim, ".key": key_dim, ".value": value_dim}
        self.fused_parts = {"in_proj.weight": in_parts, "conv1d.weight": conv_parts}
        in_size, conv_size = sum(in_parts.values()), sum(conv_parts.values())

        self.in_proj = nn.Linear(dim, in_size, bias=False)
        self.conv1d = nn.Conv1d(conv_size, conv_size, args.conv_width, groups=conv_size,
                                bias=False)
        a_rows, dt_rows = self.decay_rows(args)
        self.A_log = nn.Parameter(torch.empty(a_rows, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(dt_rows))
        self.norm = HeadGatedRMSNorm(args.value_head_dim, eps=args.norm_eps or norm_eps)
        self.out_proj = nn.Linear(value_dim, dim, bias=False)

        self.conv_and_delta_rule = self.core_type(args)

    def tensor_parallel_layouts(self) -> dict[str, TPLayout]:
        # Heads split; the output norm is one weight shared by all heads, applied to each
        # rank's own heads.
        return {**{name: sharded(0, parts) for name, parts in self.fused_parts.items()},
                "out_proj.weight": sharded(1), "A_log": sharded(0), "dt_bias": sharded(0),
                "norm.weight": REPLICATED_ON_LOCAL_SHARDS}

    def forward(self, x_BTD: torch.Tensor, layout: TokenLayout | None = None) -> torch.Tensor:
        args = self.args
        value_dim = self.out_proj.weight.shape[1]  # local sizes under TP
        key_dim = (value_dim // args.value_head_dim * args.n_key_heads // args.n_value_heads
                   * args.key_head_dim)
        qkv, z, *gates = self.in_proj(x_BTD).split(
            [2 * key_dim + value_dim, value_dim, *self.gate_widths(key_dim, value_dim)], -1)
        alpha, beta = self.core_gates(*gates)
        o_BTHV = self.conv_and_delta_rule(qkv, alpha, beta, self.conv1d.weight.squeeze(1),
                                          self.A_log, self.dt_bias, layout)
        out = self.norm(o_BTHV, z.view_as(o_BTHV))
        return self.out_proj(out.flatten(-2))

    def init_weights(self, *, init_std: float, out_std: float) -> None:
        init_linear(self.in_proj, std=init_std)
        init_linear(self.out_proj, std=out_std)
        init_depthwise_conv(self.conv1d)
        init_ssm_decay(self.A_log, self.dt_bias, a_range=(1.0, 16.0), dt_min=1e-3, dt_max=0.1,
                       dt_floor=1e-4)
        self.norm.init_weights()


def check_heads(args: GDNArgs, section: str) -> None:
    """Each key head is shared by whole value heads (ValueError naming the section)."""
    if args.n_value_heads % args.n_key_heads:
        raise ValueError(f"{section}: n_value_heads={args.n_value_heads} is not divisible by "
                         f"n_key_heads={args.n_key_heads}")


def _validate(args: GDNArgs, dim: int) -> None:
    check_heads(args, "gdn")


def _core_flops(args: GDNArgs, dim: int, seq_len: int) -> int:
    return args.n_value_heads * delta_rule_flops(args.key_head_dim, args.value_head_dim,
                                                 min(CHUNK_SIZE, seq_len))


def _head_channels(args: GDNArgs, tensors: dict) -> HeadChannels:
    """ConvAndDeltaRule's arguments by head: [q | k | v] over key heads (q, k) and value
    heads (v), exchanged with alpha and beta; the conv's weight rows and the per-head
    parameters kept by value head."""
    heads = tensors["A_log"].shape[0]
    groups = ((tensors["qkv_BTC"].shape[-1] - heads * args.value_head_dim)
              // (2 * args.key_head_dim))
    qkv = ((args.key_head_dim, GROUPS), (args.key_head_dim, GROUPS), (args.value_head_dim, HEADS))
    per_head = ((1, HEADS),)
    return HeadChannels(heads, groups,
                        exchanged={"qkv_BTC": qkv, "alpha_BTH": per_head, "beta_BTH": per_head},
                        sliced={"conv_weight_CW": qkv, "A_log": per_head, "dt_bias": per_head})


KIND = LayerKind(
    symbol="G", args_type=GDNArgs,
    build=lambda args, dim, norm_eps: GatedDeltaNet(dim=dim, args=args, norm_eps=norm_eps),
    mixes_sequence=True, validate=_validate, core_flops=_core_flops,
    full_precision_params=("A_log", "dt_bias"),
    tensor_parallel_sizes=lambda args, dim: [("gdn.n_key_heads", args.n_key_heads),
                                             ("gdn.n_value_heads", args.n_value_heads)],
    context_parallel=ContextParallelRule(
        core="conv_and_delta_rule",
        head_groups=lambda args, dim: (("gdn.n_value_heads", args.n_value_heads),
                                       ("gdn.n_key_heads", args.n_key_heads)),
        head_channels=_head_channels),
)

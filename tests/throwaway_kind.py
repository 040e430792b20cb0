"""A recurrent layer kind that exists only in the tests, registered the way a new kind is
(docs/architecture.md, "Adding a recurrent kind"): its symbol, its module (this file: the
args, the mixer, its core on model/recurrent.py's contract and its KIND), its table line and
its op. Nothing under titan_hybrid/parallel names it, so when context parallelism runs it in
both modes (tests/distributed/test_context_parallel.py) the contract alone carries it.

The kind, symbol `Z`: in_proj -> [q | k | v | a], a causal conv over [q | k | v] then SiLU, and
a delta rule with a per-head decay g = -exp(A_log) * softplus(a) and a fixed write strength of
1/2, per head; out_proj. Its core takes its arguments in an order and under names of its own
(not GDN's), so a CP wrapper that bound them by position would feed it the wrong tensors. Its
op is a float64-friendly per-token loop (the layer is tiny), with packed documents and
initial / final states as the contract asks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_hybrid.model.args import HybridModelArgs
from titan_hybrid.model.common import init_depthwise_conv, init_linear, sharded, upcast
from titan_hybrid.model.layer_kind import HEADS, ContextParallelRule, HeadChannels, LayerKind
from titan_hybrid.model.layer_kinds import LAYER_KINDS
from titan_hybrid.model.layout import TokenLayout
from titan_hybrid.model.recurrent import DeltaRuleCore
from titan_hybrid.model.symbols import MIXER, SYMBOLS, LayerSymbol

SYMBOL = "Z"


@dataclass
class ThrowawayArgs:
    head_dim: int = 8
    n_heads: int = 2
    conv_width: int = 3


def sequential_delta_rule(q, k, v, g, beta, seq_idx, initial_state=None,
                          output_final_state=False):
    """The op: token by token, S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q, with q, k
    L2-normalised (q scaled by K^-1/2); the state restarts at each document start, and
    `initial_state` [B, H, K, V] enters each row's first document."""
    rows, steps, heads, key_dim = k.shape
    q = F.normalize(q, dim=-1) * key_dim ** -0.5
    k = F.normalize(k, dim=-1)
    zero = v.new_zeros(heads, key_dim, v.shape[-1])
    outputs, finals = [], []
    for row in range(rows):
        state = zero if initial_state is None else initial_state[row].to(v.dtype)
        row_outputs = []
        for t in range(steps):
            if seq_idx is not None and t and seq_idx[row, t] != seq_idx[row, t - 1]:
                state = zero
            state = state * torch.exp(g[row, t]).to(v.dtype)[:, None, None]
            read = torch.einsum("hk,hkv->hv", k[row, t], state)
            written = beta[row, t, :, None] * (v[row, t] - read)
            state = state + torch.einsum("hk,hv->hkv", k[row, t], written)
            row_outputs.append(torch.einsum("hk,hkv->hv", q[row, t], state))
        outputs.append(torch.stack(row_outputs))
        finals.append(state)
    return torch.stack(outputs), torch.stack(finals) if output_final_state else None


class ThrowawayCore(DeltaRuleCore):
    def forward(self, conv_weight_CW, qkv_BTC, A_log, a_BTH, layout: TokenLayout | None):
        seq_idx = None if layout is None else layout.seq_idx
        qkv = self.conv(qkv_BTC, conv_weight_CW, None, seq_idx)
        o, _ = self.delta_rule(*self.delta_rule_inputs(qkv, a_BTH, A_log), seq_idx)
        return o

    def delta_rule_inputs(self, qkv_BTC, a_BTH, A_log):
        q, k, v = (x.unflatten(-1, (-1, self.args.head_dim)) for x in qkv_BTC.chunk(3, -1))
        g = -torch.exp(upcast(A_log)) * F.softplus(upcast(a_BTH))
        return q, k, v, g, torch.full_like(a_BTH, 0.5)

    def delta_rule(self, q, k, v, g, beta, seq_idx, initial_state=None,
                   output_final_state=False):
        return sequential_delta_rule(q, k, v, g, beta, seq_idx, initial_state,
                                     output_final_state)


class ThrowawayMixer(nn.Module):
    def __init__(self, *, dim: int, args: ThrowawayArgs) -> None:
        super().__init__()
        self.args = args
        width = args.n_heads * args.head_dim
        self.in_proj = nn.Linear(dim, 3 * width + args.n_heads, bias=False)
        self.conv1d = nn.Conv1d(3 * width, 3 * width, args.conv_width, groups=3 * width,
                                bias=False)
        self.A_log = nn.Parameter(torch.empty(args.n_heads))
        self.out_proj = nn.Linear(width, dim, bias=False)
        self.core = ThrowawayCore(args)

    def tensor_parallel_layouts(self):
        return {"in_proj.weight": sharded(0), "conv1d.weight": sharded(0),
                "A_log": sharded(0), "out_proj.weight": sharded(1)}

    def forward(self, x_BTD: torch.Tensor, layout: TokenLayout | None = None) -> torch.Tensor:
        qkv, a = self.in_proj(x_BTD).split([self.conv1d.weight.shape[0], self.A_log.shape[0]],
                                           -1)
        o = self.core(self.conv1d.weight.squeeze(1), qkv, self.A_log, a, layout)
        return self.out_proj(o.flatten(-2))

    def init_weights(self, *, init_std: float, out_std: float) -> None:
        init_linear(self.in_proj, std=init_std)
        init_linear(self.out_proj, std=out_std)
        init_depthwise_conv(self.conv1d)
        with torch.no_grad():
            self.A_log.copy_(torch.linspace(-1.0, 1.0, self.A_log.shape[0]))


def _head_channels(args: ThrowawayArgs, tensors: dict) -> HeadChannels:
    heads = tensors["A_log"].shape[0]
    qkv, per_head = ((args.head_dim, HEADS),) * 3, ((1, HEADS),)
    return HeadChannels(heads, heads, exchanged={"qkv_BTC": qkv, "a_BTH": per_head},
                        sliced={"conv_weight_CW": qkv, "A_log": per_head})


KIND = LayerKind(
    symbol=SYMBOL, args_type=ThrowawayArgs,
    build=lambda args, dim, norm_eps: ThrowawayMixer(dim=dim, args=args),
    mixes_sequence=True,
    context_parallel=ContextParallelRule(
        core="core", head_groups=lambda args, dim: (("throwaway.n_heads", args.n_heads),) * 2,
        head_channels=_head_channels),
)


# The model args with the kind's section, `throwaway` (what its line in HybridModelArgs
# would be).
ArgsWithThrowaway = dataclasses.make_dataclass(
    "ArgsWithThrowaway",
    [("throwaway", ThrowawayArgs, dataclasses.field(default_factory=ThrowawayArgs))],
    bases=(HybridModelArgs,))


def register() -> None:
    """Register the kind in this process: its symbol and its table line (a worker process's
    call; a test in a shared process patches the tables for its own duration instead)."""
    SYMBOLS.setdefault(SYMBOL, LayerSymbol(symbol=SYMBOL, name="throwaway",
                                           title="throwaway recurrent", namespace=MIXER))
    LAYER_KINDS.setdefault(SYMBOL, KIND)

"""Kimi Delta Attention mixer (KDA: Kimi Linear, GLM-5.3-Flash; Megatron's `K`).

The gated delta rule with a forget gate per key channel (ops/kda.py). Parameter names are Kimi
Linear's checkpoint names (what transformers' KimiLinearDeltaAttention loads from):
- q_proj, k_proj, v_proj: hidden -> H*K each; q_conv1d, k_conv1d, v_conv1d: depthwise causal
  convolutions of width `conv_width`, then SiLU (run as one conv over [q | k | v]);
- the forget gate: f_a_proj (hidden -> K) and f_b_proj (K -> H*K), the low-rank projection;
  A_log [H], dt_bias [H*K]; g = -exp(A_log) * softplus(f + dt_bias) per channel, in fp32, or
  with `gate_lower_bound` < 0 (GLM-5.3-Flash's -5): g = lower_bound * sigmoid(exp(A_log) *
  (f + dt_bias)), so no step decays by more than e^lower_bound;
- b_proj: hidden -> H, beta = sigmoid(b);
- the output gate g_a_proj (hidden -> K) and g_b_proj (K -> H*K), low-rank too;
- o_norm: rms_norm(o) * weight * sigmoid(gate) over each head's channels; o_proj: H*K ->
  hidden.
q and k are L2-normalised per head, and the scale is K^-1/2. `low_rank_gates=False` gives
Megatron's dev-branch layout instead: full-rank gates f_proj (hidden -> H*K) and g_proj.
Legend: B batch, T time, H heads, K head dim (keys and values alike), C channels.
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
from titan_hybrid.model.layer_kind import HEADS, ContextParallelRule, HeadChannels, LayerKind
from titan_hybrid.model.layout import TokenLayout
from titan_hybrid.model.recurrent import DeltaRuleCore
from titan_hybrid.ops.kda import CHUNK_SIZE, chunk_kda

CONVOLVED = ("q", "k", "v")
# every Linear of either gate layout (a name the layout lacks matches nothing)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "f_proj", "g_a_proj",
               "g_b_proj", "g_proj", "b_proj", "o_proj")


@dataclass
class KDAArgs:
    head_dim: int = 128
    n_heads: int = 32
    conv_width: int = 4
    # The gates' projections through a rank of head_dim (Kimi Linear, GLM-5.3-Flash), or
    # full-rank (Megatron's dev branch).
    low_rank_gates: bool = True
    # < 0: each step's log-decay lies in [gate_lower_bound, 0] (GLM-5.3-Flash: -5; fla's
    # safe_gate); 0: unbounded (Kimi Linear).
    gate_lower_bound: float = 0.0
    # The output norm's epsilon; 0: the model's norm_eps.
    norm_eps: float = 0.0
    # Under FP8 training, keep every projection of the layer in high precision (Megatron's
    # kda_disable_fp8, from its KDA pull request 7054).
    high_precision_projections: bool = False


class SigmoidGatedHeadRMSNorm(nn.Module):
    """KDA's output norm: rms_norm(o) * weight * sigmoid(gate), over each head's channels, in
    fp32. The weight is shared by all heads, so it stays replicated under TP (its gradient a
    partial sum over the TP group)."""

    def __init__(self, head_dim: int, *, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(head_dim))

    def forward(self, o_BTHK: torch.Tensor, gate_BTHK: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(upcast(o_BTHK), (o_BTHK.shape[-1],), eps=self.eps)
        gated = normed * upcast(self.weight) * torch.sigmoid(upcast(gate_BTHK))
        return gated.to(o_BTHK.dtype)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


def _softplus(x: torch.Tensor) -> torch.Tensor:
    """softplus as elementwise primitives (transformers' form: x itself above 20). F.softplus's
    backward declares other output strides to the compiler than its CPU kernel gives when the
    incoming gradient is strided (the op's is), which breaks torch.compile's backward."""
    return torch.where(x > 20, x, torch.log1p(torch.exp(x.clamp(max=20))))


class KDAConvAndDeltaRule(DeltaRuleCore):
    """KDA's part that runs along time (model/recurrent.py's DeltaRuleCore: one causal conv
    over [q | k | v], SiLU, the delta rule): the forget gate's pre-activation f [B, T, H*K]
    comes in as `alpha_BTH`, and its decay is per key channel."""

    def delta_rule_inputs(self, qkv_BTC, alpha_BTH, beta_BTH, A_log, dt_bias):
        """(q, k [B, T, H, K], v [B, T, H, K], log-decay g [B, T, H, K], beta [B, T, H]);
        `alpha_BTH` is the forget gate's pre-activation f [B, T, H*K]."""
        # reshape, not a view: under compile the op's gradients may come back strided
        heads = (*qkv_BTC.shape[:-1], -1, self.args.head_dim)
        q, k, v = (x.reshape(heads) for x in qkv_BTC.chunk(3, -1))
        # fp32: exp of long cumulative sums of these is taken inside the op
        f = (upcast(alpha_BTH) + upcast(dt_bias)).reshape(heads)
        A = torch.exp(upcast(A_log))[:, None]  # [H, 1]
        if self.args.gate_lower_bound < 0:
            g = self.args.gate_lower_bound * torch.sigmoid(A * f)
        else:
            g = -A * _softplus(f)
        return q, k, v, g, torch.sigmoid(upcast(beta_BTH))

    def delta_rule(self, q, k, v, g, beta, seq_idx, initial_state=None,
                   output_final_state=False):
        return chunk_kda(q, k, v, g, beta, seq_idx=seq_idx, initial_state=initial_state,
                         output_final_state=output_final_state, use_qk_l2norm_in_kernel=True)


class KimiDeltaAttention(nn.Module):
    def __init__(self, *, dim: int, args: KDAArgs, norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.args = args
        width, rank = args.n_heads * args.head_dim, args.head_dim
        for name in CONVOLVED:
            self.add_module(f"{name}_proj", nn.Linear(dim, width, bias=False))
            self.add_module(f"{name}_conv1d", nn.Conv1d(width, width, args.conv_width,
                                                        groups=width, bias=False))
        if args.low_rank_gates:
            self.f_a_proj = nn.Linear(dim, rank, bias=False)
            self.f_b_proj = nn.Linear(rank, width, bias=False)
            self.g_a_proj = nn.Linear(dim, rank, bias=False)
            self.g_b_proj = nn.Linear(rank, width, bias=False)
        else:
            self.f_proj = nn.Linear(dim, width, bias=False)
            self.g_proj = nn.Linear(dim, width, bias=False)
        self.A_log = nn.Parameter(torch.empty(args.n_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(width, dtype=torch.float32))
        self.b_proj = nn.Linear(dim, args.n_heads, bias=False)
        self.o_norm = SigmoidGatedHeadRMSNorm(args.head_dim, eps=args.norm_eps or norm_eps)
        self.o_proj = nn.Linear(width, dim, bias=False)
        self.conv_and_delta_rule = KDAConvAndDeltaRule(args)

    def gate_projections(self) -> tuple[str, ...]:
        """The names of the gates' projections whose output TP splits by heads."""
        return (("f_b_proj", "g_b_proj") if self.args.low_rank_gates
                else ("f_proj", "g_proj"))

    def tensor_parallel_layouts(self) -> dict[str, TPLayout]:
        # Heads split: every projection to H*K channels, its conv, the per-head decay
        # parameters; the low-rank down-projections are replicated (as MLA's), and the output
        # norm's weight is shared by all heads.
        split = [f"{name}_proj" for name in CONVOLVED] + [f"{name}_conv1d" for name in CONVOLVED]
        split += [*self.gate_projections(), "b_proj"]
        return {**{f"{name}.weight": sharded(0) for name in split},
                "A_log": sharded(0), "dt_bias": sharded(0), "o_proj.weight": sharded(1),
                "o_norm.weight": REPLICATED_ON_LOCAL_SHARDS}

    def gates(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(forget gate pre-activation f, output gate) [B, T, H*K] each."""
        if self.args.low_rank_gates:
            return self.f_b_proj(self.f_a_proj(x_BTD)), self.g_b_proj(self.g_a_proj(x_BTD))
        return self.f_proj(x_BTD), self.g_proj(x_BTD)

    def forward(self, x_BTD: torch.Tensor, layout: TokenLayout | None = None) -> torch.Tensor:
        qkv = torch.cat([getattr(self, f"{name}_proj")(x_BTD) for name in CONVOLVED], -1)
        conv_weight = torch.cat([getattr(self, f"{name}_conv1d").weight for name in CONVOLVED])
        f, gate = self.gates(x_BTD)
        o_BTHK = self.conv_and_delta_rule(qkv, f, self.b_proj(x_BTD), conv_weight.squeeze(1),
                                          self.A_log, self.dt_bias, layout)
        out = self.o_norm(o_BTHK, gate.view_as(o_BTHK))
        return self.o_proj(out.flatten(-2))

    def init_weights(self, *, init_std: float, out_std: float) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                init_linear(module, std=out_std if module is self.o_proj else init_std)
            elif isinstance(module, nn.Conv1d):
                init_depthwise_conv(module)
        # Kimi Linear's init (transformers): A in [1, 16], dt log-uniform in [1e-3, 0.1]
        init_ssm_decay(self.A_log, self.dt_bias, a_range=(1.0, 16.0), dt_min=1e-3, dt_max=0.1,
                       dt_floor=1e-4)
        self.o_norm.init_weights()


def _validate(args: KDAArgs, dim: int) -> None:
    if not -5.0 <= args.gate_lower_bound <= 0.0:
        raise ValueError(f"kda.gate_lower_bound={args.gate_lower_bound} must lie in [-5, 0] "
                         "(0: unbounded; fla's safe gate takes [-5, 0))")


def _core_flops(args: KDAArgs, dim: int, seq_len: int) -> int:
    """The chunked delta rule per head per token, forward (ops/kda.py's matmuls): the
    intra-chunk products k k^T, q k^T with the decays inside the channel sums and the WY
    solution's products (2 * Q * (3K + 2V)), the state's update and read-out (2 * 3 * K * V);
    K = V = head_dim."""
    chunk = min(CHUNK_SIZE, seq_len)
    k = args.head_dim
    return args.n_heads * (2 * chunk * 5 * k + 6 * k * k)


def _head_channels(args: KDAArgs, tensors: dict) -> HeadChannels:
    """KDAConvAndDeltaRule's arguments by head: GDN's, with one head count for q, k and v and
    the forget gate's pre-activation (in GDN's alpha place) and dt_bias per key channel."""
    heads = tensors["A_log"].shape[0]
    per_channel, per_head = ((args.head_dim, HEADS),), ((1, HEADS),)
    return HeadChannels(heads, heads,
                        exchanged={"qkv_BTC": per_channel * 3, "alpha_BTH": per_channel,
                                   "beta_BTH": per_head},
                        sliced={"conv_weight_CW": per_channel * 3, "A_log": per_head,
                                "dt_bias": per_channel})


KIND = LayerKind(
    symbol="K", args_type=KDAArgs,
    build=lambda args, dim, norm_eps: KimiDeltaAttention(dim=dim, args=args, norm_eps=norm_eps),
    mixes_sequence=True, validate=_validate, core_flops=_core_flops,
    full_precision_params=("A_log", "dt_bias"),
    optional_high_precision_modules=lambda args: PROJECTIONS if args.high_precision_projections
    else (),
    tensor_parallel_sizes=lambda args, dim: [("kda.n_heads", args.n_heads)],
    context_parallel=ContextParallelRule(
        core="conv_and_delta_rule",
        head_groups=lambda args, dim: (("kda.n_heads", args.n_heads),
                                       ("kda.n_heads", args.n_heads)),
        head_channels=_head_channels),
)

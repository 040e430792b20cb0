"""The recurrent-core contract: what context parallelism calls on a recurrent layer's core.

A recurrent kind (its ContextParallelRule has `head_channels`) keeps the part of its mixer that
runs along time in one submodule, its core (`ContextParallelRule.core` names it), a
`RecurrentCore`. Everything per token enters the core's `forward` as an argument, and so does
everything per head or channel (conv weights, decay parameters) and every other weight it uses
(Mamba1's norm weights, which the head exchange passes whole), so that context parallelism
can cut it by sequence or by head without knowing the kind
(titan_hybrid.parallel.context_parallel and context_parallel_chunkwise). Both CP modes read the
core's arguments by NAME, never by position:

- `forward(...)`: the per-token inputs, named with a shape suffix that starts with `_BT`
  (`qkv_BTC`, `dt_BTH`: [B, T, ...]); the conv's `conv_weight_CW` (and `conv_bias_C`, where the
  conv has a bias); the per-head parameters; `layout` (TokenLayout or None) last. It returns
  [B, T, heads, head dim] (a ConvolutionCore: [B, T, channels]).
- `conv_input`: which per-token argument the causal depthwise conv (then `conv_activation`,
  SiLU unless the core says None) runs over;
  `conv(x, conv_weight_CW, conv_bias_C, seq_idx, initial_states, initial_seq_idx)` runs it,
  reading `initial_states` (the width-1 inputs before the first position) in place.
- `state_passing`: how chunkwise CP passes the state between sequence pieces, one of the
  classes below, each with the methods its algorithm calls:
  - `ScalarDecayCore` ("decay": a scalar decay per head and step, Mamba2): `scan`,
    `log_decay`, `readout`;
  - `DiagonalDecayCore` ("diagonal": a decay per channel and state entry and step, Mamba1):
    `scan` (with an initial state) and `step_sizes`;
  - `DeltaRuleCore` ("delta_rule": the delta rule's K x K transition matrices, GDN, KDA, GDP,
    GDN2): `delta_rule_inputs` and `delta_rule`; its `forward` is written here once;
  - `ConvolutionCore` ("convolution": no state beyond the conv's window, LFM2's short conv):
    the conv alone, its output [B, T, C] (channels as heads of width 1);
  - `TrapezoidalCore` ("trapezoidal": a scalar decay per head and step, each token's inputs
    taken in two shares, the second at the next token, with keys rotated by a running angle;
    Mamba-3, no conv: `conv_input` None): `angles`, `entry_weights` and `scan`.
The head exchange (mode head_a2a) calls only `forward`, with the arguments cut by the kind's
`HeadChannels` (layer_kind.py).

A new recurrent kind subclasses one of these; a new state-passing algorithm is a new class
here and its wrapper in context_parallel_chunkwise.py (STATE_PASSING). Legend: B batch, T time,
C channels, H heads, K key / V value head dims.
"""

from __future__ import annotations

import abc
import functools
import inspect
from typing import Callable, ClassVar

import torch
from torch import nn

from titan_hybrid.model.layout import TokenLayout
from titan_hybrid.ops.conv import causal_depthwise_conv1d

DECAY, DIAGONAL, DELTA_RULE, CONVOLUTION, TRAPEZOIDAL = (
    "decay", "diagonal", "delta_rule", "convolution", "trapezoidal")


def is_per_token(argument: str) -> bool:
    """Whether a core's forward argument is per token ([B, T, ...]): its shape suffix starts
    with BT."""
    return "_BT" in argument


@functools.cache
def _parameter_names(function: Callable) -> frozenset[str]:
    return frozenset(inspect.signature(function).parameters)


def call_by_name(method: Callable, named: dict, *args, **kwargs):
    """`method(*args, **kwargs)` given, as well, those of `named` whose names it declares (read
    once per function: this runs in every chunkwise layer's forward)."""
    accepted = _parameter_names(getattr(method, "__func__", method))
    return method(*args, **kwargs, **{name: value for name, value in named.items()
                                      if name in accepted and name not in kwargs})


class RecurrentCore(nn.Module, metaclass=abc.ABCMeta):
    """The contract's common part: the kind's args and its causal conv. A core lacking a
    method of its state passing cannot be built (abstract methods)."""

    state_passing: ClassVar[str]  # DECAY, DIAGONAL, DELTA_RULE or CONVOLUTION
    conv_input: ClassVar[str]  # the forward argument the conv runs over
    conv_activation: ClassVar[str | None] = "silu"  # after the conv

    def __init__(self, args) -> None:
        super().__init__()
        self.args = args

    def conv(self, x_BTC, conv_weight_CW, conv_bias_C=None, seq_idx=None, initial_states=None,
             initial_seq_idx=None):
        """SiLU(causal depthwise conv) of x; `initial_states`: the inputs before the first
        position (context parallelism's)."""
        return causal_depthwise_conv1d(x_BTC, conv_weight_CW, conv_bias_C, seq_idx=seq_idx,
                                       activation=self.conv_activation,
                                       initial_states=initial_states,
                                       initial_seq_idx=initial_seq_idx)


class ScalarDecayCore(RecurrentCore):
    """A state [H, P, N] that decays by one scalar per head and step, read out by a per-token
    [G, N] vector (SSD). The methods take the forward's other arguments by name."""

    state_passing = DECAY

    @abc.abstractmethod
    def scan(self, x_conv_BTC, seq_idx, return_final_states=False, **inputs):
        """y [B, T, H, P]; with `return_final_states`, also the state at the end of each row
        [B, H, P, N] (fp32, fp64 for fp64 inputs)."""

    @abc.abstractmethod
    def log_decay(self, dtype, **inputs) -> torch.Tensor:
        """[B, T, H]: each step's log state decay, as the scan computes it."""

    @abc.abstractmethod
    def readout(self, x_conv_BTC, **inputs) -> torch.Tensor:
        """[B, T, G, N]: what each token's output reads of the state (Mamba2's C)."""


class DiagonalDecayCore(RecurrentCore):
    """A state [C, N] that decays by its own rate per channel and state entry: each step's log
    decay is dt_t[c] * A[c, n] (Mamba1's selective scan). The methods take the forward's other
    arguments by name."""

    state_passing = DIAGONAL

    @abc.abstractmethod
    def scan(self, x_conv_BTC, seq_idx, *args, initial_state=None, return_final_state=False):
        """y [B, T, C]; `initial_state` [B, C, N] enters each row's leading document (seq_idx
        0); with `return_final_state`, also the state at the end of each row (float32, float64
        for float64 inputs)."""

    @abc.abstractmethod
    def step_sizes(self, x_conv_BTC, *args) -> tuple[torch.Tensor, torch.Tensor]:
        """(dt [B, T, C], A [C, N]) as the scan computes them: each step's log decay is
        dt[..., None] * A."""


class TrapezoidalCore(RecurrentCore):
    """A state [H, P, N] that decays by one scalar per head and step and takes token t's
    inputs (x_t k_t^T) in two shares (the exponential-trapezoidal rule): one at t, the other
    at t + 1 (weighted by that token's `first_weight`) when it is of the same document; its
    keys and read-out vectors are rotated by an angle summed from each document's start. So a
    piece of a sequence depends on what comes before it through the state, the last token's
    key and input, and the angle. No conv. The methods take the forward's other arguments by
    name."""

    state_passing = TRAPEZOIDAL
    conv_input = None

    @abc.abstractmethod
    def angles(self, seq_idx, **inputs) -> torch.Tensor:
        """theta [B, T, H, S]: the running angle, from each document's start."""

    @abc.abstractmethod
    def entry_weights(self, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(the log decay [B, T, H], `first_weight` [B, H]: what the row's first token takes
        of the token before it), as the scan computes them."""

    @abc.abstractmethod
    def scan(self, seq_idx, theta_BTHS, initial_state=None, return_final_state=False,
             **inputs):
        """y [B, T, H, P] with the keys rotated by theta; `initial_state` (h [B, H, P, N], the
        previous token's k [B, R, H, N] and x [B, R, H, P], as its rank R inputs) enters each
        row's leading document; with `return_final_state`, (y, that triple after each row's
        last token)."""


class DeltaRuleCore(RecurrentCore):
    """A conv over [q | k | v] (`qkv_BTC`), then a delta rule whose per-key-column steps are
    linear in its state [K, V]. A kind gives `delta_rule_inputs` (q, k, v and its gates from
    the conv's output and its own gate inputs) and `delta_rule` (its op)."""

    state_passing = DELTA_RULE
    conv_input = "qkv_BTC"

    def forward(self, qkv_BTC: torch.Tensor, alpha_BTH: torch.Tensor, beta_BTH: torch.Tensor,
                conv_weight_CW: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                layout: TokenLayout | None) -> torch.Tensor:
        seq_idx = None if layout is None else layout.seq_idx
        qkv = self.conv(qkv_BTC, conv_weight_CW, None, seq_idx)
        o_BTHV, _ = self.delta_rule(*self.delta_rule_inputs(qkv, alpha_BTH, beta_BTH, A_log,
                                                            dt_bias), seq_idx)
        return o_BTHV

    @abc.abstractmethod
    def delta_rule_inputs(self, qkv_BTC, alpha_BTH, beta_BTH, A_log, dt_bias):
        """(q, k, v, log decay g, gates): what `delta_rule` takes, before `seq_idx`."""

    @abc.abstractmethod
    def delta_rule(self, q, k, v, g, beta, seq_idx, initial_state=None,
                   output_final_state=False):
        """(o [B, T, H, V], the state at the end of each row or None); `initial_state`
        [B, H, K, V] enters each row's first document. Chunkwise CP appends K value columns
        (zero values, identity initial state) to read the transition out of the same scan."""


class ConvolutionCore(RecurrentCore):
    """A causal depthwise conv and nothing after it along time: its output [B, T, C] is the
    core's. Chunkwise CP needs only each piece's width-1 rows before it (no state)."""

    state_passing = CONVOLUTION
    conv_input = "x_BTC"
    conv_activation = None

    def forward(self, x_BTC: torch.Tensor, conv_weight_CW: torch.Tensor,
                conv_bias_C: torch.Tensor | None, layout: TokenLayout | None) -> torch.Tensor:
        return self.conv(x_BTC, conv_weight_CW, conv_bias_C,
                         None if layout is None else layout.seq_idx)


def delta_rule_flops(key_dim: int, value_dim: int, chunk: int) -> int:
    """Forward FLOPs of a chunked gated delta rule per head per token (ops/gated_delta.py,
    what torch's FLOP counter sees it do): intra-chunk q k^T, k k^T and the scores' product
    with the corrected values (2 * Q * (2K + V)), the UT transform's products with beta*V and
    beta*exp(G)*K (2 * Q * (K + V)), state update and read-out (2 * 3 * K * V)."""
    return 2 * chunk * (3 * key_dim + 2 * value_dim) + 6 * key_dim * value_dim

"""Context parallelism for the recurrent kinds by chunkwise state passing
(`--parallelism.context_parallel_linear_mode chunkwise`), over model/recurrent.py's contract.

Each CP rank keeps its own tokens and all of its heads. Its tokens are two contiguous pieces of
every row (zigzag, data/zigzag.py: pieces r and 2cp-1-r of 2cp). Every recurrent core is a
linear recurrence in its state S, so a piece's outputs and exit state are affine in the state S_in
that enters it:

    y = y_0 + (what S_in adds),        S_out = M S_in + S_0

where y_0 and S_0 come from running the piece from a zero state, and M is the piece's
transition: a ScalarDecayCore's total decay (a number per head, Mamba2), a DiagonalDecayCore's
(a number per channel and state entry, Mamba1), a DeltaRuleCore's product of delta-rule steps
(a K x K matrix per head, GDN and its kin), a TrapezoidalCore's total decay (Mamba-3, whose
pieces also pass their running angle and their last token's key and input). A forward runs:

1. the conv's left context: every rank all-gathers the last width-1 conv inputs of every piece,
   and each piece's conv reads those of the piece before it in row order (as its initial
   states: the conv kernel reads them in place, no copy of the piece);
2. the local scan of both pieces (stacked along the batch) from a zero state: y_0, S_0, M;
3. an all-gather of every piece's (M, S_0, whether it continues the document of the piece
   before it); every rank chains them in row order, S_in[i] = c_i (M_{i-1} S_in[i-1] +
   S_0[i-1]), and corrects its pieces' outputs. Scalar decay: y_t += C_t . (decay_t S_in),
   with decay_t the decay from the piece's start to t; delta rule: o_t += (P_t^T q_t) S_in,
   with P_t the transition from the piece's start to t; diagonal decay: the scan again, from
   S_in (in the wrappers below, one per `RecurrentCore.state_passing`).

Packed documents: a state does not cross a document start. A piece that starts a document has
c = 0; a document start inside a piece zeroes its M (the decay, or the delta-rule product,
restarts there), and the correction reaches only the tokens before the piece's first document
start. The backward is autograd's: the all-gathers' backward returns each piece's gradients to
its rank. Traffic per layer and direction: the halos (2 (width-1) rows of conv channels) and
the summaries (2 pieces x heads x (M + S)) from each rank, whatever the sequence length.
"""

from __future__ import annotations

import abc
import inspect
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from titan_hybrid.model.layout import TokenLayout
from titan_hybrid.model.recurrent import (
    CONVOLUTION,
    DECAY,
    DELTA_RULE,
    DIAGONAL,
    TRAPEZOIDAL,
    RecurrentCore,
    call_by_name,
    is_per_token,
)
from titan_hybrid.parallel.collectives import all_gather


class ZigzagPieces:
    """This rank's two pieces of every row: `stack` turns [B, 2L, ...] into [2B, L, ...]
    (slot 0 = piece r, then slot 1 = piece 2cp-1-r) and `unstack` back; `piece[slot]` is the
    piece's index in row order."""

    def __init__(self, group, local_len: int, batch: int) -> None:
        self.group, self.batch = group, batch
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.length = local_len // 2
        self.piece = (self.rank, 2 * self.cp - 1 - self.rank)

    def owner(self, piece: int) -> tuple[int, int]:
        """(rank, slot) holding piece `piece`."""
        return (piece, 0) if piece < self.cp else (2 * self.cp - 1 - piece, 1)

    def stack(self, x_BT: torch.Tensor) -> torch.Tensor:
        return x_BT.unflatten(1, (2, self.length)).transpose(0, 1).flatten(0, 1)

    def unstack(self, x_PL: torch.Tensor) -> torch.Tensor:
        return x_PL.unflatten(0, (2, self.batch)).transpose(0, 1).flatten(1, 2)

    def by_slot(self, x_P: torch.Tensor) -> torch.Tensor:
        """[2B, ...] -> [2, B, ...]."""
        return x_P.unflatten(0, (2, self.batch))

    def left_context(self, x_PLC: torch.Tensor, seq_idx_PL: torch.Tensor | None, width: int):
        """(the width-1 rows before each piece [2B, width-1, C], their seq_idx or None,
        continues [2B]: 1.0 where the piece continues the document of the row before it). The
        first piece of a row gets zero rows, whose conv taps add nothing."""
        halo = width - 1
        if halo > self.length:
            raise ValueError(f"context parallel pieces of {self.length} tokens are shorter than "
                             f"the {halo} rows before each piece that the layer reads")
        tails = all_gather(self.by_slot(x_PLC[:, self.length - halo:]), group=self.group)
        seq_tails = (None if seq_idx_PL is None else
                     all_gather(self.by_slot(seq_idx_PL[:, self.length - halo:]),
                                group=self.group))
        halos, seq_halos, continues = [], [], []
        for slot, piece in enumerate(self.piece):
            if piece == 0:
                halos.append(x_PLC.new_zeros(self.batch, halo, x_PLC.shape[-1]))
                if seq_tails is not None:
                    seq_halos.append(self.by_slot(seq_idx_PL)[slot, :, :1].expand(-1, halo))
                continues.append(torch.zeros(self.batch, device=x_PLC.device))
                continue
            rank, before = self.owner(piece - 1)
            halos.append(tails[rank, before])
            if seq_tails is None:
                continues.append(torch.ones(self.batch, device=x_PLC.device))
            else:
                seq_halos.append(seq_tails[rank, before])
                first = self.by_slot(seq_idx_PL)[slot, :, 0]
                continues.append((seq_tails[rank, before, :, -1] == first).float())
        seq_halo = None if seq_tails is None else torch.cat(seq_halos)
        return torch.cat(halos), seq_halo, torch.cat(continues)

    def with_left_context(self, x_PLC: torch.Tensor, seq_idx_PL: torch.Tensor | None,
                          width: int):
        """`left_context`'s rows prepended to each piece: (x [2B, width-1+L, C], the same for
        seq_idx, continues [2B])."""
        halo, seq_halo, continues = self.left_context(x_PLC, seq_idx_PL, width)
        seq_idx = None if seq_halo is None else torch.cat((seq_halo, seq_idx_PL), 1)
        return torch.cat((halo, x_PLC), 1), seq_idx, continues

    def conv_with_left_context(self, x_BTC: torch.Tensor, layout: TokenLayout | None,
                               width: int, conv: Callable):
        """(`conv(x, seq_idx, initial_states, initial_seq_idx)` of each piece, given the
        width-1 rows before it as its initial states [2B, L, C], the pieces' seq_idx [2B, L]
        or None, continues [2B])."""
        seq_idx = None if layout is None or layout.seq_idx is None else self.stack(
            layout.seq_idx)
        x_PLC = self.stack(x_BTC)
        halo, seq_halo, continues = self.left_context(x_PLC, seq_idx, width)
        return conv(x_PLC, seq_idx, halo, seq_halo), seq_idx, continues

    def incoming_states(self, transition_P: torch.Tensor, state_P: torch.Tensor,
                        continues_P: torch.Tensor,
                        apply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                        ) -> torch.Tensor:
        """[2B, *state]: the state entering each of this rank's pieces, from every piece's
        (transition, zero-start exit state, continues), gathered and chained in row order;
        `apply(transition, state)` is the layer's M S."""
        dtype = state_P.dtype
        summary = torch.cat((transition_P.flatten(1), state_P.flatten(1),
                             continues_P.to(dtype)[:, None]), 1)
        gathered = all_gather(self.by_slot(summary), group=self.group)  # [cp, 2, B, X]
        sizes = [transition_P[0].numel(), state_P[0].numel(), 1]
        state = state_P.new_zeros(self.batch, *state_P.shape[1:])
        incoming = {}
        for piece in range(max(self.piece) + 1):
            transition, exit_state, continues = gathered[self.owner(piece)].split(sizes, -1)
            state = state * continues.view(-1, *[1] * (state.dim() - 1))
            incoming[piece] = state
            state = (apply(transition.view_as(transition_P[:self.batch]), state)
                     + exit_state.view_as(state))
        return torch.cat([incoming[piece] for piece in self.piece])


def first_document(seq_idx_PL: torch.Tensor | None) -> torch.Tensor | None:
    """[2B, L] bool: the tokens before the piece's first document start (None: all)."""
    if seq_idx_PL is None:
        return None
    starts = seq_idx_PL[:, 1:] != seq_idx_PL[:, :-1]
    return torch.cat((torch.zeros_like(starts[:, :1]), starts), 1).cumsum(1) == 0


class ChunkwiseStatePassing(nn.Module, metaclass=abc.ABCMeta):
    """A recurrent core (model/recurrent.py) by chunkwise state passing: its forward's
    arguments are read by name, the conv input run with each piece's left context, the other
    per-token arguments stacked piece by piece, and `pass_states` (the core's algorithm) gives
    the pieces' outputs."""

    def __init__(self, core: RecurrentCore, group) -> None:
        super().__init__()
        self.core, self.group = core, group
        self.signature = inspect.signature(core.forward)

    def forward(self, *args):
        core = self.core
        named = dict(self.signature.bind(*args).arguments)
        layout = named.pop("layout")
        if core.conv_input is None:  # no conv: only whether each piece continues a document
            first = next(value for name, value in named.items() if is_per_token(name))
            pieces = ZigzagPieces(self.group, first.shape[1], first.shape[0])
            x = None
            seq_idx = None if layout is None or layout.seq_idx is None else pieces.stack(
                layout.seq_idx)
            _, _, continues = pieces.left_context(
                first.new_zeros(2 * pieces.batch, pieces.length, 1), seq_idx, 2)
        else:
            x_BTC = named.pop(core.conv_input)
            conv = {name: named.pop(name) for name in ("conv_weight_CW", "conv_bias_C")
                    if name in named}
            pieces = ZigzagPieces(self.group, x_BTC.shape[1], x_BTC.shape[0])
            x, seq_idx, continues = pieces.conv_with_left_context(
                x_BTC, layout, conv["conv_weight_CW"].shape[-1],
                lambda x, seq_idx, halo, seq_halo: call_by_name(
                    core.conv, conv, x, seq_idx=seq_idx, initial_states=halo,
                    initial_seq_idx=seq_halo))
        inputs = {name: pieces.stack(value) if is_per_token(name) else value
                  for name, value in named.items()}
        return pieces.unstack(self.pass_states(x, inputs, seq_idx, continues, pieces))

    @abc.abstractmethod
    def pass_states(self, x_conv, inputs: dict, seq_idx, continues, pieces: ZigzagPieces):
        """The stacked pieces' outputs [2B, L, ...] (the core's), with the state entering
        each."""


class ChunkwiseScalarDecay(ChunkwiseStatePassing):
    """A ScalarDecayCore (Mamba2's conv and SSD scan): M is the piece's total decay per head."""

    def pass_states(self, x_conv, inputs, seq_idx, continues, pieces):
        core = self.core
        y, exit_state = core.scan(x_conv, seq_idx, return_final_states=True,
                                  **inputs)  # y_0, S_0 [2B, H, P, N]
        # Decay from the piece's start to each token, zero past its first document start.
        decay = call_by_name(core.log_decay, inputs, exit_state.dtype).cumsum(1).exp()
        in_first = first_document(seq_idx)
        if in_first is not None:
            decay = decay * in_first[..., None]
        state_in = pieces.incoming_states(decay[:, -1], exit_state, continues.to(decay.dtype),
                                          lambda total, state: total[..., None, None] * state)
        c = call_by_name(core.readout, inputs, x_conv)  # [2B, L, G, N]
        groups = c.shape[2]
        added = torch.einsum("blgn,bgrpn->blgrp", c.to(state_in.dtype),
                             state_in.unflatten(1, (groups, -1))).flatten(2, 3)
        return y + (added * decay[..., None]).to(y.dtype)


class ChunkwiseDiagonalDecay(ChunkwiseStatePassing):
    """A DiagonalDecayCore (Mamba1's conv and selective scan): M is the piece's total decay
    per channel and state entry, exp(A * the sum of its steps). The scan takes an initial
    state, so each piece runs it twice, from a zero state (for S_0) and from S_in (its
    outputs), rather than forming a correction of [L, C, N] decays."""

    def pass_states(self, x_conv, inputs, seq_idx, continues, pieces):
        core = self.core
        # The piece's documents numbered from 0: the scan's initial state enters the first.
        local_idx = None if seq_idx is None else seq_idx - seq_idx[:, :1]
        _, exit_state = call_by_name(core.scan, inputs, x_conv, local_idx,
                                     return_final_state=True)  # S_0 [2B, C, N]
        dt, A = call_by_name(core.step_sizes, inputs, x_conv)
        transition = torch.exp(dt.sum(1)[..., None] * A).to(exit_state.dtype)
        in_first = first_document(seq_idx)
        if in_first is not None:  # a document start inside the piece: nothing gets through
            transition = transition * in_first[:, -1, None, None]
        state_in = pieces.incoming_states(transition, exit_state,
                                          continues.to(exit_state.dtype), torch.mul)
        return call_by_name(core.scan, inputs, x_conv, local_idx, initial_state=state_in)


class ChunkwiseDeltaRule(ChunkwiseStatePassing):
    """A DeltaRuleCore (GDN, KDA, GDP, GDN2). The delta rule updates each column of the state
    [K, V] on its own (the same k, beta and decay act on every value dimension), so K extra
    value columns that start as the identity and see zero values carry what the correction
    needs through the same scan: their exit state is the piece's transition M [K, K], and
    their outputs are P_t^T q_t, which turn the incoming state into each token's output
    correction."""

    def pass_states(self, x_conv, inputs, seq_idx, continues, pieces):
        core = self.core
        q, k, v, g, beta = call_by_name(core.delta_rule_inputs, inputs, x_conv)
        rows, _, value_heads, value_dim = v.shape
        key_dim = k.shape[-1]
        state_dtype = torch.promote_types(v.dtype, torch.float32)
        identity = torch.eye(key_dim, dtype=state_dtype, device=v.device)
        initial = torch.cat((identity.new_zeros(rows, value_heads, key_dim, value_dim),
                             identity.expand(rows, value_heads, key_dim, key_dim)), -1)
        o, final = core.delta_rule(q, k, torch.cat((v, v.new_zeros(*v.shape[:3], key_dim)), -1),
                                   g, beta, seq_idx, initial_state=initial,
                                   output_final_state=True)
        o, reach = o.split([value_dim, key_dim], -1)  # y_0 [2B, L, H, V]; P_t^T q_t
        # The op gives the initial state to each row's first document only, so past a
        # document start both are zero already.
        exit_state, transition = final.split([value_dim, key_dim], -1)
        state_in = pieces.incoming_states(transition, exit_state, continues.to(state_dtype),
                                          torch.matmul)
        added = torch.einsum("blhk,bhkv->blhv", reach.to(state_in.dtype), state_in)
        return o + added.to(o.dtype)


class ChunkwiseTrapezoidal(ChunkwiseStatePassing):
    """A TrapezoidalCore (Mamba-3). Two things cross a piece boundary besides the state h: the
    running angle, chained first (each piece's keys are rotated by the angle entering it plus
    its own), and the last token's key and input, whose second share the next piece's first
    token takes (its `first_weight`). Each piece's summary is (its total decay and
    first_weight; h, k and x after its last token from a zero start), and the state entering
    it is (h, k, x), chained as h' = decay (h + first_weight x k^T) + h_0. The pieces' scans
    then run again from those states, as for the diagonal decay."""

    def pass_states(self, x_conv, inputs, seq_idx, continues, pieces):
        core = self.core
        # The piece's documents numbered from 0: the scan's initial state enters the first.
        seq_idx = None if seq_idx is None else seq_idx - seq_idx[:, :1]
        theta = call_by_name(core.angles, inputs, seq_idx=seq_idx)  # [2B, L, H, S]
        in_first = first_document(seq_idx)
        # 0 where a document starts inside the piece: neither angle nor state gets through
        through = (theta.new_ones(theta.shape[0]) if in_first is None
                   else in_first[:, -1].to(theta.dtype))
        offset = pieces.incoming_states(through[:, None, None].expand_as(theta[:, -1]),
                                        theta[:, -1], continues.to(theta.dtype), torch.mul)
        reach = 1 if in_first is None else in_first[..., None, None].to(theta.dtype)
        theta = theta + offset[:, None] * reach
        _, (h0, k_last, x_last) = call_by_name(core.scan, inputs, seq_idx=seq_idx,
                                               theta_BTHS=theta, return_final_state=True)
        log_decay, first_weight = call_by_name(core.entry_weights, inputs)
        decay = log_decay.sum(1).exp() * through[:, None]  # [2B, H]
        shapes = [h0.shape[1:], k_last.shape[1:], x_last.shape[1:]]
        sizes = [h0[0].numel(), k_last[0].numel(), x_last[0].numel()]

        def split(state):  # [rows, h | k | x] -> (h, k, x)
            return [part.unflatten(1, shape) for part, shape
                    in zip(state.split(sizes, 1), shapes, strict=True)]

        def after_piece(transition, state):  # h' - h_0 = decay (h + first_weight x k^T)
            piece_decay, weight = transition.to(state.dtype).unbind(1)
            h, k, x = split(state)
            entering = h + weight[..., None, None] * torch.einsum("brhp,brhn->bhpn", x, k)
            return torch.cat(((piece_decay[..., None, None] * entering).flatten(1),
                              state.new_zeros(state.shape[0], sizes[1] + sizes[2])), 1)

        exit_state = torch.cat([part.flatten(1) for part in (h0, k_last, x_last)], 1)
        state_in = pieces.incoming_states(torch.stack((decay, first_weight), 1), exit_state,
                                          continues.to(exit_state.dtype), after_piece)
        return call_by_name(core.scan, inputs, seq_idx=seq_idx, theta_BTHS=theta,
                            initial_state=tuple(split(state_in)))


class ChunkwiseConvolution(ChunkwiseStatePassing):
    """A ConvolutionCore (LFM2's short conv): the conv with each piece's left context is all
    of it; no state passes between pieces."""

    def pass_states(self, x_conv, inputs, seq_idx, continues, pieces):
        return x_conv


# The wrapper of each state-passing algorithm a RecurrentCore declares.
STATE_PASSING: dict[str, type[ChunkwiseStatePassing]] = {
    DECAY: ChunkwiseScalarDecay,
    DIAGONAL: ChunkwiseDiagonalDecay,
    DELTA_RULE: ChunkwiseDeltaRule,
    CONVOLUTION: ChunkwiseConvolution,
    TRAPEZOIDAL: ChunkwiseTrapezoidal,
}

"""Context parallelism: each CP rank holds a zigzag shard of every sequence (data/zigzag.py).

Token-wise layers (norms, projections, MLP, MoE) need nothing, except for the statistics of a
whole sequence that enter the loss (the MoE balance loss's slot counts): each `WholeSequenceSum`
is all-reduced over the CP group, so every layout's loss is the one-process loss. The layers that mix along the
sequence get their core wrapped:

- attention, MLA, DSA: keys and values (MLA / DSA: the compressed latents and rotary keys, and
  DSA's indexer keys), with their positions / documents, are all-gathered over the CP group;
  local queries attend to them under the exact causal, in-document mask, which compares row
  positions rather than tensor indices, so the zigzag order needs no special case;
- the recurrent kinds (model/recurrent.py's cores: the kinds whose rule has head_channels),
  `context_parallel_linear_mode` "head_a2a": an all-to-all trades the
  sequence shard of every head for the whole sequence of 1/cp of the heads; the conv and the
  scan then run on complete sequences, restored to row order, and a second all-to-all trades
  back. The per-head parameters (conv channels, A_log, D, dt_bias) are sliced to the rank's
  heads, so their gradients are partial over CP and summed by data parallelism, whose mesh
  includes CP (torchtitan's "fsdp" dimension). Mode "chunkwise" (state passing between
  sequence pieces, every rank keeping all its heads): context_parallel_chunkwise.py.

The cores run between the TP regions' entry and exit, so heads here are already the TP rank's.
"""

from __future__ import annotations

import inspect
import itertools

import torch
import torch.distributed as dist
from torch import nn

from titan_hybrid.compat.collectives import traceable_all_reduce
from titan_hybrid.config.sections import ParallelismSection, section_choices
from titan_hybrid.data.zigzag import zigzag_index
from titan_hybrid.model.common import TensorParallelPartialSum, WholeSequenceSum
from titan_hybrid.model.layer_kind import GROUPS, HEADS, SHARED, ContextParallelRule
from titan_hybrid.model.layout import TokenLayout
from titan_hybrid.model.model import HybridLayer
from titan_hybrid.parallel.collectives import all_gather, all_reduce_sum, all_to_all
from titan_hybrid.parallel.context_parallel_chunkwise import STATE_PASSING
from titan_hybrid.parallel.context_parallel_compressed import ContextParallelCompressedRows
from titan_hybrid.parallel.context_parallel_window import ContextParallelWindowHalo


# --------------------------------------------------------------------------- collectives
def _gather_sequence(x_BT: torch.Tensor | None, group) -> torch.Tensor | None:
    """[B, T_local, ...] -> [B, cp * T_local, ...], rank by rank (not in row order)."""
    if x_BT is None:
        return None
    return all_gather(x_BT, group=group).transpose(0, 1).flatten(1, 2)


# --------------------------------------------------------------------------- layouts
def _require_positions(layout: TokenLayout | None) -> TokenLayout:
    if layout is None or layout.positions is None:
        raise ValueError("context parallel needs the positions of the local tokens: call the "
                         "model with positions= (and seq_idx= for packed documents)")
    return layout


def _gathered_layout(layout: TokenLayout, group) -> TokenLayout:
    """The layout of all CP ranks' tokens, rank by rank."""
    return TokenLayout(positions=_gather_sequence(layout.positions, group),
                       seq_idx=_gather_sequence(layout.seq_idx, group),
                       rope_table=layout.rope_table)


def _row_order(gathered: TokenLayout, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, inverse) [B, T]: take_along_dim(x, order) puts gathered tokens in row order."""
    order = gathered.row_order(seq_len).argsort(dim=1)
    return order, order.argsort(dim=1)


def _reorder(x_BT: torch.Tensor | None, index_BT: torch.Tensor) -> torch.Tensor | None:
    if x_BT is None:
        return None
    index = index_BT.reshape(*index_BT.shape, *([1] * (x_BT.dim() - 2)))
    return torch.take_along_dim(x_BT, index, dim=1)


# --------------------------------------------------------------------------- head split
def heads_of_rank(n_heads: int, n_groups: int, cp: int, rank: int) -> tuple[range, range]:
    """(heads, groups) that CP rank `rank` runs. Heads split evenly; groups (Mamba's B/C
    groups, GDN's key heads) split with them, or, with fewer groups than ranks, each rank takes
    the one group its heads read."""
    check_head_split("heads", n_heads, "groups", n_groups, cp)
    per_rank = n_heads // cp
    heads = range(rank * per_rank, (rank + 1) * per_rank)
    if n_groups % cp == 0:
        groups = range(rank * n_groups // cp, (rank + 1) * n_groups // cp)
    else:
        ranks_per_group = cp // n_groups
        groups = range(rank // ranks_per_group, rank // ranks_per_group + 1)
    return heads, groups


def check_head_split(heads_field: str, n_heads: int, groups_field: str, n_groups: int,
                     cp: int) -> None:
    if n_heads % cp:
        raise ValueError(f"{heads_field}={n_heads} (per tensor-parallel rank) is not divisible "
                         f"by context_parallel_degree={cp}: the all-to-all gives each CP rank "
                         "whole heads")
    if n_groups % cp and cp % n_groups:
        raise ValueError(f"{groups_field}={n_groups} (per tensor-parallel rank) and "
                         f"context_parallel_degree={cp}: one must divide the other, so that "
                         "each CP rank's heads read whole groups")


def _channels(parts: list[tuple[int, range, int]]) -> torch.Tensor:
    """Indices into fused channels: for each part (channels per head, heads taken, heads in
    the part), the channels of the heads taken, offset by the parts before."""
    pieces, offset = [], 0
    for width, taken, total in parts:
        pieces.append(offset + torch.arange(taken.start * width, taken.stop * width))
        offset += total * width
    return torch.cat(pieces)


class _SequenceToHeads:
    """Trade [B, T_local, channels] for [B, T, rank's channels] in row order, and back."""

    def __init__(self, layout: TokenLayout, group) -> None:
        self.group = group
        self.cp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        gathered = _gathered_layout(layout, group)
        seq_len = gathered.positions.shape[1]
        self.order, self.inverse = _row_order(gathered, seq_len)
        self.layout = TokenLayout(positions=_reorder(gathered.positions, self.order),
                                  seq_idx=_reorder(gathered.seq_idx, self.order),
                                  rope_table=layout.rope_table)

    def to_heads(self, x_BTC: torch.Tensor, channels_of_rank: list[torch.Tensor]) -> torch.Tensor:
        sent = torch.stack([x_BTC[..., index.to(x_BTC.device)] for index in channels_of_rank])
        received = all_to_all(sent, group=self.group)  # [source rank, B, T_local, C]
        return _reorder(received.transpose(0, 1).flatten(1, 2), self.order)

    def to_sequence(self, y_BTH: torch.Tensor) -> torch.Tensor:
        """[B, T, rank's heads, ...] -> [B, T_local, heads, ...]."""
        by_source = _reorder(y_BTH, self.inverse).unflatten(1, (self.cp, -1)).transpose(0, 1)
        received = all_to_all(by_source, group=self.group)  # [head owner, B, T_local, H, ...]
        return received.movedim(0, 2).flatten(2, 3)


# --------------------------------------------------------------------------- wrapped cores
class ContextParallelGatherCore(nn.Module):
    """A core whose local queries attend to the whole sequence: the arguments its kind's rule
    names (`ContextParallelRule.gather`: keys, values, latents) and its `key` layout are
    all-gathered over the CP group; the mask compares row positions, so zigzag needs nothing."""

    def __init__(self, core: nn.Module, group, gather: tuple[str, ...]) -> None:
        super().__init__()
        self.core, self.group = core, group
        names = list(inspect.signature(core.forward).parameters)
        self.gathered = [names.index(name) for name in gather]
        self.query_index, self.key_index = names.index("query"), names.index("key")

    def forward(self, *args):
        args = list(args)
        _require_positions(args[self.query_index])
        for index in self.gathered:
            args[index] = _gather_sequence(args[index], self.group)
        args[self.key_index] = _gathered_layout(args[self.key_index], self.group)
        return self.core(*args)


class ContextParallelHeadExchange(nn.Module):
    """A recurrent core (model/recurrent.py) on whole sequences of 1/cp of its heads: its
    kind's `ContextParallelRule.head_channels` lays out each argument's channels by head
    (HeadChannels); the per-token arguments are concatenated and sent by one all-to-all, each
    rank's share cut back into the arguments, the per-channel parameters sliced to the rank's
    heads, and the output [B, T, heads, P] traded back to the sequence shard."""

    def __init__(self, core: nn.Module, group, head_channels) -> None:
        super().__init__()
        self.core, self.group, self.head_channels = core, group, head_channels
        self.names = list(inspect.signature(core.forward).parameters)
        # A sum over the core's heads or channels (Mamba1's x_proj) holds the rank's heads'
        # share here, as under TP: summed over the CP group too.
        for module in core.modules():
            if isinstance(module, TensorParallelPartialSum):
                module.register_forward_hook(
                    lambda _module, _args, partial: all_reduce_sum(partial, group=group))

    def forward(self, *args):
        named = dict(zip(self.names, args, strict=True))
        exchange = _SequenceToHeads(_require_positions(named["layout"]), self.group)
        plan = self.head_channels(self.core.args, named)

        def channels(parts, rank: int) -> torch.Tensor:
            heads, groups = heads_of_rank(plan.heads, plan.groups, exchange.cp, rank)
            taken = {HEADS: (heads, plan.heads), GROUPS: (groups, plan.groups),
                     SHARED: (range(1), 1)}
            return _channels([(width, *taken[which]) for width, which in parts])

        streams = list(plan.exchanged)
        starts = [0, *itertools.accumulate(named[name].shape[-1] for name in streams)]

        def sent(rank: int) -> torch.Tensor:  # indices into the concatenated streams
            return torch.cat([start + channels(plan.exchanged[name], rank)
                              for start, name in zip(starts, streams)])

        received = exchange.to_heads(torch.cat([named[name] for name in streams], -1),
                                     [sent(rank) for rank in range(exchange.cp)])
        mine = [len(channels(plan.exchanged[name], exchange.rank)) for name in streams]
        named.update(zip(streams, received.split(mine, -1)))
        for name, parts in plan.sliced.items():
            named[name] = named[name][channels(parts, exchange.rank).to(named[name].device)]
        named["layout"] = exchange.layout
        return exchange.to_sequence(self.core(*named.values()))


LINEAR_MODES = section_choices(ParallelismSection)["context_parallel_linear_mode"]


def splits(rule: ContextParallelRule | None) -> bool:
    """Whether context parallelism can wrap a core with this rule (a recurrent core,
    model/recurrent.py, in either linear mode)."""
    if rule is None:
        return False
    return bool(rule.gather or rule.window_halo or rule.head_channels is not None)


def _wrapped(core: nn.Module, rule: ContextParallelRule, cp_group, linear_mode: str):
    """The kind's core wrapped as its rule says (see ContextParallelRule)."""
    if rule.gather:
        return ContextParallelGatherCore(core, cp_group, rule.gather)
    if rule.window_halo:  # DeepSeek-V4: a key halo, in both linear modes
        return ContextParallelWindowHalo(core, cp_group)
    if linear_mode == "chunkwise":  # by the algorithm the core's class declares
        return STATE_PASSING[core.state_passing](core, cp_group)
    return ContextParallelHeadExchange(core, cp_group, rule.head_channels)


def apply_context_parallel(model: nn.Module, cp_group, linear_mode: str = "head_a2a") -> None:
    """Wrap the sequence-mixing core of every layer whose kind mixes along the sequence;
    `linear_mode` picks how the recurrent cores (model/recurrent.py) are split.
    "chunkwise" needs each rank's tokens to be pieces r and 2cp-1-r of the whole row
    (`shard_batch`, what the trainer does); a row zigzagged document by document
    (`packed_zigzag_index`, the multimodal partitioner's THD layout) needs "head_a2a"."""
    if linear_mode not in LINEAR_MODES:
        raise ValueError(f"context_parallel_linear_mode '{linear_mode}' is not one of "
                         f"{list(LINEAR_MODES)}")
    for module in model.modules():
        if isinstance(module, WholeSequenceSum):
            module.register_forward_hook(
                lambda _module, _args, local_sum: traceable_all_reduce(local_sum,
                                                                       group=cp_group))
    mixers = [(kind, mixer) for layer in model.modules() if isinstance(layer, HybridLayer)
              for kind, mixer in layer.mixers() if kind.context_parallel is not None]
    for kind, mixer in mixers:
        rule = kind.context_parallel
        wrapped = _wrapped(getattr(mixer, rule.core), rule, cp_group, linear_mode)
        setattr(mixer, rule.core, wrapped)
        if rule.compressor is not None:
            ContextParallelCompressedRows.install(getattr(mixer, rule.compressor), cp_group)


def shard_batch(inputs: torch.Tensor, labels: torch.Tensor, model_kwargs: dict, cp_group):
    """This CP rank's zigzag shard of a [B, T] batch: tokens, labels, and the model's
    `positions` / `seq_idx` (positions default to 0..T-1, so the shard knows where it sits)."""
    seq_len = inputs.shape[1]
    index = zigzag_index(seq_len, dist.get_world_size(cp_group),
                         dist.get_rank(cp_group)).to(inputs.device)
    model_kwargs = dict(model_kwargs)
    model_kwargs.setdefault("positions", torch.arange(seq_len, device=inputs.device).expand_as(
        inputs))
    model_kwargs = {name: value.index_select(1, index) for name, value in model_kwargs.items()}
    return inputs.index_select(1, index), labels.index_select(1, index), model_kwargs

"""What a layer kind declares: one `LayerKind` per pattern symbol (symbols.py's SYMBOLS), and
one per variant a symbol builds under an option (layer_kinds.VARIANTS).

Each layer module ends with its `KIND`; the table `titan_hybrid.model.layer_kinds.LAYER_KINDS`
lists them. Everything that differs between kinds outside the layer's own module is read from
here: model building, shape validation, FLOPs, the TP / CP / EP rules, checkpoint keys, Hugging
Face names and the statistics a kind logs. A kind's name, title and pattern rules are its
symbol's entry in `SYMBOLS` (symbols.py), which the pattern grammar reads without importing any
layer module; a variant carries its own name and title (`LayerKind.variant`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from titan_hybrid.model.symbols import SYMBOLS, LayerSymbol


def _no_checks(section: Any, dim: int) -> None:
    return None


def _no_core(section: Any, dim: int, seq_len: int) -> int:
    return 0


def _nothing_to_split(section: Any, dim: int) -> list[tuple[str, int]]:
    return []


def _splits_anything(section: Any) -> None:
    return None


def _all_active(section: Any, dim: int) -> int:
    return 0


@dataclass(frozen=True)
class ContextParallelRule:
    """How context parallelism splits this kind's sequence-mixing core.

    `core` is the mixer's submodule that runs along the sequence; parallel/context_parallel.py
    wraps it, by what the rule says, without knowing the kind:
    - `gather`: the core's queries stay local and the arguments it names (keys, values,
      latents: [B, S, ...] tensors) are all-gathered along the sequence together with its
      `key` TokenLayout argument;
    - `head_channels` (recurrent kinds, whose core is a model/recurrent.py RecurrentCore):
      mode head_a2a trades the sequence shard of every head for the whole sequence of 1/cp of
      the heads, taking each argument's channels by the layout this function gives
      (HeadChannels); mode chunkwise passes states between sequence pieces by the algorithm
      the core's class declares (`RecurrentCore.state_passing`);
    - `window_halo`: the core reads a halo of keys before each piece (DeepSeek-V4's window).
    `head_groups(section, dim)` gives ((heads field, heads), (groups field, groups)) for the
    recurrent kinds: each CP rank takes whole groups' heads or whole heads of one group."""

    core: str
    gather: tuple[str, ...] = ()
    head_groups: Callable[[Any, int], tuple[tuple[str, int], tuple[str, int]]] | None = None
    head_channels: Callable[[Any, dict[str, torch.Tensor]], HeadChannels] | None = None
    window_halo: bool = False
    # A compressor submodule (DeepSeek-V4 `C`, `H`) whose rows every query may need, whatever
    # rank holds their tokens: parallel/context_parallel_compressed.py gathers them.
    compressor: str | None = None


HEADS, GROUPS, SHARED = "heads", "groups", "shared"


@dataclass(frozen=True)
class HeadChannels:
    """A recurrent core's arguments by head, for the head exchange (ContextParallelRule). Each
    argument it names is a run of parts, each part `(channels per head or group, HEADS or
    GROUPS)` over all `heads` or `groups` (Mamba2's B / C groups, GDN's key heads), or
    `(channels, SHARED)`, channels every head reads (Mamba-3's angles), which every rank
    receives whole: `exchanged`
    are per-token [B, T, channels] tensors, sent by all-to-all; `sliced` are per-channel
    parameters [channels, ...], of which each rank keeps its heads' rows; `whole` are the other
    arguments, which every rank takes as they are (Mamba1's dt / B / C norm weights: the norms
    act after x_proj's sum over all channels)."""

    heads: int
    groups: int
    exchanged: dict[str, tuple[tuple[int, str], ...]]
    sliced: dict[str, tuple[tuple[int, str], ...]]
    whole: tuple[str, ...] = ()


# The parallel dimensions over which a kind's statistics add up (KindStatistics.summed_over).
DATA, CONTEXT, PIPELINE = "dp", "cp", "pp"


@dataclass(frozen=True)
class KindStatistics:
    """Counters that a kind's mixer accumulates over its forwards, and what the training log
    shows of them. The mixer keeps each counter as a non-persistent buffer that every forward
    adds to; titan_hybrid.training.kind_statistics does the rest for every kind alike: it reads, reduces
    and resets them when the metrics log, and sets aside what the forwards that must not count
    added (validation passes, the pipeline's shape inference).

    `summed_over`: the parallel dimensions whose ranks' counters add up (DATA: other tokens of
    the same layers; CONTEXT: other parts of the same sequences; PIPELINE: other layers).
    `per_layer`: each layer's counters are reduced separately and `log` gets them stacked,
    [layers, *counter shape]; a rank holding no layer of the kind logs nothing of it (so
    PIPELINE cannot be in `summed_over`). Otherwise the counters are summed over the kind's
    layers first, `log` gets [*counter shape], and every rank takes part (with zeros where it
    holds no such layer). `log` maps the reduced float64 counters, by name, to the logged
    metrics ({} when there is nothing to log)."""

    counters: tuple[str, ...]  # the mixer's buffers
    summed_over: tuple[str, ...]  # of DATA, CONTEXT, PIPELINE
    per_layer: bool
    log: Callable[[dict[str, torch.Tensor]], dict[str, float]]

    def __post_init__(self) -> None:
        assert set(self.summed_over) <= {DATA, CONTEXT, PIPELINE}, self.summed_over
        assert not (self.per_layer and PIPELINE in self.summed_over), "stages hold other layers"


@dataclass(frozen=True)
class LayerKind:
    """One layer kind. `section` below is the kind's own args dataclass (`args_type`), found on
    HybridModelArgs under the kind's `name`; `dim` is the model width. `name`, `title` and
    `closes_group` are read from the symbol's entry in SYMBOLS."""

    symbol: str  # its character in the hybrid pattern, a key of SYMBOLS
    args_type: type
    build: Callable[[Any, int, float], nn.Module]  # (section, dim, norm_eps) -> mixer
    mixes_sequence: bool = False  # mixer(x, layout) instead of mixer(x)
    has_aux_loss: bool = False  # mixer returns (output, auxiliary loss)
    validate: Callable[[Any, int], None] = _no_checks  # ValueError for shapes that cannot work
    # Forward FLOPs per token of the sequence-mixing core that 6 * parameters misses.
    core_flops: Callable[[Any, int, int], int] = _no_core  # (section, dim, seq_len)
    # (field, size) pairs that the tensor-parallel degree must divide.
    tensor_parallel_sizes: Callable[[Any, int], list[tuple[str, int]]] = _nothing_to_split
    # ValueError naming an option of the section that tensor parallelism cannot split.
    validate_tensor_parallel: Callable[[Any], None] = _splits_anything
    context_parallel: ContextParallelRule | None = None  # None: token-wise, nothing to do
    # Under torch.compile a layer is one graph, unless its kind names the mixer's submodules
    # to compile on their own instead (the rest then runs eagerly): for layers whose shapes
    # depend on the data, such as MoE's tokens per expert.
    compiled_parts: tuple[str, ...] | None = None
    # ... except when the layers compute in bf16 and expert parallelism is off: then a kind
    # with this flag is one graph after all (MoE: only EP's dispatch reads its counts on the
    # host, and grouped_mm's tracing kernel takes bf16 only).
    one_graph_in_bf16: bool = False
    # Mixer parameters kept in fp32 when data parallelism computes in a lower precision
    # (`training.mixed_precision_param`): the SSM decay / skip parameters, as in mamba_ssm.
    # The layer's nn.Linear weights then form a low-precision unit of their own
    # (parallel/data_parallel.py); everything else in the layer stays fp32.
    full_precision_params: tuple[str, ...] = ()
    # The mixer's submodule of routed experts, if it has one (MoE: "experts"): expert
    # parallelism shards it over the EP ranks, data parallelism makes it a unit of its own.
    routed_experts: str | None = None
    # The mixer's submodules whose nn.Linear modules stay in high precision under FP8 training
    # (Megatron's exceptions: routers and gates, indexers and compressors, whose top-k and
    # softmax choices float8 rounding would move); quantize/float8.py.
    high_precision_modules: tuple[str, ...] = ()
    # ... and those its section keeps in high precision when asked to (KDA's
    # high_precision_projections, Megatron's kda_disable_fp8): (section) -> submodule names
    optional_high_precision_modules: Callable[[Any], tuple[str, ...]] = lambda section: ()
    # Mixer parameters a token does not use (MoE: the routed experts beyond its top_k), which
    # the FLOPs leave out of 6 * parameters.
    inactive_params: Callable[[Any, int], int] = _all_active  # (section, dim)
    statistics: KindStatistics | None = None  # counters for the training log, if any
    # A kind its symbol builds when an option says so (layer_kinds.VARIANTS, as Megatron
    # selects such mixers by a stack spec): its own name (args section), title and namespace.
    variant: LayerSymbol | None = None

    def __deepcopy__(self, memo) -> "LayerKind":
        return self  # a registry entry: copies of a model share it

    @property
    def spec(self) -> LayerSymbol:
        return self.variant or SYMBOLS[self.symbol]

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def title(self) -> str:
        return self.spec.title

    @property
    def closes_group(self) -> bool:
        return self.spec.closes_group

"""The one collector of layer-kind statistics (LayerKind.statistics, model/layer_kind.py).

A kind's mixer adds to its counters in every forward; this module alone decides what the
training log sees of them, with one rule for every kind:

- `collect` (the metrics processor, at each log): reduce each kind's counters over the ranks
  its KindStatistics names, turn them into the kind's metrics, and reset them;
- forwards that are not training steps do not count: a validation pass runs inside
  `statistics_set_aside`, which restores the counters afterwards, and the pipeline's shape
  inference run (the first step runs each stage once to learn its shapes) is followed by
  `reset_statistics` of the stage.

Finding, zeroing and setting aside the counters is model/kind_counters.py's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torchtitan.distributed import ParallelDims

from titan_hybrid.model.kind_counters import counters, statistics_layers
from titan_hybrid.model.layer_kind import CONTEXT, DATA, PIPELINE, KindStatistics, LayerKind


def reduction_groups(parallel_dims: ParallelDims | None,
                     summed_over: tuple[str, ...]) -> list[dist.ProcessGroup]:
    """The process groups over which counters summed over `summed_over` add up, in order."""
    if parallel_dims is None:
        return []
    dims = set(summed_over)
    mesh = None
    if {DATA, CONTEXT} <= dims:
        mesh = "loss" if parallel_dims.dp_cp_enabled else None
    elif DATA in dims:
        mesh = "batch" if parallel_dims.dp_enabled else None
    elif CONTEXT in dims:
        mesh = "cp" if parallel_dims.cp_enabled else None
    names = [mesh] + (["pp"] if PIPELINE in dims and parallel_dims.pp_enabled else [])
    return [parallel_dims.get_mesh(name).get_group() for name in names if name is not None]


class StatisticsCollector:
    """Reads, reduces and resets the statistics of every kind for the metrics processor."""

    def __init__(self, parallel_dims: ParallelDims | None = None) -> None:
        self.parallel_dims = parallel_dims
        self._shapes: dict[str, dict[str, torch.Size]] = {}

    def _counter_shapes(self, kind: LayerKind, model_args) -> dict[str, torch.Size]:
        """The shapes of a kind's counters, for a rank that holds none of its layers (a
        pipeline stage): from a layer built on the meta device."""
        if kind.name not in self._shapes:
            with torch.device("meta"):
                mixer = kind.build(model_args.section(kind), model_args.dim, model_args.norm_eps)
            self._shapes[kind.name] = {name: getattr(mixer, name).shape
                                       for name in kind.statistics.counters}
        return self._shapes[kind.name]

    def _reduce(self, sums: dict[str, torch.Tensor],
                spec: KindStatistics) -> dict[str, torch.Tensor]:
        groups = reduction_groups(self.parallel_dims, spec.summed_over)
        if not groups:
            return sums
        packed = torch.cat([value.flatten() for value in sums.values()])
        for group in groups:
            dist.all_reduce(packed, group=group)
        pieces = packed.split([value.numel() for value in sums.values()])
        return {name: piece.view(value.shape)
                for (name, value), piece in zip(sums.items(), pieces)}

    def collect(self, model_parts: list[nn.Module]) -> dict[str, float]:
        """Every kind's logged metrics since the last call (KindStatistics.log), and reset.

        The kinds are those of the whole model (`model_args`, the same on every rank), so
        that every rank of a reduction takes part in it, whichever layers it holds."""
        parts = list(model_parts or [])
        if not parts:
            return {}
        layers = statistics_layers(parts)
        model_args = getattr(parts[0], "model_args", None)
        if model_args is not None:
            kinds = [kind for kind in model_args.kinds() if kind.statistics is not None]
        else:  # a bare model: one stage, the kinds of its own layers
            kinds = list({id(kind): kind for kind, _ in layers}.values())
        device = next(parts[0].parameters()).device
        metrics: dict[str, float] = {}
        for kind in kinds:
            spec = kind.statistics
            own = [mixer for layer_kind, mixer in layers if layer_kind is kind]
            if spec.per_layer:
                if not own:
                    continue
                sums = {name: torch.stack([getattr(mixer, name) for mixer in own]).double()
                        for name in spec.counters}
            else:
                shapes = ({name: getattr(own[0], name).shape for name in spec.counters}
                          if own else self._counter_shapes(kind, model_args))
                sums = {name: sum((getattr(mixer, name).double() for mixer in own),
                                  torch.zeros(shape, dtype=torch.float64, device=device))
                        for name, shape in shapes.items()}
            sums = self._reduce(sums, spec)
            for mixer in own:
                for counter in counters((kind, mixer)):
                    counter.zero_()
            metrics |= spec.log(sums)
        return metrics

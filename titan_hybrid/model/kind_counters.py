"""The counters that layer kinds keep (LayerKind.statistics, model/layer_kind.py): finding the
layers that hold them, zeroing them, and setting them aside around forwards that are not
training steps. Single-device bookkeeping; training/kind_statistics.py reduces them over the
ranks and logs them.

Layers are found as HybridLayers (model/model.py) whose kind declares statistics; a bracket
group's sub-layers and the MTP depths' layers are HybridLayers too.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from titan_hybrid.model.layer_kind import LayerKind
from titan_hybrid.model.model import HybridLayer


def statistics_layers(model_parts: Iterable[nn.Module]) -> list[tuple[LayerKind, nn.Module]]:
    """(kind, mixer) of every layer's kind that declares statistics, in module order, each
    once (a parallel group's layer: each of its kinds)."""
    seen, layers = set(), []
    for part in model_parts:
        for module in part.modules():
            if isinstance(module, HybridLayer) and id(module) not in seen:
                seen.add(id(module))
                layers += [(kind, mixer) for kind, mixer in module.mixers()
                           if kind.statistics is not None]
    return layers


def counters(layer: tuple[LayerKind, nn.Module]) -> list[torch.Tensor]:
    kind, mixer = layer
    return [getattr(mixer, name) for name in kind.statistics.counters]


def reset_statistics(model_parts: Iterable[nn.Module]) -> None:
    """Zero every kind's counters (after the pipeline's shape-inference run)."""
    for layer in statistics_layers(model_parts):
        for counter in counters(layer):
            counter.zero_()


@contextmanager
def statistics_set_aside(model_parts: Iterable[nn.Module]) -> Iterator[None]:
    """Forwards inside (a validation pass) leave every kind's counters as they were."""
    saved = [(counter, counter.clone()) for layer in statistics_layers(model_parts)
             for counter in counters(layer)]
    try:
        yield
    finally:
        for counter, value in saved:
            counter.copy_(value)

"""Layout-independent weight init: initialise each unit on full tensors, keep the local shards.

On CPU, a random init applied to a sharded DTensor draws every shard from the same stream, so
the weights would depend on the layout. The model's `init_weights` seeds each unit from its
name and runs it inside the materializer the model was built with (train_spec.HybridBuild
builds it with this module's `full_tensor_materializer`, which does nothing to a unit without
DTensor parameters); the materializer swaps the
unit's DTensor parameters for plain full-size tensors during that init and then copies each
rank's own shard back. Memory stays bounded by the largest unit. A fused tensor under tensor
parallelism is initialised in its logical layout [W; V] and then interleaved into the
per-rank layout its DTensor holds (the unit's declared layouts,
model.common.tensor_parallel_layouts), so the logical weights do not depend on the TP degree.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_hybrid.model.common import tensor_parallel_layouts
from titan_hybrid.parallel.tensor_parallel import interleave_for_tp, tp_degree


@contextlib.contextmanager
def full_tensor_materializer(unit: nn.Module) -> Iterator[None]:
    swapped: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]] = []
    for module in unit.modules():
        for name, param in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            if isinstance(param, DTensor):
                full = nn.Parameter(torch.empty(param.shape, dtype=param.dtype,
                                                device=param.to_local().device),
                                    requires_grad=param.requires_grad)
                module.register_parameter(name, full)
                swapped.append((module, name, param, full))
    layout_of = {}  # id(full parameter) -> its declared layout
    if swapped:
        layouts = tensor_parallel_layouts(unit)
        layout_of = {id(param): layouts[fqn]
                     for fqn, param in unit.named_parameters(remove_duplicate=False)}
    try:
        yield
    finally:
        with torch.no_grad():
            for module, name, sharded, full in swapped:
                value = interleave_for_tp(full.detach(), layout_of[id(full)], tp_degree(sharded))
                # Every rank holds the same full tensor, so each keeps its slice without
                # communication (src_data_rank=None).
                local = distribute_tensor(value, sharded.device_mesh, sharded.placements,
                                          src_data_rank=None).to_local()
                sharded.to_local().copy_(local)
                module.register_parameter(name, sharded)

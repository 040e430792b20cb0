"""FSDP2 sharding units for HybridModel.

Units: the embedding, every top-level layer (a Mamba / attention / MLP / MoE / GDN layer, or a
whole bracket group with its sub-layers), every MTP depth, the final norm with the LM head, then
the root. A Mamba layer left in the root unit would be all-gathered for the whole step, which
defeats ZeRO-3, so each gets its own unit.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard


def sharding_units(model: nn.Module) -> list[nn.Module | list[nn.Module]]:
    """The modules that each get their own fully_shard call, root excluded, in order."""
    units: list[nn.Module | list[nn.Module]] = []
    if getattr(model, "tok_embeddings", None) is not None:
        units.append(model.tok_embeddings)
    units.extend(model.layers.values())
    units.extend(getattr(model, "mtp", []))
    if getattr(model, "norm", None) is not None and getattr(model, "output", None) is not None:
        units.append([model.norm, model.output])
    return units


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
) -> None:
    config = {"mesh": dp_mesh,
              "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)}
    if cpu_offload:
        config["offload_policy"] = CPUOffloadPolicy()
    units = sharding_units(model)
    for index, unit in enumerate(units):
        # The LM head is used right after the last layer; resharding it would only add an
        # all-gather in backward.
        is_head = index == len(units) - 1 and isinstance(unit, list)
        fully_shard(unit, **config, reshard_after_forward=reshard_after_forward and not is_head)
    fully_shard(model, **config)
    # The trainer divides the summed loss by the global token count itself.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)

"""Data-parallel sharding with Megatron's strategy names, built from PyTorch's own pieces.

| strategy             | ZeRO | parameters at rest | gradients | optimizer state | built from           |
| no_shard             | -    | full               | full      | full            | replicate (DDP)      |
| optim                | 1    | full               | full      | sharded         | replicate + ZeRO-1   |
| optim_grads          | 2    | sharded, kept      | sharded   | sharded         | fully_shard, no      |
|                      |      | gathered fwd->bwd  |           |                 | reshard after fwd    |
| optim_grads_params   | 3    | sharded            | sharded   | sharded         | fully_shard          |

Units: the embedding, every top-level layer (a Mamba / attention / MLP / MoE / GDN layer, or a
whole bracket group with its sub-layers), every MTP depth, the hyper head (with
hyper-connections), the final norm, the LM head, then the root, which holds no parameter: a
parameter of the root would be gathered from the first forward to the last backward, under
EP overlap by one microbatch's forward and the other's backward at once (the backward's
reshard freed the hyper head under the forward: a segfault). The norm and the head are two
units, not one `fully_shard([norm, head])` group: the MTP depths call the head again without
the norm, and a group's modules must run forward together (torch 2.11 runs a group's
pre-forward only for the first of its modules after the group's last post-forward, so after a
head-only call the next forward's norm found its weight still sharded). A head tied to the embedding (enable_weight_tying) makes the embedding, the
final norm and the head one group, gathered from the embedding's forward to the backward: a
parameter must be one unit's (FSDP would shard a weight shared by two units twice and keep the
copies apart). Under expert parallelism each MoE layer's experts are a unit of their own,
sharded over the ranks that hold the same experts. A Mamba layer left in the root unit would be
all-gathered for the whole step, which defeats ZeRO-3, so each gets its own unit. `replicate`
uses the same units so that gradient all-reduces start as soon as each unit's backward is done.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from titan_hybrid.compat.fsdp import replicate
from titan_hybrid.config.sections import ParallelismSection, field_choices
from titan_hybrid.model.hyper_connections import HyperConnection, HyperHead
from titan_hybrid.model.model import HybridLayer, routed_experts

SHARDING_STRATEGIES = field_choices(ParallelismSection, "data_parallel_sharding_strategy")


def sharding_units(model: nn.Module) -> list[nn.Module | list[nn.Module]]:
    """The modules that each get their own data-parallel unit, root excluded, in order."""
    embedding = getattr(model, "tok_embeddings", None)
    head = [module for module in (getattr(model, "norm", None), getattr(model, "output", None))
            if module is not None]
    hyper_head = getattr(model, "hc_head", None)
    tied = ties_head_to_embedding(model)
    units: list[nn.Module | list[nn.Module]] = []
    if embedding is not None and not tied:
        units.append(embedding)
    units.extend(model.layers.values())
    units.extend(getattr(model, "mtp", []))
    units.extend([hyper_head] if hyper_head is not None else [])
    # A tied group starts with the embedding, the first of its modules to run forward.
    units.extend([[embedding, *head]] if tied else head)
    return units


def ties_head_to_embedding(model: nn.Module) -> bool:
    output, embedding = getattr(model, "output", None), getattr(model, "tok_embeddings", None)
    return (output is not None and embedding is not None
            and output.weight is embedding.weight)


def expert_modules(model: nn.Module) -> list[nn.Module]:
    return list(routed_experts(model).values())


def full_precision_layers(unit: nn.Module | list[nn.Module]) -> list[HybridLayer]:
    """The layers in a unit with a kind that keeps some mixer parameters in fp32."""
    modules = unit if isinstance(unit, list) else [unit]
    return [layer for module in modules for layer in module.modules()
            if isinstance(layer, HybridLayer)
            and any(kind.full_precision_params for kind in layer.kinds)]


def hyper_connections(unit: nn.Module | list[nn.Module]) -> list[nn.Module]:
    """The hyper-connections and hyper heads in a unit: their weights stay fp32 (transformers
    and Megatron compute them in fp32; `pre` and Sinkhorn's `comb` from bf16 weights would
    round differently)."""
    modules = unit if isinstance(unit, list) else [unit]
    return [module for root in modules for module in root.modules()
            if isinstance(module, (HyperConnection, HyperHead))]


def apply_data_parallel(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    strategy: str,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    cpu_offload: bool = False,
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """`expert_mesh`: under expert parallelism, the ranks that hold the same experts (torchtitan's
    "efsdp"); each MoE layer's experts become their own unit sharded over it.

    With a `param_dtype` below fp32, a layer whose kind names `full_precision_params` (Mamba2's
    A_log, D, dt_bias; GDN's A_log, dt_bias) is split in two units: its nn.Linear modules
    (the projections: nearly all of its weights and FLOPs) in `param_dtype`, and the layer
    itself, holding the rest, in fp32. FSDP's policy is per unit, and a unit's parameters are
    gathered when one of its modules runs forward: the projections are called as modules,
    while the fp32 parameters are read by the mixer directly. Each hyper-connection (and hyper
    head) is an fp32 unit of its own inside its layer's."""
    if strategy not in SHARDING_STRATEGIES:
        raise ValueError(f"parallelism.data_parallel_sharding_strategy '{strategy}' is not one "
                         f"of {SHARDING_STRATEGIES}")
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    fp32_policy = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=reduce_dtype)
    split_precision = param_dtype != torch.float32
    units = sharding_units(model)
    if strategy in ("no_shard", "optim"):
        def wrap(unit, policy, reshard=None):
            replicate(unit, mesh=dp_mesh, mp_policy=policy)
    else:
        config = {"mesh": dp_mesh}
        if cpu_offload:
            config["offload_policy"] = CPUOffloadPolicy()

        def wrap(unit, policy, reshard=None):  # None: FSDP's default (the root's is off)
            fully_shard(unit, **config, mp_policy=policy, reshard_after_forward=reshard)

        if expert_mesh is not None:
            for experts in expert_modules(model):
                fully_shard(experts, **{**config, "mesh": expert_mesh}, mp_policy=mp_policy,
                            reshard_after_forward=strategy == "optim_grads_params")
    reshard = strategy == "optim_grads_params"
    head = (getattr(model, "norm", None), getattr(model, "output", None),
            getattr(model, "hc_head", None))
    for unit in units:
        # The final norm and the LM head run right after the last layer and first in backward:
        # resharding them in between would only add an all-gather.
        members = unit if isinstance(unit, list) else [unit]
        is_head = any(module is not None and module in members for module in head)
        policy = mp_policy
        for layer in full_precision_layers(unit) if split_precision else []:
            wrap([m for m in layer.modules() if isinstance(m, nn.Linear)], mp_policy, reshard)
            if layer is unit:
                policy = fp32_policy
            else:
                wrap(layer, fp32_policy, reshard)
        for connection in hyper_connections(unit) if split_precision else []:
            if connection is unit:
                policy = fp32_policy
            else:
                wrap(connection, fp32_policy, reshard)
        wrap(unit, policy, reshard and not is_head)
    wrap(model, mp_policy)
    # The trainer divides the summed loss by the global token count itself.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)

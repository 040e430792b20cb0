"""Optimizers whose weight decay skips the parameters it would harm.

The SSM dynamics (Mamba2's A_log, D, dt_bias; GDN's A_log, dt_bias), norm weights and biases
are scales and offsets: decaying them towards zero changes the model's behaviour rather than
regularising it. All of them are the parameters with fewer than two dimensions.

The builder takes the run's ParallelPlan: ZeRO-1 shards the optimizer state over its mesh, and
checkpoints split fused parameters' states by its layouts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torchtitan.components.optimizer import OptimizersContainer

from titan_hybrid.checkpoint.split import merge_state_dict
from titan_hybrid.checkpoint.state import physical_keys, split_optimizer_state
from titan_hybrid.config.sections import OptimizerSection, check_choices, field_choices
from titan_hybrid.parallel.plan import ParallelPlan
from titan_hybrid.parallel.zero1 import shard_optimizer_state

OPTIMIZER_CLASSES = {name: getattr(torch.optim, name)
                     for name in field_choices(OptimizerSection, "name")}
# torch's keyword arguments for each of optimizer.implementation's values
IMPLEMENTATIONS = {"fused": {"fused": True, "foreach": False},
                   "foreach": {"fused": False, "foreach": True},
                   "for-loop": {"fused": False, "foreach": False}}
assert set(IMPLEMENTATIONS) == set(field_choices(OptimizerSection, "implementation"))
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def _build_one(model: nn.Module, optimizer_cls, optimizer_kwargs,
               plan: ParallelPlan) -> torch.optim.Optimizer:
    optimizer = optimizer_cls(param_groups(model, optimizer_kwargs["weight_decay"]),
                              **optimizer_kwargs)
    if plan.zero1_mesh is not None:
        shard_optimizer_state(optimizer, plan.zero1_mesh)
    return optimizer


class HybridOptimizersContainer(OptimizersContainer):
    """torchtitan's optimizer container (its step, zero_grad, state-dict handling and hooks)
    over optimizers built here: one per model part, with weight-decay groups and ZeRO-1 state
    sharding.

    torchtitan's constructor builds the optimizers itself, and its signature differs between
    its versions (0.2: an optimizer class and kwargs; 0.3: a Config of regex parameter groups),
    so it is not called. This one sets up the same state: the model parts, their optimizers,
    and the container's own torch Optimizer state (where step hooks register)."""

    def __init__(self, model_parts: list[nn.Module], optimizer_cls, optimizer_kwargs,
                 plan: ParallelPlan) -> None:
        self.layouts = plan.layouts
        self.model_parts = model_parts
        self.optimizers = [_build_one(part, optimizer_cls, optimizer_kwargs, plan)
                           for part in model_parts]
        params = [p for optimizer in self.optimizers for group in optimizer.param_groups
                  for p in group["params"]]
        trainable = [p for part in model_parts for p in part.parameters() if p.requires_grad]
        assert {id(p) for p in params} == {id(p) for p in trainable}, "parameters differ"
        torch.optim.Optimizer.__init__(self, params, optimizer_kwargs)

    # The state as torch's distributed-checkpoint API flattens it, keyed by parameter names
    # (torchtitan 0.2's format; 0.3 has a format of its own), so a checkpoint moves between
    # torchtitan versions.
    def _flat_state_dict(self) -> dict[str, Any]:
        return {key: value for part, optimizer in zip(self.model_parts, self.optimizers)
                for key, value in get_optimizer_state_dict(part, optimizer,
                                                           options=FLAT).items()}

    # Checkpoints hold fused parameters' states (Adam's moments) as logical components, like
    # the parameters themselves, so they reload under any TP / FSDP layout.
    def state_dict(self) -> dict[str, Any]:
        return split_optimizer_state(self._flat_state_dict(), self.model_parts, self.layouts)[0]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # {logical key: optimizer key} of this optimizer, whatever was saved or loaded before.
        _, originals = split_optimizer_state(self._flat_state_dict(), self.model_parts,
                                             self.layouts)
        flat = merge_state_dict(physical_keys(state_dict, originals))
        for part, optimizer in zip(self.model_parts, self.optimizers):
            set_optimizer_state_dict(part, optimizer, optim_state_dict=flat, options=FLAT)


def build_hybrid_optimizers(model_parts: list[nn.Module], optimizer_config: OptimizerSection,
                            plan: ParallelPlan) -> OptimizersContainer:
    """`plan`: what parallelize returned for these parts (ParallelPlan.unparallelized for
    a model used as built)."""
    check_choices("optimizer", optimizer_config)  # a section built without a RunConfig
    kwargs = {
        "lr": optimizer_config.lr,
        "betas": (optimizer_config.beta1, optimizer_config.beta2),
        "eps": optimizer_config.eps,
        "weight_decay": optimizer_config.weight_decay,
        **IMPLEMENTATIONS[optimizer_config.implementation],
    }
    return HybridOptimizersContainer(model_parts, OPTIMIZER_CLASSES[optimizer_config.name], kwargs,
                                     plan)

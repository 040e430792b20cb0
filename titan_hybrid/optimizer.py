"""Optimizers whose weight decay skips the parameters it would harm.

A_log, D and dt_bias parametrise the SSM dynamics, and norm weights and biases are scales and
offsets: decaying them towards zero changes the model's behaviour rather than regularising it.
All of them are the parameters with fewer than two dimensions.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import Optimizer as OptimizerConfig
from torchtitan.distributed import ParallelDims

from titan_hybrid.checkpoint.split import merge_state_dict
from titan_hybrid.checkpoint.state import physical_keys, split_optimizer_state
from titan_hybrid.parallel.zero1 import shard_optimizer_state

NO_DECAY_NAMES = ("A_log", "D", "dt_bias")
OPTIMIZER_CLASSES = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}


def skips_weight_decay(name: str, param: nn.Parameter) -> bool:
    return param.ndim < 2 or name.rsplit(".", 1)[-1] in NO_DECAY_NAMES


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if skips_weight_decay(name, param) else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def _build_one(model: nn.Module, optimizer_cls, optimizer_kwargs) -> torch.optim.Optimizer:
    optimizer = optimizer_cls(param_groups(model, optimizer_kwargs["weight_decay"]),
                              **optimizer_kwargs)
    zero1_mesh = getattr(model, "zero1_mesh", None)  # set by the `optim` strategy
    if zero1_mesh is not None:
        shard_optimizer_state(optimizer, zero1_mesh)
    return optimizer


class HybridOptimizersContainer(OptimizersContainer):
    def __init__(self, model_parts: list[nn.Module], optimizer_cls, optimizer_kwargs) -> None:
        # torchtitan's constructor calls `optimizer_cls(params, **kwargs)` once per model part,
        # in order, with that part's trainable parameters. It is handed a builder that makes
        # each part's optimizer with weight-decay groups (and ZeRO-1 state sharding) instead.
        parts = iter(model_parts)

        def build(params, **kwargs) -> torch.optim.Optimizer:
            optimizer = _build_one(next(parts), optimizer_cls, kwargs)
            grouped = [p for group in optimizer.param_groups for p in group["params"]]
            assert {id(p) for p in grouped} == {id(p) for p in params}, "parameters differ"
            return optimizer

        super().__init__(model_parts, build, optimizer_kwargs)

    # Checkpoints hold fused parameters' states (Adam's moments) as logical components, like
    # the parameters themselves, so they reload under any TP / FSDP layout.
    def state_dict(self) -> dict[str, Any]:
        return split_optimizer_state(super().state_dict(), self.model_parts)[0]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # {logical key: optimizer key} of this optimizer, whatever was saved or loaded before.
        _, originals = split_optimizer_state(super().state_dict(), self.model_parts)
        super().load_state_dict(merge_state_dict(physical_keys(state_dict, originals)))


def build_hybrid_optimizers(model_parts: list[nn.Module], optimizer_config: OptimizerConfig,
                            parallel_dims: ParallelDims, ft_manager=None) -> OptimizersContainer:
    if optimizer_config.name not in OPTIMIZER_CLASSES:
        raise ValueError(f"optimizer.name '{optimizer_config.name}' is not one of "
                         f"{sorted(OPTIMIZER_CLASSES)}")
    if optimizer_config.early_step_in_backward:
        raise ValueError("optimizer.early_step_in_backward is not supported by titan_hybrid")
    implementation = optimizer_config.implementation
    kwargs = {
        "lr": optimizer_config.lr,
        "betas": (optimizer_config.beta1, optimizer_config.beta2),
        "eps": optimizer_config.eps,
        "weight_decay": optimizer_config.weight_decay,
        "fused": implementation == "fused",
        "foreach": implementation == "foreach",
    }
    return HybridOptimizersContainer(model_parts, OPTIMIZER_CLASSES[optimizer_config.name], kwargs)

"""Activation checkpointing internals. Checked on torch 2.11 and 2.13-2.15.

Private names:
- `torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper`: the module
  wrapper that runs a module's forward under `torch.utils.checkpoint` (non-reentrant), with a
  `context_fn` for selective checkpointing, and whose state dict keeps the wrapped module's
  names (it strips its own level). torch has no public module wrapper, and a wrapper of our own
  would rename every parameter under it: FSDP2 units, the optimizer state and checkpoint keys
  would all differ from the unwrapped model. torchtitan wraps layers with it too.
- `torch._functorch.config.activation_memory_budget` (and its pareto settings): the
  memory-budget mode of compiled activation checkpointing is a functorch setting, process-wide.
- `torch._C._dynamo.eval_frame._set_lru_cache`: checkpointed layers under compile keep the
  compiled frames of every layer instead of the most recent one (torchtitan's setting, made for
  the same reason: otherwise each layer recompiles).
"""

from __future__ import annotations

import torch
import torch._functorch.config as functorch_config
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import titan_hybrid.compat  # noqa: F401  (the version check)

__all__ = ["checkpoint_wrapper", "keep_compiled_frames_of_every_layer",
           "set_activation_memory_budget"]


def set_activation_memory_budget(budget: float, pareto_folder: str | None) -> None:
    """Compiled graphs save activations up to `budget` (0: recompute all, 1: save all);
    `pareto_folder`: where to draw the memory / recompute pareto front, if anywhere."""
    functorch_config.activation_memory_budget = budget
    if pareto_folder:
        functorch_config.memory_budget_pareto_dir = pareto_folder
        functorch_config.visualize_memory_budget_pareto = True


def keep_compiled_frames_of_every_layer() -> None:
    torch._C._dynamo.eval_frame._set_lru_cache(False)

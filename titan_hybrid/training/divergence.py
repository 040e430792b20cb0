"""Stop a diverged run before it does harm.

After the last microbatch's backward of a step, and before gradient clipping, the optimizer step
or any checkpoint of that state, every rank contributes its loss and the squared norm of its
local gradients to one all-gather. If any value is NaN or infinite (on any rank: any data-parallel
shard, tensor-parallel slice or pipeline stage) every rank raises DivergedError for that step.

The check runs before clipping on purpose: clipping multiplies the gradients by
max_norm / total_norm, so finite gradients whose norm overflows to inf become all-zero gradients
that look healthy (and Adam would still move the weights with its moments).
Megatron checks loss and gradients for NaN by default in the same place.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from titan_hybrid.runtime.errors import DivergedError


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_grad_square_norm(model_parts: list[nn.Module]) -> torch.Tensor:
    """Sum of squares of this rank's gradient entries (NaN / inf propagate)."""
    grads = [_local(p.grad) for part in model_parts for p in part.parameters()
             if p.grad is not None]
    grads = [g for g in grads if g.numel()]
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    return torch.nn.utils.get_total_norm(grads, foreach=True).double().square()


class DivergenceGuard:
    """Collects a step's microbatch losses; `check(step)` raises if anything is not finite."""

    def __init__(self, model_parts: list[nn.Module], microbatches_per_step: int) -> None:
        self.model_parts = model_parts
        self.microbatches_per_step = microbatches_per_step
        self._losses: list[torch.Tensor] = []

    def after_microbatch(self, loss: torch.Tensor, step: int) -> None:
        """Call with each microbatch's loss; checks the step after its last microbatch."""
        self._losses.append(_local(loss.detach()).double().sum())
        if len(self._losses) == self.microbatches_per_step:
            local_loss = torch.stack(self._losses).sum()
            self._losses = []
            self.check(step, local_loss)

    def check(self, step: int, local_loss: torch.Tensor) -> None:
        # On the loss's device: NCCL gathers device tensors, gloo CPU ones.
        values = torch.stack([local_loss,
                              local_grad_square_norm(self.model_parts).to(local_loss.device)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            every_rank = [torch.empty_like(values) for _ in range(dist.get_world_size())]
            dist.all_gather(every_rank, values)
        else:
            every_rank = [values]
        problems = []
        for rank, (loss, grad_square) in enumerate(torch.stack(every_rank).tolist()):
            if not math.isfinite(loss):
                problems.append(f"loss = {loss} on rank {rank}")
            if not math.isfinite(grad_square):
                norm = "nan" if math.isnan(grad_square) else "inf"
                problems.append(f"gradient norm = {norm} on rank {rank}")
        if problems:
            shown = "; ".join(problems[:4]) + (" ..." if len(problems) > 4 else "")
            raise DivergedError(
                f"training diverged at step {step}: {shown}. The step was not applied and "
                "nothing of it was saved; restart from the last checkpoint with a lower "
                "optimizer.lr, a longer lr_scheduler.warmup_steps or a smaller "
                "training.max_norm")

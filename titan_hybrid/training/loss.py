"""Training loss: token cross-entropy + MoE load-balancing loss + MTP losses.

torchtitan's trainer divides whatever the loss function returns by the number of valid label
tokens in the whole global batch. Cross-entropy is therefore returned as a SUM, and the per-batch
auxiliary loss is multiplied by this microbatch's valid-token count, which makes the aux term a
token-weighted mean over microbatches and data-parallel ranks.

The load-balancing loss itself is computed per microbatch (routing statistics of its tokens),
as in Megatron; being nonlinear in the batch, it makes MoE loss curves layout-independent only
for a fixed local batch size (the data-parallel degree and accumulation may still change).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torchtitan.components.loss import IGNORE_INDEX

from titan_hybrid.config.sections import CompileSection


def _cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1),
                           reduction="sum", ignore_index=IGNORE_INDEX)


def shift_labels(labels: torch.Tensor, depth: int) -> torch.Tensor:
    """Targets of MTP depth k: the label k positions later; the last k positions have none."""
    return F.pad(labels[:, depth:], (0, depth), value=IGNORE_INDEX)


def hybrid_loss(pred, labels: torch.Tensor, *, mtp_loss_coeff: float = 0.1) -> torch.Tensor:
    if isinstance(pred, torch.Tensor):
        return _cross_entropy_sum(pred, labels)
    logits, aux_loss, *mtp_logits = pred
    loss = _cross_entropy_sum(logits, labels)
    loss = loss + aux_loss * (labels != IGNORE_INDEX).sum()
    if mtp_logits:
        mtp_sum = sum(_cross_entropy_sum(depth_logits, shift_labels(labels, depth))
                      for depth, depth_logits in enumerate(mtp_logits, start=1))
        loss = loss + mtp_loss_coeff / len(mtp_logits) * mtp_sum
    return loss


def build_hybrid_loss(compile_config: CompileSection, *, mtp_loss_coeff: float):
    """`mtp_loss_coeff`: the run's model args'."""
    loss_fn = partial(hybrid_loss, mtp_loss_coeff=mtp_loss_coeff)
    if compile_config.enable and "loss" in compile_config.components:
        loss_fn = torch.compile(loss_fn, backend=compile_config.backend)
    return loss_fn

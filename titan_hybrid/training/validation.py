"""`--validation.enable`: held-out loss and perplexity, the same value under every layout.

What is measured: the next-token cross-entropy of the main LM head, averaged over every valid
label token of the validation windows (a token-weighted mean), and its exp, the perplexity.
MoE / MTP models return (logits, aux_loss, *mtp_logits); the load-balancing term is a training
regularizer and the MTP heads predict tokens further ahead, so neither belongs to the quantity
perplexity is defined for, and neither is in the validation loss (the training loss has both).

The windows come from titan_hybrid's layout-independent loader (data/loader.py): global batches
of `validation.local_batch_size` windows per data-parallel rank, `validation.seq_len` tokens
each, restarted for every pass, so every call evaluates the same windows, and every layout with
the same global validation batch (local batch x data-parallel degree) evaluates the same ones.
`validation.steps` caps the number of global batches; -1 takes them all (every rank counts the
same global batches, so no rank waits for another).

Batches go through the trainer's own preprocessing (packed-document layout with
hybrid.document_masking, then this rank's context-parallel shard). Under pipeline parallelism
the schedule's loss function is the trainer's GlobalTokenScaledLoss (parallel/pipeline.py); a
pass swaps in this module's summed loss with a token count of 1, then restores both. Sums and
token counts are added up in float64 over the data / context-parallel ranks and then over the
pipeline stages (only the last stage holds them; the others add zeros).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.hf_datasets import text_datasets
from torchtitan.tools import utils
from torchtitan.tools.logging import logger

from titan_hybrid.compat import pipelining
from titan_hybrid.data.loader import (
    PYDOC_DATASET,
    build_validation_dataloader,
    validation_dataset_name,
)
from titan_hybrid.data.local_files import check_corpus, is_local_path
from titan_hybrid.model.kind_counters import statistics_set_aside
from titan_hybrid.parallel.pipeline import scaled_loss_of
from titan_hybrid.runtime.errors import JobError
from titan_hybrid.training.batch import prepare_batch
from titan_hybrid.training.run_config import RunConfig


def next_token_loss_sum(pred, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of the main head's logits (see the module docstring)."""
    logits = pred if isinstance(pred, torch.Tensor) else pred[0]
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum",
                           ignore_index=IGNORE_INDEX)
    # Under loss parallelism (TP) the logits and the loss are DTensors.
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss


def validate_validation_config(run: RunConfig) -> None:
    """Bad validation fields as ValueError, checked before any process group exists."""
    v, p = run.validation, run.parallelism
    if not v.enable:
        return
    for field in ("freq", "local_batch_size", "seq_len"):
        if getattr(v, field) < 1:
            raise ValueError(f"validation.{field}={getattr(v, field)} must be >= 1")
    if v.steps != -1 and v.steps < 1:
        raise ValueError(f"validation.steps={v.steps} must be -1 (the whole validation set) "
                         "or >= 1")
    if v.seq_len > run.training.seq_len:
        raise ValueError(f"validation.seq_len={v.seq_len} must be <= training.seq_len="
                         f"{run.training.seq_len}: the model's positions are built for the "
                         "training windows")
    name = validation_dataset_name(run.validation, run.data)
    if name != PYDOC_DATASET and name not in text_datasets.DATASETS:
        raise ValueError(f"validation.dataset '{v.dataset}' is unknown: use '{PYDOC_DATASET}' "
                         f"(the held-out documents) or one of torchtitan's datasets "
                         f"{sorted(text_datasets.DATASETS)}")
    if is_local_path(v.dataset_path):
        check_corpus("validation.dataset_path", v.dataset_path)
    tp, cp = p.tensor_parallel_degree, p.context_parallel_degree
    sp = tp if tp > 1 and not p.disable_sequence_parallel else 1
    chunks = 2 * cp * sp if cp > 1 else sp
    if v.seq_len % chunks:
        raise ValueError(
            f"validation.seq_len={v.seq_len} is not divisible by {chunks} = "
            + (f"2 * context_parallel_degree({cp})" if cp > 1 else "")
            + (" * " if cp > 1 and sp > 1 else "")
            + (f"tensor_parallel_degree({tp}) (sequence parallel)" if sp > 1 else "")
            + ": like training.seq_len, each rank must hold equal shards of every window")
    if p.pipeline_parallel_degree > 1:
        # The schedule splits every batch into the training step's number of microbatches.
        microbatches = run.training.local_batch_size // p.pipeline_parallel_microbatch_size
        if microbatches and v.local_batch_size % microbatches:
            raise ValueError(
                f"validation.local_batch_size={v.local_batch_size} is not divisible by the "
                f"pipeline's {microbatches} microbatches (training.local_batch_size / "
                "parallelism.pipeline_parallel_microbatch_size)")


@contextmanager
def _no_gradient_handoff(schedule):
    """torch 2.13's `eval()` of a V-shaped schedule (ZBVZeroBubble, DualPipeV) still walks the
    schedule's backward actions. Each stage's backward returns at once without a backward, but
    the hand-off of input gradients between the two stages one rank holds asserts that there is
    one. In eval there is nothing to hand off: make the hand-off a no-op for the pass (instance
    attributes over torch's public stage methods)."""
    stages = pipelining.local_stages(schedule)
    for stage in stages:
        stage.get_local_bwd_output = lambda mb_index: ()
        stage.set_local_bwd_input = lambda grads, mb_index: None
    try:
        yield
    finally:
        for stage in stages:
            del stage.get_local_bwd_output, stage.set_local_bwd_input


class HybridValidator:
    """What torchtitan's trainer calls as its validator: `should_validate(step)`, then
    `validate(model_parts, step)`. It takes no loss function: the training loss has aux / MTP
    terms, and validation uses next_token_loss_sum."""

    def __init__(self, *, run: RunConfig, dp_world_size, dp_rank, tokenizer, parallel_dims,
                 validation_context, maybe_enable_amp, metrics_processor, pp_schedule=None,
                 pp_has_first_stage=None, pp_has_last_stage=None) -> None:
        validate_validation_config(run)  # again, for jobs started by torchtitan.train
        self.run = run
        self.loader = build_validation_dataloader(dp_world_size, dp_rank, tokenizer,
                                                  run.validation, run.data)
        self.dataset_name = validation_dataset_name(run.validation, run.data)
        self.bos_id = tokenizer.bos_id
        self.parallel_dims = parallel_dims
        self.validation_context = validation_context
        self.maybe_enable_amp = maybe_enable_amp
        self.metrics_processor = metrics_processor
        self.pp_schedule = pp_schedule
        self.pp_has_first_stage = pp_has_first_stage
        self.pp_has_last_stage = pp_has_last_stage
        self.document_masking = run.hybrid.document_masking
        # One batch is enough to know the set is not too small (and cheap for any dataset).
        if next(iter(self.loader), None) is None:
            v = run.validation
            raise JobError(
                f"validation set '{self.dataset_name}' holds fewer than one global batch of "
                f"validation.local_batch_size({v.local_batch_size}) * data-parallel degree"
                f"({dp_world_size}) windows of validation.seq_len + 1 = {v.seq_len + 1} "
                "tokens: lower validation.local_batch_size or validation.seq_len")

    def _prepare(self, input_dict, labels):
        cp_group = (self.parallel_dims.get_mesh("cp").get_group()
                    if self.parallel_dims.cp_enabled else None)
        return prepare_batch(input_dict, labels, document_masking=self.document_masking,
                             bos_id=self.bos_id, cp_group=cp_group,
                             token_ids=self.run.model.routes_by_token)

    def _pipeline_loss_sum(self, inputs, labels, extra_inputs, extra_kwargs):
        """The batch's summed loss on the last stage's ranks, None on the others."""
        scaled = scaled_loss_of(self.pp_schedule)
        saved = scaled.loss_fn, scaled.global_valid_tokens
        scaled.loss_fn, scaled.global_valid_tokens = next_token_loss_sum, 1
        try:
            targets, losses = (labels, []) if self.pp_has_last_stage else (None, None)
            with self.validation_context(), _no_gradient_handoff(self.pp_schedule):
                args = (inputs,) if self.pp_has_first_stage else ()
                kwargs = extra_inputs if self.pp_has_first_stage else {}
                # eval() hands return_outputs on to step(); merged outputs would be wasted
                # memory, and a MoE stage's scalar aux loss cannot be merged at all.
                self.pp_schedule.eval(*args, **kwargs, **extra_kwargs, target=targets,
                                      losses=losses, return_outputs=False)
        finally:
            scaled.loss_fn, scaled.global_valid_tokens = saved
        return sum(loss.double() for loss in losses) if self.pp_has_last_stage else None

    def _sums(self, model_parts) -> tuple[torch.Tensor, int]:
        """[summed loss, valid tokens] over this rank's share of the pass's windows, and the
        number of global batches evaluated (at least 1, checked at construction)."""
        device = utils.device_type
        totals = torch.zeros(2, dtype=torch.float64, device=device)
        limit = self.run.validation.steps
        batches = 0
        self.loader.restart()
        for input_dict, labels in self.loader:
            if limit != -1 and batches >= limit:
                break
            batches += 1
            self.metrics_processor.ntokens_since_last_log += labels.numel()
            input_dict = {k: v.to(device) for k, v in input_dict.items()}
            inputs, labels, extra_inputs, extra_kwargs = self._prepare(input_dict,
                                                                       labels.to(device))
            if self.parallel_dims.pp_enabled:
                loss_sum = self._pipeline_loss_sum(inputs, labels, extra_inputs, extra_kwargs)
                if loss_sum is None:
                    continue  # tokens count where the loss is, see the module docstring
            else:
                with self.validation_context(), self.maybe_enable_amp:
                    pred = model_parts[0](inputs, **extra_inputs, **extra_kwargs)
                    loss_sum = next_token_loss_sum(pred, labels)
                del pred
            totals[0] += loss_sum.to(device, torch.float64)
            totals[1] += (labels != IGNORE_INDEX).sum()
        return totals, batches

    @torch.no_grad()
    def should_validate(self, step: int) -> bool:
        return step == 1 or step % self.run.validation.freq == 0

    def validate(self, model_parts, step: int) -> None:
        # Validation forwards do not count in the next training log's layer statistics.
        with statistics_set_aside(model_parts):
            for part in model_parts:
                part.eval()
            try:
                totals, batches = self._sums(model_parts)
            finally:
                for part in model_parts:
                    part.train()
        if self.parallel_dims.dp_cp_enabled:
            dist.all_reduce(totals, group=self.parallel_dims.get_mesh("loss").get_group())
        if self.parallel_dims.pp_enabled:
            dist.all_reduce(totals, group=self.parallel_dims.get_mesh("pp").get_group())
        loss_sum, tokens = totals.tolist()
        logger.info(f"Validation: {batches} global batches, {int(tokens)} label tokens")
        self.metrics_processor.log_validation(loss=loss_sum / tokens, step=step)


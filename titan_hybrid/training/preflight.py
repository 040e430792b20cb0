"""Pre-flight checks of a run's configuration: every user error, found before any process group
or model.

`check_run` raises ValueError naming the field, its value and the rule. The launcher
(titan_hybrid.launch) runs it in the launching process, before torchrun starts workers; the
worker entry (titan_hybrid.train) runs it again, for jobs started by a plain torchrun. Building
the RunConfig (the torchtitan adapter) has already checked the model args, and each enumerated
field's value against its `Literal[...]` (config/sections.py's check_choices).
"""

from __future__ import annotations

import math
import os

import torch

from titan_hybrid.data.loader import validate_dataset_config
from titan_hybrid.data.tokenizer import build_hybrid_tokenizer
from titan_hybrid.hf.families import check_hf_compatible
from titan_hybrid.parallel.activation_checkpoint import check_activation_checkpoint
from titan_hybrid.parallel.validate import validate_layout
from titan_hybrid.quantize.float8 import MX_BLOCK, check_float8
from titan_hybrid.training.run_config import RunConfig
from titan_hybrid.training.validation import validate_validation_config


def _require(condition: bool, field: str, value, rule: str) -> None:
    if not condition:
        raise ValueError(f"{field}={value!r} {rule}")


def check_training(training) -> None:
    _require(training.steps >= 1, "training.steps", training.steps, "must be >= 1")
    _require(training.local_batch_size >= 1, "training.local_batch_size",
             training.local_batch_size, "must be >= 1")
    _require(training.seq_len >= 1, "training.seq_len", training.seq_len, "must be >= 1")
    _require(training.global_batch_size == -1 or training.global_batch_size >= 1,
             "training.global_batch_size", training.global_batch_size,
             "must be -1 (local_batch_size x data-parallel degree) or >= 1")
    _require(math.isfinite(training.max_norm) and training.max_norm > 0, "training.max_norm",
             training.max_norm, "must be a finite number > 0 (gradient clipping threshold)")
    _require(training.gc_freq >= 1, "training.gc_freq", training.gc_freq, "must be >= 1")


def check_global_batch(training, data_parallel: int) -> None:
    global_batch = training.global_batch_size
    if global_batch == -1:
        return
    per_microbatch = training.local_batch_size * data_parallel
    _require(global_batch % per_microbatch == 0, "training.global_batch_size", global_batch,
             f"must be a multiple of local_batch_size({training.local_batch_size}) x "
             f"data-parallel degree({data_parallel}) = {per_microbatch}")


def check_optimizer(optimizer, lr_scheduler) -> None:
    _require(math.isfinite(optimizer.lr) and optimizer.lr >= 0, "optimizer.lr", optimizer.lr,
             "must be a finite number >= 0 (0 freezes the weights: evaluation or export runs)")
    for name in ("beta1", "beta2"):
        value = getattr(optimizer, name)
        _require(0 <= value < 1, f"optimizer.{name}", value, "must be in [0, 1)")
    _require(optimizer.eps > 0, "optimizer.eps", optimizer.eps, "must be > 0")
    _require(optimizer.weight_decay >= 0, "optimizer.weight_decay", optimizer.weight_decay,
             "must be >= 0")
    _require(lr_scheduler.warmup_steps >= 0, "lr_scheduler.warmup_steps",
             lr_scheduler.warmup_steps, "must be >= 0")
    if lr_scheduler.decay_ratio is not None:
        _require(0 <= lr_scheduler.decay_ratio <= 1, "lr_scheduler.decay_ratio",
                 lr_scheduler.decay_ratio, "must be in [0, 1] (the decaying share of the steps)")
    _require(0 <= lr_scheduler.min_lr_factor <= 1, "lr_scheduler.min_lr_factor",
             lr_scheduler.min_lr_factor, "must be in [0, 1]")


def check_checkpoint(checkpoint) -> None:
    _require(checkpoint.enable or not checkpoint.create_seed_checkpoint,
             "checkpoint.create_seed_checkpoint", True, "needs checkpoint.enable")
    if not checkpoint.enable:
        return
    _require(checkpoint.interval >= 1, "checkpoint.interval", checkpoint.interval,
             "must be >= 1 (steps between saves)")
    _require(checkpoint.keep_latest_k == 0 or checkpoint.keep_latest_k >= 2,
             "checkpoint.keep_latest_k", checkpoint.keep_latest_k,
             "must be 0 (keep all) or >= 2 (the newest save may still be in progress)")
    _require(checkpoint.async_mode != "async_with_pinned_mem" or torch.cuda.is_available(),
             "checkpoint.async_mode", checkpoint.async_mode,
             "needs CUDA (pinned host memory); use 'async' on this machine")
    _require(checkpoint.load_step == -1 or checkpoint.load_step >= 0, "checkpoint.load_step",
             checkpoint.load_step, "must be -1 (newest intact checkpoint) or a step >= 0")
    path = checkpoint.initial_load_path
    _require(not path or os.path.isdir(path), "checkpoint.initial_load_path", path,
             "is not a directory")


def check_parallelism(parallelism) -> None:
    """What validate_layout (the layout against the world size) leaves: torchtitan's fields
    that titan_hybrid does not honour."""
    _require(parallelism.fsdp_reshard_after_forward == "default",
             "parallelism.fsdp_reshard_after_forward", parallelism.fsdp_reshard_after_forward,
             "is not supported: titan_hybrid reshards as "
             "parallelism.data_parallel_sharding_strategy says (optim_grads: never, "
             "optim_grads_params: after each forward); leave it 'default'")


def check_metrics(metrics) -> None:
    _require(metrics.log_freq >= 1, "metrics.log_freq", metrics.log_freq, "must be >= 1")


def check_run(run: RunConfig, world_size: int) -> None:
    """Every cheap check of the run, the layout's included; raises ValueError on the first
    user error."""
    check_training(run.training)
    check_optimizer(run.optimizer, run.lr_scheduler)
    check_checkpoint(run.checkpoint)
    check_parallelism(run.parallelism)
    check_metrics(run.metrics)
    check_float8(run.float8)
    if run.float8.mx_recipe_name:
        row_tokens = run.training.seq_len // run.parallelism.context_parallel_degree
        _require(row_tokens % MX_BLOCK == 0, "training.seq_len", run.training.seq_len,
                 f"gives {row_tokens} tokens a row on each context-parallel rank, and MXFP8 "
                 f"(quantize.linear.mx) scales the weight gradients' {MX_BLOCK}-token blocks: "
                 f"make it a multiple of {MX_BLOCK} per rank")
        # inductor's CPU code generator has no float8_e8m0fnu (MXFP8's scales); its GPU one has
        _require(not run.compile.enable or torch.cuda.is_available(), "compile.enable", True,
                 "with MXFP8 (quantize.linear.mx) needs a GPU: torch.compile's CPU code has no "
                 "e8m0 scales")
    check_activation_checkpoint(
        run.activation_checkpoint,
        model_compile_enabled=run.compile.enable and "model" in run.compile.components,
        pattern_symbols=run.model.parsed_pattern.member_symbols())
    data_parallel = validate_layout(run, world_size)
    check_global_batch(run.training, data_parallel)
    validate_dataset_config(run.data)
    # found, and no larger than the model's vocabulary
    build_hybrid_tokenizer(run.data, vocab_size=run.model.vocab_size, flavor=run.flavor)
    if run.validation.enable:
        validate_validation_config(run)
    if run.checkpoint.initial_load_in_hf or run.checkpoint.last_save_in_hf:
        check_hf_compatible(run.model)

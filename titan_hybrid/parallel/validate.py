"""Checks of a parallel layout against the model, raised as ValueError before any allocation.

The per-kind rules (which sizes TP must divide, how CP splits a kind's heads) come from the
layer-kind table (model/layer_kinds.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

from titan_hybrid.config.sections import (
    CompileSection,
    ParallelismSection,
    TrainingSection,
    check_choices,
)
from titan_hybrid.model.args import HybridModelArgs
from titan_hybrid.model.layer_kinds import LAYER_KINDS
from titan_hybrid.parallel.context_parallel import check_head_split, splits
from titan_hybrid.parallel.ep_overlap_pipeline import OVERLAP_SCHEDULES
from titan_hybrid.parallel.pipeline_split import module_names_per_stage, stages_per_rank


class LayoutJob(Protocol):
    """What a layout check reads of a run (the RunConfig has it, and a test can pass just
    these)."""
    model: HybridModelArgs
    parallelism: ParallelismSection
    training: TrainingSection
    compile: CompileSection


def _require_divisible(field: str, value: int, degree_name: str, degree: int) -> None:
    if value % degree:
        raise ValueError(f"{field}={value} is not divisible by parallelism.{degree_name}="
                         f"{degree}: each rank must hold whole {field.rsplit('.', 1)[-1]}")


def validate_tensor_parallel(model_args: HybridModelArgs, tp: int, *, seq_len: int,
                             sequence_parallel: bool) -> None:
    name = "tensor_parallel_degree"
    checks = [("model.vocab_size", model_args.vocab_size)]
    for kind in model_args.kinds():
        checks += kind.tensor_parallel_sizes(model_args.section(kind), model_args.dim)
        if tp > 1:
            kind.validate_tensor_parallel(model_args.section(kind))
    if sequence_parallel:
        checks += [("training.seq_len (sequence parallel)", seq_len)]
    for field, value in checks:
        _require_divisible(field, value, name, tp)


def validate_compile(compile_section: CompileSection) -> None:
    unknown = set(compile_section.components) - {"model", "loss"}
    if unknown:
        raise ValueError(f"compile.components {sorted(unknown)}: the hybrid model compiles "
                         "'model' and 'loss'")


def validate_pipeline(model_args: HybridModelArgs, p: ParallelismSection,
                      training: TrainingSection) -> None:
    if model_args.enable_weight_tying:
        raise ValueError(
            f"parallelism.pipeline_parallel_degree={p.pipeline_parallel_degree} with a model "
            "whose LM head shares the embedding's weight (enable_weight_tying, HF's "
            "tie_word_embeddings): the first and last stages would each train a copy; train "
            "it without pipeline parallelism")
    virtual_stages = stages_per_rank(p, model_args)
    module_names_per_stage(model_args, p.pipeline_parallel_degree, virtual_stages)  # split errors
    local_batch, microbatch = (training.local_batch_size,
                               p.pipeline_parallel_microbatch_size)
    if local_batch % microbatch:
        raise ValueError(f"training.local_batch_size={local_batch} is not divisible by "
                         f"parallelism.pipeline_parallel_microbatch_size={microbatch}")
    stages = p.pipeline_parallel_degree * virtual_stages
    if p.pipeline_parallel_schedule == "1F1B" and local_batch // microbatch < stages:
        raise ValueError(
            f"parallelism.pipeline_parallel_schedule '1F1B' needs at least as many microbatches "
            f"as stages: {local_batch // microbatch} microbatches (training.local_batch_size="
            f"{local_batch} / pipeline_parallel_microbatch_size={microbatch}), {stages} stages")
    if p.pipeline_parallel_schedule == "DualPipeV" and not torch.accelerator.is_available():
        raise ValueError("parallelism.pipeline_parallel_schedule 'DualPipeV' needs an "
                         "accelerator (torch's DualPipeV runs on device streams); on CPU use "
                         "ZBVZeroBubble for a V-shaped schedule")
    if p.pipeline_parallel_schedule == "DualPipeV" and local_batch // microbatch < stages:
        raise ValueError(
            f"parallelism.pipeline_parallel_schedule 'DualPipeV' needs at least as many "
            f"microbatches as stages: {local_batch // microbatch} microbatches "
            f"(training.local_batch_size / pipeline_parallel_microbatch_size), {stages} stages")


def validate_expert_parallel(p, model_args: HybridModelArgs, *, shard: int,
                             strategy: str) -> None:
    ep = p.expert_parallel_degree
    if not any(kind.routed_experts for kind in model_args.kinds()):
        kinds = ", ".join(f"{kind.title} ('{kind.symbol}')" for kind in LAYER_KINDS.values()
                          if kind.routed_experts)
        raise ValueError(f"parallelism.expert_parallel_degree={ep} but the pattern "
                         f"'{model_args.pattern}' has no MoE layer (of a kind with routed "
                         f"experts: {kinds})")
    _require_divisible("moe.num_experts", model_args.moe.num_experts, "expert_parallel_degree", ep)
    if shard % ep:
        raise ValueError(
            f"parallelism.expert_parallel_degree={ep} must divide data_parallel_shard_degree="
            f"{shard}: expert parallelism spreads experts over ranks of the FSDP dimension")
    etp = p.expert_tensor_parallel_degree
    if etp != p.tensor_parallel_degree:
        raise ValueError(
            f"parallelism.expert_tensor_parallel_degree={etp} with tensor_parallel_degree="
            f"{p.tensor_parallel_degree} and expert_parallel_degree={ep}: experts are split "
            "like the dense layers (ETP = TP); set expert_tensor_parallel_degree="
            f"{p.tensor_parallel_degree}")
    if strategy in ("no_shard", "optim"):
        raise ValueError(
            f"parallelism.data_parallel_sharding_strategy '{strategy}' with "
            f"expert_parallel_degree={ep}: expert parallelism runs with 'optim_grads' or "
            "'optim_grads_params' (experts are sharded over the ranks that hold the same experts)")


def validate_context_parallel(model_args: HybridModelArgs, p: ParallelismSection,
                              training: TrainingSection) -> None:
    cp, tp = p.context_parallel_degree, p.tensor_parallel_degree
    seq_len = training.seq_len
    sequence_parallel = not p.disable_sequence_parallel
    chunks = 2 * cp * (tp if tp > 1 and sequence_parallel else 1)
    if seq_len % chunks:
        raise ValueError(
            f"training.seq_len={seq_len} is not divisible by {chunks} = 2 * context_parallel_"
            f"degree({cp})" + (f" * tensor_parallel_degree({tp}) (sequence parallel)"
                               if chunks != 2 * cp else "")
            + ": each CP rank holds 2 equal chunks (zigzag)")
    if model_args.parsed_pattern.mtp_depths:
        raise ValueError(
            f"parallelism.context_parallel_degree={cp} with MTP depths in pattern "
            f"'{model_args.pattern}': MTP reads the tokens k positions ahead, which a zigzag "
            "shard does not hold; drop the '/...' part of the pattern or use CP = 1")
    mode = p.context_parallel_linear_mode
    for kind in model_args.kinds():
        if not kind.mixes_sequence:
            continue
        rule = kind.context_parallel
        if not splits(rule):
            raise ValueError(
                f"parallelism.context_parallel_degree={cp} with pattern '{model_args.pattern}': "
                f"context parallelism ({mode}) is not implemented for {kind.title} "
                f"('{kind.symbol}') layers; use CP = 1")
        section = model_args.section(kind)
        if rule.head_groups is not None and mode == "head_a2a":
            (heads_field, heads), (groups_field, groups) = rule.head_groups(section,
                                                                            model_args.dim)
            try:
                check_head_split(heads_field, heads // tp, groups_field, groups // tp, cp)
            except ValueError as error:
                raise ValueError(f"{error} (parallelism.context_parallel_linear_mode "
                                 "'chunkwise' has no head-count rule)") from None
        # Wrappers that read the rows before each piece from the rank that holds them: the
        # chunkwise conv, and window attention's key halo.
        piece = seq_len // (2 * cp)
        width = getattr(section, "conv_width", 1)
        if not rule.gather and mode == "chunkwise" and piece < width - 1:
            raise ValueError(
                f"training.seq_len={seq_len} with context_parallel_degree={cp}: chunkwise pieces "
                f"of {piece} tokens are shorter than the {kind.title} conv's left context "
                f"({width - 1} tokens)")
        window = getattr(section, "sliding_window", 1)
        if piece < window - 1:
            raise ValueError(
                f"training.seq_len={seq_len} with context_parallel_degree={cp}: pieces of "
                f"{piece} tokens are shorter than the {kind.title} window's halo "
                f"({window - 1} tokens); use a longer sequence or a smaller CP degree")
        compressor_halo = getattr(section, "compressor_halo", 0)
        if piece < compressor_halo:
            raise ValueError(
                f"training.seq_len={seq_len} with context_parallel_degree={cp}: pieces of "
                f"{piece} tokens are shorter than the {kind.title} compressor's halo "
                f"({compressor_halo} tokens: the rest of a block and the block before it); use "
                "a longer sequence or a smaller CP degree")


def validate_overlap(model_args: HybridModelArgs, p: ParallelismSection,
                     training: TrainingSection, *, data_parallel: int) -> None:
    if p.expert_parallel_degree < 2:
        raise ValueError(
            "parallelism.expert_parallel_overlap needs expert_parallel_degree > 1 (it overlaps "
            f"the expert-parallel all-to-alls), got {p.expert_parallel_degree}")
    if p.pipeline_parallel_degree > 1:
        if p.pipeline_parallel_schedule not in OVERLAP_SCHEDULES:
            raise ValueError(
                "parallelism.expert_parallel_overlap with pipeline_parallel_schedule="
                f"'{p.pipeline_parallel_schedule}' is not supported; use one of "
                f"{OVERLAP_SCHEDULES}")
        return  # the pipeline's microbatches pair up; the schedule checks its own order
    global_batch = training.global_batch_size
    if global_batch < 0:
        global_batch = training.local_batch_size * data_parallel
    if global_batch < 2 * training.local_batch_size * data_parallel:
        raise ValueError(
            "parallelism.expert_parallel_overlap pairs the forward of each microbatch with the "
            f"backward of the previous one, so it needs >= 2 microbatches per step: "
            f"training.global_batch_size={global_batch} must be at least 2 * local_batch_size("
            f"{training.local_batch_size}) * data-parallel degree({data_parallel})")


def validate_layout(run: LayoutJob, world_size: int) -> int:
    """Raise ValueError for a layout that cannot run; return the data-parallel degree."""
    p, model_args = run.parallelism, run.model
    check_choices("parallelism", p)  # the RunConfig's own check, for a direct caller
    degrees = {
        "data_parallel_replicate_degree": p.data_parallel_replicate_degree,
        "context_parallel_degree": p.context_parallel_degree,
        "tensor_parallel_degree": p.tensor_parallel_degree,
        "pipeline_parallel_degree": p.pipeline_parallel_degree,
        "expert_parallel_degree": p.expert_parallel_degree,
    }
    for name, degree in degrees.items():
        if degree < 1:
            raise ValueError(f"parallelism.{name}={degree} must be >= 1")
    shard = p.data_parallel_shard_degree
    if shard == 0 or shard < -1:
        raise ValueError(f"parallelism.data_parallel_shard_degree={shard} must be -1 (use the "
                         "remaining ranks) or >= 1")
    non_shard = (p.data_parallel_replicate_degree * p.context_parallel_degree
                 * p.tensor_parallel_degree * p.pipeline_parallel_degree)
    if shard == -1:
        if world_size % non_shard:
            named = ", ".join(f"{name}={degree}" for name, degree in degrees.items()
                              if degree > 1 and name != "expert_parallel_degree")
            raise ValueError(
                f"parallelism: {named} need a multiple of {non_shard} processes (their "
                f"product), but the world size is {world_size} (NGPU / --nproc)")
        shard = world_size // non_shard
    if shard * non_shard != world_size:
        raise ValueError(
            f"world size {world_size} != data_parallel_replicate_degree({p.data_parallel_replicate_degree})"
            f" * data_parallel_shard_degree({shard}) * context({p.context_parallel_degree}) * "
            f"tensor({p.tensor_parallel_degree}) * pipeline({p.pipeline_parallel_degree})")

    strategy = p.data_parallel_sharding_strategy
    if p.data_parallel_replicate_degree > 1 and shard > 1 and strategy in ("no_shard", "optim"):
        raise ValueError(
            f"parallelism.data_parallel_sharding_strategy '{strategy}' with "
            f"data_parallel_replicate_degree={p.data_parallel_replicate_degree} and "
            f"data_parallel_shard_degree={shard}: HSDP shards over the shard dimension, so use "
            "'optim_grads' or 'optim_grads_params' (or set data_parallel_shard_degree=1)")

    if p.tensor_parallel_degree > 1:
        validate_tensor_parallel(model_args, p.tensor_parallel_degree,
                                 seq_len=run.training.seq_len,
                                 sequence_parallel=not p.disable_sequence_parallel)
    if p.expert_parallel_degree > 1:
        validate_expert_parallel(p, model_args, shard=shard, strategy=strategy)
    if p.expert_parallel_overlap:
        validate_overlap(model_args, p, run.training,
                         data_parallel=p.data_parallel_replicate_degree * shard)
    if p.pipeline_parallel_degree > 1:
        validate_pipeline(model_args, p, run.training)
    if p.context_parallel_degree > 1:
        validate_context_parallel(model_args, p, run.training)
    if run.compile.enable:
        validate_compile(run.compile)
    return p.data_parallel_replicate_degree * shard

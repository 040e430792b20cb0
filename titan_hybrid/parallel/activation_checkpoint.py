"""Activation checkpointing of every top-level layer / bracket group, with the modes and option
names of torchtitan 0.2's `[activation_checkpoint]` section, and titan_hybrid's list of ops
that per-op selective AC keeps.

Modes: `full` (each layer's forward is recomputed in the backward), `selective` with
`selective_ac_option` N (every N-th layer, counted by its index in the whole model, so a
pipeline stage checkpoints the layers it would in the whole model) or `op` (per-op, below), and
`memory_budget` (compiled models: torch's partitioner saves activations up to the budget).
`layer_kinds` narrows full and selective AC to the layers (or bracket groups) that hold one of
the listed pattern symbols: a checkpoint chosen per layer kind, since a kind's activation
memory and the cost of its recompute differ (a Mamba2 layer's recompute reruns its scan; an
MLP's keeps only its input and the big [B, T, ffn] activation goes).

Per-op selective AC (`--activation_checkpoint.mode selective
--activation_checkpoint.selective_ac_option op`) keeps the outputs of the ops in
`selective_ac_saved_ops()` through the backward and recomputes the rest: torchtitan's rule for
transformers (every matmul but every second one, the attention kernels, max, the reduce-scatter)
plus the sequence-mixing scans, whose recompute costs most: the kernel custom ops declared
`saved_by_selective_ac` where they are defined (ops/custom_ops.py: the SSD scan, the gated delta
rule, KDA; their torch paths are matmuls already). Norms, convs, gates and the MoE router are
memory-bound and recomputed. Without a save list torchtitan's per-op mode
would recompute everything, like full AC.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titan_hybrid.compat.aten_ops import (
    ATTENTION_OPS,
    GROUPED_MM_OP,
    REDUCE_SCATTER_OP,
    TO_COPY_OP,
)
from titan_hybrid.compat.checkpointing import (
    checkpoint_wrapper,
    keep_compiled_frames_of_every_layer,
    set_activation_memory_budget,
)
from titan_hybrid.config.sections import ActivationCheckpointSection, section_choices
from titan_hybrid.model.model import HybridLayer
from titan_hybrid.model.pattern import members
from titan_hybrid.model.symbols import SYMBOLS
from titan_hybrid.ops.custom_ops import ops_saved_by_selective_ac

MODES = section_choices(ActivationCheckpointSection)["mode"]


def selective_ac_saved_ops() -> set:
    """The ops whose outputs per-op selective AC keeps: torchtitan's list, and the kernel ops
    that declare themselves kept (ops/custom_ops.py's registry). Read when AC is applied: the
    model is built by then, so every op module its layers call has registered its ops."""
    return {torch.ops.aten.mm.default, GROUPED_MM_OP, *ATTENTION_OPS, REDUCE_SCATTER_OP,
            torch.ops.aten.max.default, *ops_saved_by_selective_ac()}


def _keep_listed_ops_and_every_second_matmul(saved_ops: set):
    """A fresh selective-checkpoint context pair per forward: the outputs of `saved_ops` are
    kept, except every second matmul (torchtitan's rule for transformers), counted apart in
    the forward and in the recompute so both make the same choices."""
    matmuls = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        if (func == TO_COPY_OP and args[0].device.type != "cpu"
                and str(kwargs.get("device")) == "cpu"):
            return CheckpointPolicy.MUST_SAVE  # an offload to the host: never done twice
        if func == torch.ops.aten.mm.default:
            matmuls[ctx.is_recompute] += 1
            if matmuls[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return (CheckpointPolicy.MUST_SAVE if func in saved_ops
                else CheckpointPolicy.PREFER_RECOMPUTE)

    return create_selective_checkpoint_contexts(policy)


def _wrap(layer: nn.Module, config: ActivationCheckpointSection, **options) -> nn.Module:
    return checkpoint_wrapper(layer, preserve_rng_state=config.preserve_rng_state,
                              early_stop=config.early_stop, **options)


def _layer_symbols(layer: nn.Module) -> set[str]:
    """The pattern symbols of a top-level layer, or of every layer of a bracket group."""
    return {member for module in layer.modules() if isinstance(module, HybridLayer)
            for member in members(module.symbol)}


def _checkpointed(index: int, layer: nn.Module, config: ActivationCheckpointSection,
                  saved_ops: set):
    """`layer` wrapped for checkpointing, or unchanged where the options leave it out."""
    if config.layer_kinds and not _layer_symbols(layer) & set(config.layer_kinds):
        return layer
    if config.mode == "full":
        return _wrap(layer, config)
    if config.selective_ac_option == "op":
        return _wrap(layer, config, context_fn=functools.partial(
            _keep_listed_ops_and_every_second_matmul, saved_ops))
    every = int(config.selective_ac_option)
    return _wrap(layer, config) if every <= 1 or (index + 1) % every == 0 else layer


def check_activation_checkpoint(config: ActivationCheckpointSection, *,
                                model_compile_enabled: bool,
                                pattern_symbols: set[str] | None = None) -> None:
    """ValueError for a mode or option that cannot run (the pre-flight check calls it too,
    with the symbols of the pattern's main part, of which layer_kinds must name one)."""
    if config.mode not in MODES:
        raise ValueError(f"activation_checkpoint.mode '{config.mode}' is not one of "
                         f"{', '.join(MODES)}")
    option = config.selective_ac_option
    if config.mode == "selective" and option != "op" and not option.isdigit():
        raise ValueError(f"activation_checkpoint.selective_ac_option '{option}' must be 'op' "
                         "or a positive integer N (every N-th layer)")
    if config.mode == "memory_budget" and not model_compile_enabled:
        raise ValueError("activation_checkpoint.mode 'memory_budget' needs compile.enable "
                         "with 'model' in compile.components")
    kinds = config.layer_kinds
    if not kinds:
        return
    if config.mode not in ("full", "selective"):
        raise ValueError(f"activation_checkpoint.layer_kinds '{kinds}' chooses the layers of "
                         f"mode full or selective, not of mode '{config.mode}'")
    for symbol in kinds:
        if symbol not in SYMBOLS:
            raise ValueError(f"activation_checkpoint.layer_kinds '{kinds}': '{symbol}' is not a "
                             f"layer symbol (one of {' '.join(SYMBOLS)})")
    # A kind the pattern lacks is allowed (one policy, "*-E", fits every flavor); none at all
    # would checkpoint nothing.
    if pattern_symbols is not None and not set(kinds) & pattern_symbols:
        raise ValueError(f"activation_checkpoint.layer_kinds '{kinds}': the pattern's main part "
                         f"has none of these kinds (it has {' '.join(sorted(pattern_symbols))}),"
                         " so no layer would be checkpointed")


def apply_activation_checkpointing(model: nn.Module, config: ActivationCheckpointSection, *,
                                   model_compile_enabled: bool, base_folder: str) -> str:
    """Checkpoint `model`'s layers (a whole model or a pipeline stage) in place; returns what
    was done, for the log."""
    check_activation_checkpoint(config, model_compile_enabled=model_compile_enabled)
    if config.mode == "none":
        return "no activation checkpointing"
    keep_compiled_frames_of_every_layer()
    if config.mode == "memory_budget":
        pareto = (str(Path(base_folder) / "memory_budget_pareto")
                  if config.visualize_memory_budget_pareto else None)
        set_activation_memory_budget(config.memory_budget, pareto)
        return f"activation memory budget {config.memory_budget}"
    layers = model.get_submodule("layers")
    saved_ops = selective_ac_saved_ops()
    wrapped = []
    for name, layer in list(layers.named_children()):
        checkpointed = _checkpointed(int(name), layer, config, saved_ops)
        layers.register_module(name, checkpointed)
        if checkpointed is not layer:
            wrapped.append(name)
    option = "" if config.mode == "full" else f" {config.selective_ac_option}"
    kinds = f", layer kinds {config.layer_kinds}" if config.layer_kinds else ""
    return (f"activation checkpointing ({config.mode}{option}{kinds}) of {len(wrapped)} of "
            f"{len(layers)} layers / groups")

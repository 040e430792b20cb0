"""torch.compile for HybridModel, at torchtitan's granularity: one graph per top-level layer or
bracket group (the units that FSDP shards and activation checkpointing wraps), so that layers
of the same kind reuse compiled code and FSDP's hooks stay between graphs.

Each unit's `forward` is compiled in place (the unit's class is extended, as FSDP2 extends it:
model/module_classes.py): parameter names, checkpoint keys and the module tree stay what
they are without compile, and the hooks that parallel code registers on the unit
itself (FSDP's all-gathers, EP-overlap's hand-over between threads) run eagerly around the
graph, as with torchtitan's compiled blocks. Hooks on modules inside the unit (tensor
parallelism's regions and local parameter views) are traced into it.

A unit is one full graph (`fullgraph=True`: an unexpected graph break is an error, not a silent
slowdown) unless it holds a layer that compiles in parts: then each of its layers is compiled
on its own, and such a layer compiles its norm and some parts of its mixer while the rest runs
eagerly, as torchtitan does for its MoE blocks. In parts are compiled
- a layer whose kind names `compiled_parts` (layer_kind.py): MoE's router and shared expert,
  while its experts and their dispatch run eagerly; unless the kind is `one_graph_in_bf16`
  and the layers compute in bf16 without expert parallelism (MoE: no host sync left, and
  grouped_mm traces in bf16), where the layer is one graph, grouped GEMMs included;
- with `split_precision` (data parallelism computing in bf16, parallel/data_parallel.py), a
  layer whose kind keeps `full_precision_params`: its projections are then an FSDP unit of their
  own inside the layer, and FSDP's hooks cannot run inside a graph, so the mixer's own
  submodules (its sequence core and its gated norm) are compiled, and its projections run
  between them.

Compiling sets one process-wide dynamo option: a checkpointed graph may add to the kinds'
statistics counters in forward, once per forward (compat.dynamo).
"""

from __future__ import annotations

import torch
from torch import nn

from titan_hybrid.compat.dynamo import count_forward_side_effects_once_under_checkpoint
from titan_hybrid.config.sections import CompileSection
from titan_hybrid.model.model import HybridLayer
from titan_hybrid.model.module_classes import extend_class
from titan_hybrid.ops.kernels import probe_kernels


class _CompiledForward:
    """The unit's forward runs its compiled graph (`_compiled_forward`, in the instance's
    dict); the unit's own hooks run eagerly around it, from nn.Module.__call__."""

    def forward(self, *args, **kwargs):
        return self.__dict__["_compiled_forward"](*args, **kwargs)


def _compile(module: nn.Module, config: CompileSection) -> None:
    # Not nn.Module.compile: it compiles __call__, hooks included, and the EP-overlap's
    # hand-over between threads (hooks on the unit) cannot be traced.
    module.__dict__["_compiled_forward"] = torch.compile(module.forward, backend=config.backend,
                                                         fullgraph=True)
    extend_class(module, _CompiledForward)


def _mixer_parts(kind, mixer: nn.Module, split_precision: bool,
                 whole_in_bf16: bool) -> list[nn.Module] | None:
    """The mixer's submodules that are compiled instead of it (None: itself)."""
    if kind.compiled_parts is not None and not (whole_in_bf16 and kind.one_graph_in_bf16):
        return [part for part in (getattr(mixer, name) for name in kind.compiled_parts)
                if part is not None]  # e.g. no shared expert
    if split_precision and kind.full_precision_params:
        # titan_hybrid's own modules; torch's Linear / Conv1d are one op each, or not called
        return [child for child in mixer.children()
                if type(child).__module__.startswith("titan_hybrid.")]
    return None


def _compiled_parts(layer: HybridLayer, split_precision: bool,
                    whole_in_bf16: bool) -> list[nn.Module] | None:
    """The modules that the layer compiles instead of itself (None: itself): its norm, and
    each mixer's parts (or the mixer, where it has none)."""
    parts = [(mixer, _mixer_parts(kind, mixer, split_precision, whole_in_bf16))
             for kind, mixer in layer.mixers()]
    if all(mixer_parts is None for _, mixer_parts in parts):
        return None
    return [layer.norm] + [module for mixer, mixer_parts in parts
                           for module in ([mixer] if mixer_parts is None else mixer_parts)]


def _compile_layer(layer: HybridLayer, config: CompileSection, split_precision: bool,
                   whole_in_bf16: bool) -> None:
    parts = _compiled_parts(layer, split_precision, whole_in_bf16)
    for module in [layer] if parts is None else parts:
        _compile(module, config)


def _compile_unit(unit: nn.Module, config: CompileSection, split_precision: bool,
                  whole_in_bf16: bool) -> None:
    layers = [module for module in unit.modules() if isinstance(module, HybridLayer)]
    if all(_compiled_parts(layer, split_precision, whole_in_bf16) is None for layer in layers):
        _compile(unit, config)
        return
    for layer in layers:
        _compile_layer(layer, config, split_precision, whole_in_bf16)


def compile_units(model: nn.Module) -> list[nn.Module]:
    """The top-level units: every entry of `layers` and every MTP depth's layers (a pipeline
    stage holds only its own)."""
    units = list(model.layers.values())
    for depth in getattr(model, "mtp", []):
        units.extend(depth.block.layers.values())
    return units


def apply_compile(model: nn.Module, config: CompileSection, *, split_precision: bool = False,
                  bf16_compute: bool = False, expert_parallel: bool = False) -> None:
    """`bf16_compute`: the layers compute in bf16 (bf16 data-parallel parameters, or bf16
    autocast on one device); `expert_parallel`: EP's dispatch hooks are on the experts."""
    if torch.cuda.is_available():
        probe_kernels()  # imports the kernel packages here: dynamo cannot trace an import
    # Statistics counters that a checkpointed forward adds to (compat.dynamo).
    count_forward_side_effects_once_under_checkpoint()
    whole_in_bf16 = bf16_compute and not expert_parallel
    for unit in compile_units(model):
        _compile_unit(unit, config, split_precision, whole_in_bf16)

"""FP8 training through torchao, in torchtitan's words: `model.converters` names
"quantize.linear.float8" (and its section `[quantize.linear.float8]`: `recipe_name`,
`emulate`, `filter_fqns`, `enable_fsdp_float8_all_gather`,
`precompute_float8_dynamic_scale_for_fsdp`); "quantize.grouped_mm.float8" (its `fqns`) runs
the routed experts' grouped GEMMs in float8 too (ops/float8_grouped_mm.py, rowwise);
"quantize.linear.mx" (its section: `recipe_name`, `filter_fqns`) computes the Linear modules in
MXFP8 instead, with torchao's MXFP8Linear (`convert_to_mxfp8`).

Under it the model's nn.Linear modules become torchao's Float8Linear (the same weight
Parameters: checkpoints, TP layouts and FSDP units do not change), except Megatron's
high-precision ones, each for its reason (`high_precision_reason`):
- a Linear whose input or output width is not a multiple of 16: float8 GEMMs need both
  (Mamba2's in_proj of a model whose width makes it so);
- each layer kind's `high_precision_modules`: the MoE router and shared-expert gate, DSA's and
  DeepSeek-V4's indexers and compressors (their top-k and softmax are sensitive to rounding);
- the LM head (`output`); the embedding is no GEMM, and convolutions, norms and the SSM /
  delta-rule parameters (A_log, D, dt_bias) are no Linear;
- the user's `filter_fqns` (a module whose FQN contains one of them, as in torchtitan).

The recipes are torchao's: "tensorwise" (one scale per tensor; the default), "rowwise" and
"rowwise_with_gw_hp" (one scale per row; the latter keeps the weight-gradient GEMM in high
precision). `emulate` runs the float8 GEMMs as casts to float8 and back around a
high-precision matmul: the CPU path (and the tests'), whose rounding is the float8 recipe's.
Without it, the Linear modules need an SM89+ GPU; the grouped GEMMs run on its float8 units, or
on the CPU's float8 kernel.
MXFP8's GPU recipes need a Blackwell GPU (compute capability 10.x or later) and are refused
elsewhere; its emulated recipes run anywhere (widths and each row's tokens by 32).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import typing
from collections.abc import Callable

import torch
from torch import nn

from titan_hybrid.config.quantize import Converter, MXLinearOptions
from titan_hybrid.config.sections import Float8Recipe, Float8Section, MXRecipe
from titan_hybrid.model.model import HybridLayer, routed_experts
from titan_hybrid.model.module_classes import extend_class
from titan_hybrid.ops.float8_grouped_mm import float8_grouped_mm

# The values are the options' types' (config/quantize.py), in their order.
LINEAR_FLOAT8, GROUPED_FLOAT8, LINEAR_MX = typing.get_args(Converter)
RECIPES = typing.get_args(Float8Recipe)
MX_RECIPES = typing.get_args(MXRecipe)
MX_BLOCK = 32  # MXFP8 scales blocks of 32 along each GEMM's contraction
FLOAT8_ALIGNMENT = 16  # float8 GEMMs need both widths a multiple of 16


def float8_section(converters, float8_fields, grouped_fqns=(), mx_fields=None) -> Float8Section:
    """The section from a job's `model.converters`, its `quantize.linear.float8` fields (any
    object with those attributes, or None), `quantize.grouped_mm.float8.fqns` (a list, or
    torchtitan's comma-separated string) and `quantize.linear.mx` fields (`recipe_name`,
    `filter_fqns`); ValueError naming a field we cannot run."""
    converters = list(converters or [])
    known = typing.get_args(Converter)
    unknown = [name for name in converters if name not in known]
    if unknown:
        raise ValueError(f"model.converters {unknown}: titan_hybrid converts {list(known)}")
    linear, grouped = LINEAR_FLOAT8 in converters, GROUPED_FLOAT8 in converters
    if LINEAR_MX in converters:
        if linear:
            raise ValueError(f"model.converters names both '{LINEAR_FLOAT8}' and '{LINEAR_MX}': "
                             "a Linear computes in one of them; choose one")
        float8 = float8_section([GROUPED_FLOAT8] if grouped else [], float8_fields, grouped_fqns)
        return dataclasses.replace(float8, **mx_options(mx_fields))
    if not (linear or grouped):
        return Float8Section()
    values = {f.name: getattr(float8_fields, f.name) for f in dataclasses.fields(Float8Section)
              if f.name not in ("enable", "grouped_mm", "grouped_mm_fqns")
              and hasattr(float8_fields, f.name)}
    values["filter_fqns"] = tuple(values.get("filter_fqns") or ())
    if isinstance(grouped_fqns, str):
        grouped_fqns = [name for name in grouped_fqns.split(",") if name]
    section = Float8Section(enable=linear, grouped_mm=grouped,
                            grouped_mm_fqns=tuple(grouped_fqns or ()), **values)
    if section.recipe_name is not None and section.recipe_name not in RECIPES:
        raise ValueError(f"quantize.linear.float8.recipe_name '{section.recipe_name}' is not "
                         f"one of {RECIPES}")
    if section.recipe_name not in (None, "tensorwise") and section.enable_fsdp_float8_all_gather:
        raise ValueError("quantize.linear.float8.enable_fsdp_float8_all_gather needs tensorwise "
                         f"scaling, not recipe_name '{section.recipe_name}' (torchao gathers "
                         "float8 weights with one scale per tensor)")
    if (section.precompute_float8_dynamic_scale_for_fsdp
            and not section.enable_fsdp_float8_all_gather):
        raise ValueError("quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp "
                         "needs enable_fsdp_float8_all_gather: it computes the scales of the "
                         "float8 weights FSDP gathers")
    return section


def mx_options(mx_fields) -> dict:
    """The MXFP8 Linear fields of the section from `quantize.linear.mx`'s (torchtitan 0.2's
    recipe names; the non-emulated ones need a Blackwell GPU)."""
    recipe = getattr(mx_fields, "recipe_name", None) or MXLinearOptions().recipe_name
    if recipe not in MX_RECIPES:
        raise ValueError(f"quantize.linear.mx.recipe_name '{recipe}' is not one of {MX_RECIPES}")
    kernel_choice = getattr(mx_fields, "mxfp8_dim1_cast_kernel_choice", "triton")
    if kernel_choice != "triton":  # torchtitan 0.2's field, its default
        raise ValueError(f"quantize.linear.mx.mxfp8_dim1_cast_kernel_choice '{kernel_choice}' "
                         "has no effect: torchao's MXFP8Linear picks its cast kernels")
    if not recipe.startswith("mxfp8_emulated"):
        check_mx_hardware()
    return dict(enable=True, mx_recipe_name=recipe,
                filter_fqns=tuple(getattr(mx_fields, "filter_fqns", None) or ()))


# Loggers that torchao's import writes to: it tries its C++ extensions, built for another torch
# than ours, and registers an Enum with torch's pytree (nothing titan_hybrid uses either way).
_IMPORT_LOGGERS = ("torchao", "torch.utils._pytree")


def torchao_module(name: str = "torchao.float8"):
    """A torchao module, imported without its import-time warnings (a user's error message stays
    one line)."""
    loggers = [logging.getLogger(name) for name in _IMPORT_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        return importlib.import_module(name)
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def torchao_float8():
    return torchao_module("torchao.float8")


# torchao's MXFP8 training Linear (an nn.Linear computing its three GEMMs in MXFP8), and the
# options its recipes set
TORCHAO_MXFP8 = ("torchao.prototype.moe_training.mxfp8_linear",
                 "torchao.quantization.quantize_.common.kernel_preference",
                 "torchao.prototype.mx_formats")


def check_mx_hardware() -> None:
    """ValueError unless a Blackwell GPU (compute capability 10.x or later) is here."""
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    if capability is None or capability < (10, 0):
        found = f"compute capability {capability[0]}.{capability[1]}" if capability else "no GPU"
        raise ValueError(f"model.converters '{LINEAR_MX}': MXFP8 needs a Blackwell GPU "
                         f"(compute capability 10.x or later), and this machine has {found}")


def check_float8(section: Float8Section) -> None:
    """ValueError when the job's float8 training cannot run here: torchao is missing, or the
    float8 GEMMs need an SM89+ GPU and `emulate` is off. (titan_hybrid's grouped GEMMs run on
    the CPU's float8 kernel too; torchao's Float8Linear is run there emulated only.)"""
    if section.enable:
        try:
            for name in TORCHAO_MXFP8 if section.mx_recipe_name else ("torchao.float8",):
                torchao_module(name)
        except ImportError:
            converter = LINEAR_MX if section.mx_recipe_name else LINEAR_FLOAT8
            raise ValueError(f"model.converters '{converter}' needs torchao (0.18 for MXFP8): "
                             "pip install 'titan_hybrid[fp8]'") from None
    if section.mx_recipe_name:  # its hardware was checked with its recipe
        section = dataclasses.replace(section, enable=False)
    if section.emulate or not (section.enable or section.grouped_mm):
        return
    if torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
        if capability >= (8, 9):
            return
        raise ValueError("quantize.linear.float8: float8 GEMMs need a GPU of compute capability "
                         f"8.9 or later (Ada, Hopper, Blackwell), and this one is "
                         f"{capability[0]}.{capability[1]}; set quantize.linear.float8.emulate "
                         "to run them emulated")
    if section.enable:
        raise ValueError("quantize.linear.float8: float8 GEMMs need a GPU of compute capability "
                         "8.9 or later (Ada, Hopper, Blackwell); set "
                         "quantize.linear.float8.emulate to run them emulated (CPU, tests)")


def high_precision_reason(fqn: str, module: nn.Module, kind_exceptions: dict[str, str],
                          filter_fqns: tuple[str, ...], *, filter_field: str = LINEAR_FLOAT8,
                          alignment: int = FLOAT8_ALIGNMENT) -> str | None:
    """Why the nn.Linear `module` at `fqn` stays in high precision (None: it computes in
    float8). `kind_exceptions`: {FQN prefix: layer kind} of the kinds' high-precision
    modules; `alignment`: what both widths must be multiples of (MXFP8's 32-wide blocks)."""
    for prefix, kind in kind_exceptions.items():
        if fqn == prefix or fqn.startswith(prefix + "."):
            return f"as its layer kind ({kind}) keeps it"
    if fqn == "output":
        return "as the LM head"
    user = [name for name in filter_fqns if name in fqn]
    if user:
        return f"as {filter_field}.filter_fqns {user} names it"
    widths = (module.in_features, module.out_features)
    if any(width % alignment for width in widths):
        return f"as its widths {widths} are not multiples of {alignment}"
    return None


def kind_exceptions(model: nn.Module) -> dict[str, str]:
    """{FQN of a module its layer kind keeps in high precision: the kind's title}. `model`: a
    HybridModel (or a pipeline stage of one)."""
    found = {}
    for name, layer in model.named_modules():
        if not isinstance(layer, HybridLayer):
            continue
        for kind in layer.kinds:
            mixer = f"{name}.{kind.name}" if name else kind.name
            section = model.model_args.section(kind)
            for module in (*kind.high_precision_modules,
                           *kind.optional_high_precision_modules(section)):
                found[f"{mixer}.{module}"] = kind.title
    return found


def linear_precisions(model: nn.Module, section: Float8Section) -> dict[str, str | None]:
    """Every nn.Linear of the model by FQN -> why it stays in high precision, or None when it
    computes in float8."""
    exceptions = kind_exceptions(model)
    field, alignment = ((LINEAR_MX, MX_BLOCK) if section.mx_recipe_name
                        else (LINEAR_FLOAT8, FLOAT8_ALIGNMENT))
    return {fqn: high_precision_reason(fqn, module, exceptions, section.filter_fqns,
                                       filter_field=field, alignment=alignment)
            for fqn, module in model.named_modules() if isinstance(module, nn.Linear)}


def torchao_float8_config(section: Float8Section):
    Float8LinearConfig = torchao_float8().Float8LinearConfig
    if section.recipe_name is None:
        return Float8LinearConfig(
            enable_fsdp_float8_all_gather=section.enable_fsdp_float8_all_gather,
            emulate=section.emulate)
    return dataclasses.replace(Float8LinearConfig.from_recipe_name(section.recipe_name),
                               emulate=section.emulate)


def apply_float8(model: nn.Module, section: Float8Section) -> list[str]:
    """Swap the model's float8 Linear modules for torchao's Float8Linear, and give its routed
    experts the float8 grouped GEMM, in place (on the meta device, before any parallelism, as
    torchtitan converts); the FQNs converted."""
    converted = []
    if section.grouped_mm:
        for fqn, experts in routed_experts(model).items():
            if not section.grouped_mm_fqns or any(n in fqn for n in section.grouped_mm_fqns):
                extend_class(experts, EmulatedFloat8GroupedMatmuls if section.emulate
                             else Float8GroupedMatmuls)
                converted.append(fqn)
    if not section.enable:
        return converted
    precisions = linear_precisions(model, section)
    if section.mx_recipe_name:
        return converted + convert_to_mxfp8(model, precisions, section.mx_recipe_name)
    convert_to_float8_training = torchao_float8().convert_to_float8_training
    convert_to_float8_training(model, config=torchao_float8_config(section),
                               module_filter_fn=lambda module, fqn: (
                                   fqn in precisions and precisions[fqn] is None))
    return converted + [fqn for fqn, reason in precisions.items() if reason is None]


def convert_to_mxfp8(model: nn.Module, precisions: dict[str, str | None],
                     recipe: str) -> list[str]:
    """Swap the Linear modules that `precisions` leaves to float8 for torchao's MXFP8Linear
    over the same Parameters, in place; their FQNs."""
    mxfp8_linear, kernel_preference, mx_formats = (torchao_module(name) for name in TORCHAO_MXFP8)
    emulated, rounding = recipe.startswith("mxfp8_emulated"), recipe.endswith("_rceil")
    options = dict(
        kernel_preference=kernel_preference.KernelPreference[
            "EMULATED" if emulated else "AUTO"],
        scale_calculation_mode=mx_formats.ScaleCalculationMode[
            "RCEIL" if rounding else "FLOOR"])
    converted = [fqn for fqn, reason in precisions.items() if reason is None]
    for fqn in converted:
        linear = model.get_submodule(fqn)
        parent_fqn, _, name = fqn.rpartition(".")
        swapped = mxfp8_linear.MXFP8Linear(linear.in_features, linear.out_features,
                                           bias=linear.bias is not None, device="meta",
                                           **options)
        for parameter_name, parameter in linear.named_parameters(recurse=False):
            swapped.register_parameter(parameter_name, parameter)
        model.get_submodule(parent_fqn).register_module(name, swapped)
    return converted


def float8_summary(model: nn.Module, section: Float8Section, converted: list[str]) -> str:
    """The start-up lines: how many modules compute in float8, and how; then the Linear
    modules kept in high precision, by reason (a few FQNs each)."""
    linear = section.mx_recipe_name or section.recipe_name or "tensorwise"
    parts = ([f"Linear {linear}"] if section.enable else []) + (
        ["routed experts rowwise"] if section.grouped_mm else [])
    lines = [f"Float8 training: {len(converted)} modules compute in float8 ("
             f"{', '.join(parts)}{', emulated' if section.emulate else ''})"]
    kept: dict[str, list[str]] = {}
    for fqn, reason in (linear_precisions(model, section) if section.enable else {}).items():
        if reason is not None:
            kept.setdefault(reason, []).append(fqn)
    for reason, fqns in kept.items():
        more = f" and {len(fqns) - 3} more" if len(fqns) > 3 else ""
        lines.append(f"  in high precision {reason}: {', '.join(fqns[:3])}{more}")
    return "\n".join(lines)


class Float8GroupedMatmuls:
    """Mixed into the routed experts' class (model/module_classes.py): their grouped GEMMs
    in float8, rowwise (ops/float8_grouped_mm.py)."""

    def grouped_mm(self, x: torch.Tensor, weights: torch.Tensor,
                   offs: torch.Tensor) -> torch.Tensor:
        return float8_grouped_mm(x, weights, offs, emulate=False)


class EmulatedFloat8GroupedMatmuls:
    """The same, emulated: float8's rounding, high-precision arithmetic."""

    def grouped_mm(self, x: torch.Tensor, weights: torch.Tensor,
                   offs: torch.Tensor) -> torch.Tensor:
        return float8_grouped_mm(x, weights, offs, emulate=True)


def float8_scales_step_hook(model_parts: list[nn.Module]) -> Callable[..., None]:
    """The optimizer step hook that computes the scales of every float8 weight FSDP gathers,
    in one all-reduce (instead of one per weight as each is gathered): torchao's
    precompute_float8_dynamic_scale_for_fsdp, looked up once."""
    precompute = torchao_float8().precompute_float8_dynamic_scale_for_fsdp

    def after_step(*args, **kwargs) -> None:
        for part in model_parts:
            precompute(part)

    return after_step

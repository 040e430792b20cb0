"""MXFP8 training (`model.converters = ["quantize.linear.mx"]`, quantize/float8.py): torchao's
MXFP8Linear computes the three GEMMs of a Linear on operands cast to e4m3 in blocks of 32
along the GEMM's contraction, each block with its power-of-2 (e8m0) scale; checked against an
independent float64 reference that quantizes the operands itself, in the emulated recipes
that run on CPU. The training curves are in tests/distributed/test_float8.py."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from titan_hybrid.config.sections import Float8Section
from titan_hybrid.model.args import hybrid_flavors
from titan_hybrid.model.model import HybridModel
from titan_hybrid.quantize.float8 import apply_float8, float8_section, float8_summary

E4M3 = torch.float8_e4m3fn
BLOCK = 32


def mx_quantized(t: torch.Tensor, dim: int, *, rceil: bool) -> torch.Tensor:
    """`t` through MXFP8 and back, in float64: blocks of 32 along `dim`, each divided by a power
    of 2 (floor: 2^(floor(log2 amax) - 8), e4m3's largest power; rceil: the smallest that
    maps amax to at most 448), cast to e4m3 with saturation, multiplied back."""
    moved = t.detach().double().movedim(dim, -1)
    blocks = moved.reshape(*moved.shape[:-1], -1, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True).clamp(min=2.0 ** -120)
    largest = torch.finfo(E4M3).max
    exponent = (torch.ceil(torch.log2(amax / largest)) if rceil
                else torch.floor(torch.log2(amax)) - 8)
    scale = torch.exp2(exponent)
    cast = (blocks / scale).float().clamp(-largest, largest).to(E4M3).double() * scale
    return cast.reshape(moved.shape).movedim(-1, dim)


def relative(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours.double() - reference).norm() / reference.norm()).item()


class Fields:
    def __init__(self, **values):
        self.__dict__.update(values)


def mx_linear(recipe: str, linear: nn.Linear) -> nn.Module:
    holder = nn.Sequential(linear)
    section = float8_section(["quantize.linear.mx"], None, (), Fields(recipe_name=recipe))
    from titan_hybrid.quantize.float8 import convert_to_mxfp8

    convert_to_mxfp8(holder, {"0": None}, section.mx_recipe_name)
    return holder[0]


@pytest.mark.parametrize("recipe", ["mxfp8_emulated", "mxfp8_emulated_rceil"])
def test_an_mxfp8_linear_computes_the_recipes_block_scaled_products(recipe):
    """Forward, input gradient and weight gradient equal the float64 products of operands
    quantized in 32-wide blocks along each GEMM's contraction (the weight gradient's over the
    tokens), the scales rounded as the recipe says; and differ from the unquantized ones."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=False)
    weight = linear.weight
    mx = mx_linear(recipe, linear)
    assert type(mx).__name__ == "MXFP8Linear" and mx.weight is weight
    x = torch.randn(2, 32, 64, requires_grad=True)
    out = mx(x)
    grad = torch.randn_like(out)
    out.backward(grad)
    rceil = recipe.endswith("rceil")
    x2, grad2 = x.reshape(-1, 64), grad.reshape(-1, 96)
    forward = mx_quantized(x2, -1, rceil=rceil) @ mx_quantized(weight, -1, rceil=rceil).t()
    grad_input = mx_quantized(grad2, -1, rceil=rceil) @ mx_quantized(weight, 0, rceil=rceil)
    grad_weight = mx_quantized(grad2, 0, rceil=rceil).t() @ mx_quantized(x2, 0, rceil=rceil)
    assert relative(out.reshape(-1, 96), forward) <= 1e-6
    assert relative(x.grad.reshape(-1, 64), grad_input) <= 1e-6
    assert relative(weight.grad, grad_weight) <= 1e-6
    assert relative(weight.grad, grad2.double().t() @ x2.double()) >= 0.01


def test_the_job_option_reads_torchtitans_words():
    """`quantize.linear.mx`'s recipe name and filter; the grouped GEMMs' float8 beside it; and
    the Linear modules whose widths are not multiples of 32 stay in high precision."""
    section = float8_section(["quantize.linear.mx", "quantize.grouped_mm.float8"],
                             Fields(emulate=True), (),
                             Fields(recipe_name="mxfp8_emulated_rceil", filter_fqns=["wq"]))
    assert section == Float8Section(enable=True, emulate=True, grouped_mm=True,
                                    mx_recipe_name="mxfp8_emulated_rceil", filter_fqns=("wq",))
    model = HybridModel(copy.deepcopy(hybrid_flavors["debug"]))
    converted = apply_float8(model, dataclasses.replace(section, grouped_mm=False))
    kinds = {type(model.get_submodule(fqn)).__name__ for fqn in converted}
    assert kinds == {"MXFP8Linear"} and len(converted) == 14
    summary = float8_summary(model, section, converted)
    assert summary.startswith("Float8 training: 14 modules compute in float8 (Linear "
                              "mxfp8_emulated_rceil, routed experts rowwise, emulated)")
    assert "as its widths (256, 1168) are not multiples of 32: layers.0.mamba.in_proj" in summary
    assert "as quantize.linear.mx.filter_fqns ['wq'] names it: layers.2.attention.wq" in summary


def test_mxfp8_is_refused_by_name_off_blackwell():
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    if capability is not None and capability >= (10, 0):
        assert float8_section(["quantize.linear.mx"], None, (), Fields()).mx_recipe_name == (
            "mxfp8_cublas")
        return
    message = ("MXFP8 needs a Blackwell GPU \\(compute capability 10.x or later\\), and this "
               f"machine has {'no GPU' if capability is None else 'compute capability'}")
    for recipe in ("mxfp8_cublas", "mxfp8_cublas_rceil"):
        with pytest.raises(ValueError, match=message):
            float8_section(["quantize.linear.mx"], None, (), Fields(recipe_name=recipe))


@pytest.mark.parametrize("converters, recipe, message", [
    (["quantize.linear.mx", "quantize.linear.float8"], "mxfp8_emulated",
     "names both 'quantize.linear.float8' and 'quantize.linear.mx'"),
    (["quantize.linear.mx"], "mxfp4", "quantize.linear.mx.recipe_name 'mxfp4' is not one of"),
])
def test_what_we_cannot_run_is_refused_by_field(converters, recipe, message):
    with pytest.raises(ValueError, match=message):
        float8_section(converters, Fields(emulate=True), (), Fields(recipe_name=recipe))


def test_torchtitans_cast_kernel_choice_is_refused_as_without_effect():
    with pytest.raises(ValueError, match="mxfp8_dim1_cast_kernel_choice 'cuda' has no effect"):
        float8_section(["quantize.linear.mx"], None, (),
                       Fields(recipe_name="mxfp8_emulated", mxfp8_dim1_cast_kernel_choice="cuda"))

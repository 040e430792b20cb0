"""FP8 training (titan_hybrid/quantize/float8.py): torchao's Float8Linear computes the recipe's
float8 products, checked against an independent float64 reference that quantizes the GEMMs'
operands itself; which Linear modules stay in high precision, and why; the job option in
torchtitan's words. The training curves are in tests/distributed/test_float8.py."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from titan_hybrid.config.sections import Float8Section
from titan_hybrid.model.args import hybrid_flavors
from titan_hybrid.model.model import HybridModel
from titan_hybrid.quantize.float8 import (
    apply_float8,
    float8_section,
    float8_summary,
    linear_precisions,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def quantized(t: torch.Tensor, dtype: torch.dtype, dim: int | None = None, *,
              power_of_2: bool = False) -> torch.Tensor:
    """`t` through float8 and back, in float64: scaled so that its largest magnitude (over the
    whole tensor, or along `dim`: the GEMM's contraction dimension) maps to the format's
    largest value, the scale rounded down to a power of 2 where the recipe says so."""
    t32 = t.detach().float()
    amax = t32.abs().amax() if dim is None else t32.abs().amax(dim=dim, keepdim=True)
    largest = torch.finfo(dtype).max
    scale = largest / amax.clamp(min=1e-12)
    if power_of_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    cast = (t32 * scale).clamp(-largest, largest).to(dtype)
    return cast.double() / scale.double()


def relative(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours.double() - reference).norm() / reference.norm()).item()


# recipe -> (the forward's operands, grad_input's, grad_weight's), each a pair of
# (dtype, contraction dimension or None for one scale per tensor), and power-of-2 scales.
RECIPES = {
    None: (((E4M3, None), (E4M3, None)), ((E5M2, None), (E4M3, None)),
           ((E5M2, None), (E4M3, None)), False),
    "rowwise": (((E4M3, -1), (E4M3, -1)), ((E4M3, -1), (E4M3, 0)),
                ((E4M3, 0), (E4M3, 0)), True),
}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_a_float8_linear_computes_the_recipes_float8_products(recipe):
    """Forward, input gradient and weight gradient equal the float64 products of operands
    quantized by the recipe (tensorwise: one scale per tensor, e5m2 gradients; rowwise: one
    per row of the contraction, power-of-2 scales, e4m3 throughout) within float32 rounding;
    against the unquantized float64 products they are off by float8's own error."""
    forward, grad_input, grad_weight, power_of_2 = RECIPES[recipe]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48, bias=False))
    weight = model[0].weight.detach().clone()
    apply_float8(model, Float8Section(enable=True, recipe_name=recipe, emulate=True))
    assert type(model[0]).__name__ == "Float8Linear"
    x = torch.randn(32, 64, requires_grad=True)
    y = model(x)
    grad = torch.randn_like(y)
    y.backward(grad)

    def product(pair, a, b):
        (a_dtype, a_dim), (b_dtype, b_dim) = pair
        return (quantized(a, a_dtype, a_dim, power_of_2=power_of_2)
                @ quantized(b, b_dtype, b_dim, power_of_2=power_of_2))

    references = {"output": (y, product(forward, x, weight.t())),
                  "grad_input": (x.grad, product(grad_input, grad, weight)),
                  "grad_weight": (model[0].weight.grad, product(grad_weight, grad.t(), x))}
    exact = {"output": x.double() @ weight.double().t(),
             "grad_input": grad.double() @ weight.double(),
             "grad_weight": grad.double().t() @ x.detach().double()}
    for name, (ours, reference) in references.items():
        assert relative(ours, reference) <= 1e-6, name
        # e4m3 keeps 3 mantissa bits, e5m2 2: a few percent on random operands, never 0.
        assert 0.01 <= relative(ours, exact[name]) <= 0.08, name


def built(flavor: str, **changes) -> HybridModel:
    with torch.device("meta"):
        return HybridModel(dataclasses.replace(copy.deepcopy(hybrid_flavors[flavor]), **changes))


def test_megatrons_high_precision_modules_stay_linear():
    """Routers and gates, DSA's and DeepSeek-V4's indexers and compressors, the LM head, the
    widths float8 GEMMs cannot take, and the user's filter_fqns stay nn.Linear; every other
    Linear becomes a Float8Linear over the same Parameter."""
    model = built("debug_v4_all_moe", pattern="MC-MHEMWE+-D-")
    section = Float8Section(enable=True, emulate=True, filter_fqns=("layers.10.mlp",))
    precisions = linear_precisions(model, section)
    assert precisions["output"] == "as the LM head"
    assert (precisions["layers.5.moe.router.gate"]
            == "as its layer kind (mixture of experts) keeps it")
    assert precisions["layers.11.dsa.indexer.wk"].startswith("as its layer kind (DeepSeek")
    assert precisions["layers.1.compressed_sparse_attention.compressor.indexer.q_b_proj"]
    assert precisions["layers.4.heavily_compressed_attention.compressor.kv_proj"]
    assert (precisions["layers.10.mlp.fc1"]
            == "as quantize.linear.float8.filter_fqns ['layers.10.mlp'] names it")
    for fqn in ("layers.0.mamba.in_proj", "layers.9.mla.kv_b_proj", "layers.11.dsa.o_proj",
                "layers.7.window_attention.q_b_proj", "layers.5.moe.shared_expert.fc1"):
        assert precisions[fqn] is None, fqn
    weights = dict(model.named_parameters())
    converted = apply_float8(model, section)
    assert sorted(converted) == sorted(f for f, reason in precisions.items() if reason is None)
    for fqn, module in model.named_modules():
        if fqn in precisions:
            assert (type(module).__name__ == "Float8Linear") == (precisions[fqn] is None), fqn
    assert all(param is weights[name] for name, param in model.named_parameters())
    summary = float8_summary(model, section, converted).splitlines()
    assert summary[0] == (f"Float8 training: {len(converted)} modules compute in float8 "
                          "(Linear tensorwise, emulated)")
    assert "  in high precision as the LM head: output" in summary
    assert ("  in high precision as its layer kind (mixture of experts) keeps it: "
            "layers.5.moe.router.gate, layers.8.moe.router.gate") in summary
    assert any(line.endswith("and 3 more") for line in summary)  # CSA's six compressor Linears

    odd = linear_precisions(built("debug"), section)  # GDN's in_proj: 768 + 4 beta + 4 alpha
    assert odd["layers.6.gdn.in_proj"] == "as its widths (256, 776) are not multiples of 16"
    assert odd["layers.2.attention.wq"] is None and odd["layers.6.gdn.out_proj"] is None


class Fields:
    def __init__(self, **values):
        self.__dict__.update(dict(recipe_name=None, emulate=False, filter_fqns=[],
                                  enable_fsdp_float8_all_gather=False,
                                  precompute_float8_dynamic_scale_for_fsdp=False), **values)


def test_the_job_option_reads_torchtitans_words():
    assert float8_section([], Fields()) == Float8Section()
    section = float8_section(["quantize.linear.float8"],
                             Fields(recipe_name="rowwise", emulate=True, filter_fqns=["wq"]))
    assert section == Float8Section(enable=True, recipe_name="rowwise", emulate=True,
                                    filter_fqns=("wq",))
    experts = float8_section(["quantize.grouped_mm.float8"], Fields(emulate=True),
                             "layers.2,layers.4")
    assert experts == Float8Section(emulate=True, grouped_mm=True,
                                    grouped_mm_fqns=("layers.2", "layers.4"))
    model = built("debug_moe")
    assert apply_float8(model, experts) == ["layers.2.moe.experts", "layers.4.moe.experts"]
    assert type(model.layers["2"].moe.experts).__name__ == "GroupedExperts"  # its class, extended
    assert all(type(module).__name__ == "Linear" for module in model.modules()
               if isinstance(module, nn.Linear))


@pytest.mark.parametrize("converters, fields, message", [
    (["quantize.linear.fp4"], {}, r"model.converters \['quantize.linear.fp4'\]: titan_hybrid "
                                  "converts"),
    (["quantize.linear.float8"], {"recipe_name": "blockwise"},
     "recipe_name 'blockwise' is not one of"),
    (["quantize.linear.float8"], {"recipe_name": "rowwise", "enable_fsdp_float8_all_gather": True},
     "enable_fsdp_float8_all_gather needs tensorwise scaling"),
])
def test_what_we_cannot_run_is_refused_by_field(converters, fields, message):
    with pytest.raises(ValueError, match=message):
        float8_section(converters, Fields(**fields))


def test_fsdp_gathers_float8_weights_with_precomputed_scales(one_rank_mesh):
    """enable_fsdp_float8_all_gather: FSDP2 gathers each float8 Linear's weight as float8
    bytes and a scale (torchao's weight subclass); after an optimizer step,
    float8_scales_step_hook's hook sets every such scale to e4m3's largest value over the
    weight's largest magnitude, which the next gather uses."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from titan_hybrid.parallel.data_parallel import apply_data_parallel
    from titan_hybrid.quantize.float8 import float8_scales_step_hook

    args = dataclasses.replace(copy.deepcopy(hybrid_flavors["debug"]), pattern="M*-", dim=64)
    model = HybridModel(args)
    model.init_weights()
    converted = apply_float8(model, Float8Section(enable=True, emulate=True,
                                                  enable_fsdp_float8_all_gather=True))
    apply_data_parallel(model, one_rank_mesh, strategy="optim_grads_params",
                        param_dtype=torch.float32, reduce_dtype=torch.float32)
    locals_ = [model.get_submodule(fqn).weight.to_local() for fqn in converted]
    assert locals_ and all(isinstance(w, WeightWithDynamicFloat8CastTensor) for w in locals_)
    (data,), _ = locals_[0].fsdp_pre_all_gather(one_rank_mesh)
    assert data.dtype == E4M3

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randint(0, args.vocab_size, (2, 16))).square().mean().backward()
    optimizer.step()
    float8_scales_step_hook([model])()
    # FSDP's first forward (its lazy init) gives each parameter its local tensor again; the
    # DTensor's own (to_local() hands out a view), where torchao sets the scale
    locals_ = [model.get_submodule(fqn).weight._local_tensor for fqn in converted]
    for local in locals_:
        expected = torch.finfo(E4M3).max / local._tensor.abs().max().double()
        assert local._precomputed_scale.item() == pytest.approx(expected.item(), rel=1e-6)


def test_each_kinds_high_precision_modules_are_its_mixers_submodules():
    """A name in a kind's table entry that its mixer lacks would keep nothing in high
    precision: every one names a submodule holding Linear modules (MoE with its optional
    shared-expert gate on)."""
    from titan_hybrid.model.layer_kinds import LAYER_KINDS

    args = copy.deepcopy(hybrid_flavors["debug"])
    args.moe.shared_expert_gate = True
    named = [kind for kind in LAYER_KINDS.values() if kind.high_precision_modules]
    assert {kind.name for kind in named} >= {"moe", "dsa", "compressed_sparse_attention",
                                              "heavily_compressed_attention"}
    for kind in named:
        mixer = kind.build(args.section(kind), args.dim, args.norm_eps)
        for name in kind.high_precision_modules:
            module = mixer.get_submodule(name)
            assert any(isinstance(m, nn.Linear) for m in module.modules()), (kind.name, name)


@pytest.mark.parametrize("emulate, width, hidden", [(True, 32, 48), (False, 32, 48),
                                                    (False, 24, 40)])
def test_the_float8_grouped_gemm_computes_each_experts_rowwise_float8_products(emulate, width,
                                                                              hidden):
    """Forward and both gradients equal, expert by expert, the float64 products of operands
    quantized rowwise along each GEMM's contraction (power-of-2 scales, e4m3), the weight
    gradient's scaled over each expert's own rows; an empty expert gets a zero gradient.
    Emulated (float8 rounding, float32 GEMMs) and on the CPU's float8 GEMM kernel, whose
    operands are padded to multiples of 16 (24 x 40 experts; 5- and 11-row experts)."""
    from titan_hybrid.ops.float8_grouped_mm import float8_grouped_mm

    torch.manual_seed(0)
    counts = [5, 0, 11, 16]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    a = torch.randn(sum(counts), width, requires_grad=True)
    b = torch.randn(len(counts), width, hidden, requires_grad=True)
    out = float8_grouped_mm(a, b, offs, emulate=emulate)
    grad = torch.randn_like(out)
    out.backward(grad)

    def q(t, dim):
        return quantized(t, E4M3, dim, power_of_2=True)

    rows = 0
    for expert, count in enumerate(counts):
        a_e, g_e, b_e = a[rows:rows + count], grad[rows:rows + count], b[expert]
        if count:
            assert relative(out[rows:rows + count], q(a_e, -1) @ q(b_e, 0)) <= 1e-6
            assert relative(a.grad[rows:rows + count], q(g_e, -1) @ q(b_e.t(), 0)) <= 1e-6
            assert relative(b.grad[expert], q(a_e.t(), -1) @ q(g_e, 0)) <= 1e-6
            assert relative(b.grad[expert], a_e.t().double() @ g_e.double()) >= 0.01
        else:
            assert torch.equal(b.grad[expert], torch.zeros_like(b.grad[expert]))
        rows += count


def test_the_float8_grouped_gemm_compiles_as_one_graph():
    """The float8 kernel's loop over experts reads the group ends on the host: inside custom
    ops, so `fullgraph=True` passes through it, forward and backward, with the eager result
    (aot_eager: dynamo and AOTAutograd trace it; inductor would only compile around it)."""
    from titan_hybrid.ops.float8_grouped_mm import float8_grouped_mm

    torch.manual_seed(0)
    offs = torch.tensor([7, 7, 20], dtype=torch.int32)
    a = torch.randn(20, 32, requires_grad=True)
    b = torch.randn(3, 32, 16, requires_grad=True)

    def step(a, b):
        return (float8_grouped_mm(a, b, offs, emulate=False) ** 2).sum()

    eager = torch.autograd.grad(step(a, b), (a, b))
    compiled = torch.autograd.grad(torch.compile(step, backend="aot_eager", fullgraph=True)(
        a, b), (a, b))
    for ours, reference in zip(compiled, eager):
        assert torch.equal(ours, reference)


def test_kda_keeps_its_projections_in_high_precision_when_asked():
    """kda.high_precision_projections (Megatron's kda_disable_fp8): every Linear of the K
    layers stays in high precision, for that reason; otherwise they compute in float8."""
    section = Float8Section(enable=True, emulate=True)
    for keep in (False, True):
        model = built("debug_kda")
        model.model_args.kda.high_precision_projections = keep
        precisions = linear_precisions(model, section)
        kda = {fqn: reason for fqn, reason in precisions.items() if ".kda." in fqn}
        assert len(kda) == 2 * 9  # two K layers: q, k, v, f_a, f_b, g_a, g_b, b, o
        wide = {fqn: reason for fqn, reason in kda.items() if not fqn.endswith("b_proj")
                or fqn.endswith(("f_b_proj", "g_b_proj"))}
        if keep:
            assert set(wide.values()) == {"as its layer kind (Kimi delta attention) keeps it"}
        else:
            assert set(wide.values()) == {None}

"""Every Mamba / attention / MLP / MoE / GDN layer and every bracket group is its own FSDP unit."""

import copy
import dataclasses
import warnings

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

import titan_hybrid.torchtitan_plugin  # noqa: F401  (TrainSpec, dataset; CPU runtime)
from titan_hybrid.model.args import hybrid_flavors
from titan_hybrid.model.model import HybridLayer, HybridModel, HybridStack
from titan_hybrid.parallel.data_parallel import SHARDING_STRATEGIES, apply_data_parallel


def unit_params(module):
    state = module._get_fsdp_state()
    group = state._fsdp_param_group
    return [] if group is None else [p._module_info.param_name for p in group.fsdp_params]


@pytest.mark.parametrize("flavor", ["debug", "debug_moe", "debug_grouped"])
@pytest.mark.parametrize("strategy", ["optim_grads_params", "no_shard"])
def test_each_layer_and_group_is_a_unit(one_rank_mesh, flavor, strategy):
    args = copy.deepcopy(hybrid_flavors[flavor])
    with torch.device("meta"):
        model = HybridModel(args)
    apply_data_parallel(model, one_rank_mesh, strategy=strategy, param_dtype=torch.float32,
                        reduce_dtype=torch.float32)
    for key, layer in model.layers.items():
        assert isinstance(layer, FSDPModule), f"layers.{key}"
        if isinstance(layer, HybridStack):  # a bracket group is ONE unit with its sub-layers
            for sub in layer.layers.values():
                assert not isinstance(sub, FSDPModule)
            assert len(unit_params(layer)) == len(list(layer.parameters()))
    for depth in model.mtp:
        assert isinstance(depth, FSDPModule)
    assert isinstance(model.tok_embeddings, FSDPModule)
    # The root unit holds no parameters: nothing (no Mamba layer in particular) stays gathered
    # for the whole step.
    assert unit_params(model) == []
    # Every parameter is managed by exactly one unit.
    states = {id(m._get_fsdp_state()): m for m in model.modules() if isinstance(m, FSDPModule)}
    managed = [name for m in states.values() for name in unit_params(m)]
    assert len(managed) == len(list(model.parameters()))
    assert any(isinstance(m, HybridLayer) and m.symbol == "M" for m in model.modules())


@pytest.mark.parametrize("strategy", ["optim_grads_params", "no_shard"])
def test_a_tied_head_is_one_unit_with_the_embedding_and_the_final_norm(one_rank_mesh, strategy):
    """FSDP would shard a weight shared by two units twice: the embedding, the final norm and
    the head are one group, whose one parameter stays the head's and the embedding's."""
    args = dataclasses.replace(copy.deepcopy(hybrid_flavors["debug_moe"]),
                               enable_weight_tying=True)
    with torch.device("meta"):
        model = HybridModel(args)
    apply_data_parallel(model, one_rank_mesh, strategy=strategy, param_dtype=torch.float32,
                        reduce_dtype=torch.float32)
    group = model.tok_embeddings._get_fsdp_state()
    assert model.norm._get_fsdp_state() is group and model.output._get_fsdp_state() is group
    assert sorted(unit_params(model.tok_embeddings)) == ["weight", "weight"]  # embedding, norm
    assert model.output.weight is model.tok_embeddings.weight
    states = {id(m._get_fsdp_state()): m for m in model.modules() if isinstance(m, FSDPModule)}
    managed = [name for m in states.values() for name in unit_params(m)]
    assert len(managed) == len(list(model.parameters()))


def test_unknown_strategy_is_rejected(one_rank_mesh):
    with torch.device("meta"):
        model = HybridModel(copy.deepcopy(hybrid_flavors["debug"]))
    with pytest.raises(ValueError, match="data_parallel_sharding_strategy 'zero3'"):
        apply_data_parallel(model, one_rank_mesh, strategy="zero3", param_dtype=torch.float32,
                            reduce_dtype=torch.float32)
    assert "optim" in SHARDING_STRATEGIES


def _record_core_inputs(model) -> dict[str, set]:
    """dtypes of the parameters the Mamba2 / GDN cores receive, and of the projections'
    weights, as seen during forward."""
    seen: dict[str, set] = {"ssm": set(), "projections": set(), "activations": set()}
    for layer in model.modules():
        if not isinstance(layer, HybridLayer) or not layer.kind.full_precision_params:
            continue
        core = getattr(layer.mixer, layer.kind.context_parallel.core)
        # ConvAndScan(xbc, dt, conv_w, conv_b, A_log, D, dt_bias, layout);
        # ConvAndDeltaRule(qkv, alpha, beta, conv_w, A_log, dt_bias, layout)
        ssm_args = slice(4, 7) if layer.symbol == "M" else slice(4, 6)

        def record(module, args, ssm_args=ssm_args) -> None:
            seen["ssm"].update(a.dtype for a in args[ssm_args])
            seen["activations"].add(args[0].dtype)

        core.register_forward_pre_hook(record)
        layer.mixer.out_proj.register_forward_pre_hook(
            lambda module, args: seen["projections"].add(module.weight.dtype))
    return seen


@pytest.mark.parametrize("strategy", ["optim_grads_params", "no_shard"])
def test_bf16_policy_keeps_ssm_parameters_in_fp32(one_rank_mesh, strategy):
    args = dataclasses.replace(copy.deepcopy(hybrid_flavors["debug"]), pattern="M*G-", dim=64)
    torch.manual_seed(0)
    model = HybridModel(args)
    model.init_weights()
    apply_data_parallel(model, one_rank_mesh, strategy=strategy, param_dtype=torch.bfloat16,
                        reduce_dtype=torch.float32)
    seen = _record_core_inputs(model)
    out = model(torch.randint(0, args.vocab_size, (2, 32)))
    out.float().square().mean().backward()
    assert seen == {"ssm": {torch.float32}, "projections": {torch.bfloat16},
                    "activations": {torch.bfloat16}}
    assert out.dtype == torch.bfloat16
    # Each Mamba2 / GDN layer: its projections' unit in bf16, the layer's own unit in fp32.
    for layer in model.layers.values():
        if layer.kind.full_precision_params:
            assert isinstance(layer.mixer.in_proj, FSDPModule)
            assert layer.mixer.in_proj._get_fsdp_state() is (
                layer.mixer.out_proj._get_fsdp_state())
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


def test_autocast_path_keeps_ssm_parameters_in_fp32():
    """One device: torchtitan runs forward under autocast with fp32 parameters."""
    args = dataclasses.replace(copy.deepcopy(hybrid_flavors["debug"]), pattern="M*G-", dim=64)
    model = HybridModel(args)
    model.init_weights()
    seen = _record_core_inputs(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randint(0, args.vocab_size, (2, 32)))
    assert seen == {"ssm": {torch.float32}, "projections": {torch.float32},
                    "activations": {torch.bfloat16}}
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("strategy", ["optim_grads_params", "no_shard"])
def test_hyper_connections_are_fp32_units_and_the_hyper_head_is_a_unit(one_rank_mesh, strategy):
    """With hyper-connections under bf16 parameters: each layer's hyper-connection (and each
    hyper head) computes from fp32 weights, the projections from bf16 ones; the root holds no
    parameter (the hyper head is a unit: EP overlap runs one microbatch's forward with the
    other's backward, and a root parameter would be gathered by both).

    No unit returns a view: FSDP2 hands a unit its inputs as views, and the MoE flavor's aux
    loss passes the layers without experts; returned as it came, an in-place op on it would
    skip the unit's pre-backward hook (FSDP2 warns, here an error; pyproject.toml makes it one
    in every in-process test)."""
    from titan_hybrid.model.hyper_connections import HyperConnection, HyperHead

    args = dataclasses.replace(copy.deepcopy(hybrid_flavors["debug_moe"]), hc_mult=4, dim=64)
    torch.manual_seed(0)
    model = HybridModel(args)
    model.init_weights()
    apply_data_parallel(model, one_rank_mesh, strategy=strategy, param_dtype=torch.bfloat16,
                        reduce_dtype=torch.float32)
    seen: dict[str, set] = {"hyper": set(), "projections": set()}
    for module in model.modules():
        if isinstance(module, (HyperConnection, HyperHead)):
            assert isinstance(module, FSDPModule)
            module.register_forward_pre_hook(lambda m, args: seen["hyper"].update(
                p.dtype for p in m.parameters(recurse=False)))
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(
                lambda m, args: seen["projections"].add(m.weight.dtype))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="FSDP2-wrapped module")
        out = model(torch.randint(0, args.vocab_size, (2, 32)))
    assert args.moe is not None and out[1].requires_grad  # an aux loss that FSDP2 hooks
    out[0].float().square().mean().backward()
    assert seen == {"hyper": {torch.float32}, "projections": {torch.bfloat16}}
    if strategy == "optim_grads_params":
        assert unit_params(model) == []
        assert isinstance(model.hc_head, FSDPModule) and isinstance(model.mtp[0].hc_head,
                                                                    FSDPModule)

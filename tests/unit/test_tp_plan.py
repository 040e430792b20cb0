"""TP layouts come from the layer modules' declarations, by FQN; fused layouts interleave per
rank."""

import copy

import pytest
import torch
from torch import nn

import titan_hybrid.torchtitan_plugin  # noqa: F401  (TrainSpec, dataset; CPU runtime)
from tests.run_configs import run_from_args
from titan_hybrid.model.args import hybrid_flavors
from titan_hybrid.model.common import TPLayout, sharded, tensor_parallel_layouts
from titan_hybrid.model.model import HybridModel
from titan_hybrid.parallel.tensor_parallel import deinterleave_from_tp, interleave_for_tp
from titan_hybrid.parallel.validate import validate_tensor_parallel


def layouts(pattern):
    args = copy.deepcopy(hybrid_flavors["debug_moe"])
    args.pattern = pattern
    with torch.device("meta"):
        model = HybridModel(args)
    result = tensor_parallel_layouts(model)
    assert set(result) == {name for name, _ in model.named_parameters()}
    return args, result


def test_mamba_parameters_are_sharded_by_their_own_declarations():
    args, plan = layouts("M")
    d_inner, heads = args.mamba_d_inner, args.mamba_n_heads
    gn = args.mamba.n_groups * args.mamba.d_state
    assert plan["layers.0.mamba.in_proj.weight"] == TPLayout(
        0, (d_inner, d_inner, gn, gn, heads), partition_names=(".z", ".x", ".B", ".C", ".dt"))
    conv = TPLayout(0, (d_inner, gn, gn), partition_names=(".x", ".B", ".C"))
    assert plan["layers.0.mamba.conv1d.weight"] == conv
    assert plan["layers.0.mamba.conv1d.bias"] == conv
    for name in ("A_log", "D", "dt_bias"):
        assert plan[f"layers.0.mamba.{name}"] == TPLayout(0)
    # A norm by class name (GatedGroupRMSNorm), yet sharded: the declaration decides.
    assert plan["layers.0.mamba.norm.weight"] == TPLayout(0)
    assert plan["layers.0.mamba.out_proj.weight"] == TPLayout(1)
    # The residual-stream norm in front of the mixer is replicated.
    assert plan["layers.0.mamba_norm.weight"].shard_dim is None


def test_mla_with_a_full_rank_query_splits_q_proj_by_heads():
    args = copy.deepcopy(hybrid_flavors["debug"])
    args.pattern, args.mla.q_lora_rank = "+", None
    with torch.device("meta"):
        layer = HybridModel(args).layers["0"].mla
    plan = tensor_parallel_layouts(layer)
    assert not hasattr(layer, "q_a_proj") and plan["q_proj.weight"] == TPLayout(0)
    assert plan["kv_a_proj_with_mqa.weight"].shard_dim is None


def test_attention_mlp_gdn_moe_layouts():
    args, plan = layouts("*-GE")
    for name in ("wq", "wk", "wv"):
        assert plan[f"layers.0.attention.{name}.weight"] == TPLayout(0)
    assert plan["layers.0.attention.wo.weight"] == TPLayout(1)
    hidden = args.mlp.hidden_dim
    assert plan["layers.1.mlp.fc1.weight"] == TPLayout(0, (hidden, hidden),
                                                       partition_names=("_w", "_v"))
    assert plan["layers.1.mlp.fc2.weight"] == TPLayout(1)
    g = args.gdn
    key, value = g.n_key_heads * g.key_head_dim, g.n_value_heads * g.value_head_dim
    assert plan["layers.2.gdn.in_proj.weight"] == TPLayout(
        0, (key, key, value, value, g.n_value_heads, g.n_value_heads),
        partition_names=(".query", ".key", ".value", ".z", ".beta", ".alpha"))
    # GDN's output norm is shared by all heads: replicated, with a partial gradient per rank.
    assert plan["layers.2.gdn.norm.weight"] == TPLayout(None, partial_grad=True)
    assert plan["layers.3.moe.experts.fc1"] == TPLayout(1, (args.moe.hidden_dim,) * 2,
                                                        partition_names=("_w", "_v"))
    assert plan["layers.3.moe.experts.fc2"] == TPLayout(2)
    assert plan["layers.3.moe.router.gate.weight"].shard_dim is None


def test_undeclared_parameters_are_replicated_and_declarations_decide():
    class VendorProjection(nn.Linear):
        pass

    class Declared(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = VendorProjection(4, 8)

        def tensor_parallel_layouts(self):
            return {"proj.weight": sharded(1)}

    assert tensor_parallel_layouts(VendorProjection(4, 8)) == {"weight": TPLayout(None),
                                                               "bias": TPLayout(None)}
    outer = nn.Sequential(Declared())
    assert tensor_parallel_layouts(outer) == {"0.proj.weight": TPLayout(1),
                                              "0.proj.bias": TPLayout(None)}
    # A pipeline stage is a deep copy: the declarations come with the class.
    assert tensor_parallel_layouts(copy.deepcopy(outer)) == tensor_parallel_layouts(outer)


def test_interleave_puts_each_ranks_slice_of_every_component_together():
    layout = TPLayout(0, (4, 4, 2))
    full = torch.arange(10)  # components [0..3], [4..7], [8, 9]
    assert interleave_for_tp(full, layout, 2).tolist() == [0, 1, 4, 5, 8, 2, 3, 6, 7, 9]
    for tp in (1, 2):
        assert torch.equal(deinterleave_from_tp(interleave_for_tp(full, layout, tp), layout, tp),
                           full)
    matrix = torch.randn(12, 3)
    layout = TPLayout(0, (6, 6))
    assert torch.equal(deinterleave_from_tp(interleave_for_tp(matrix, layout, 3), layout, 3),
                       matrix)


@pytest.mark.parametrize("field, change, message", [
    ("mamba", {"n_groups": 1}, "mamba.n_groups=1 is not divisible"),
    ("attention", {"n_kv_heads": 1, "n_heads": 4}, "attention.n_kv_heads=1 is not divisible"),
    ("gdn", {"n_key_heads": 1, "n_value_heads": 2}, "gdn.n_key_heads=1 is not divisible"),
    ("mlp", {"hidden_dim": 511}, "mlp.hidden_dim=511 is not divisible"),
    ("mla", {"n_heads": 3}, "mla.n_heads=3 is not divisible by parallelism.tensor_parallel_"
                            "degree=2: each rank must hold whole n_heads"),
    ("dsa", {"n_heads": 5}, "dsa.n_heads=5 is not divisible"),
])
def test_tp_divisibility_errors_name_the_field(field, change, message):
    args = copy.deepcopy(hybrid_flavors["debug"])
    args.pattern = {"mla": "M+-", "dsa": "MD-"}.get(field, args.pattern)
    for key, value in change.items():
        setattr(getattr(args, field), key, value)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        validate_tensor_parallel(args, 2, seq_len=256, sequence_parallel=True)
    validate_tensor_parallel(copy.deepcopy(hybrid_flavors["debug"]), 2, seq_len=256,
                             sequence_parallel=True)


def test_layout_validation_names_field_value_and_rule():
    from titan_hybrid.parallel.validate import validate_layout

    def job(*args, model=copy.deepcopy(hybrid_flavors["debug_moe"])):
        return run_from_args(*args, model=model)

    with pytest.raises(ValueError, match=r"moe.num_experts=8 is not divisible by "
                                         r"parallelism.expert_parallel_degree=3"):
        validate_layout(job("--parallelism.expert_parallel_degree", "3"), 3)
    with pytest.raises(ValueError, match="has no MoE"):
        validate_layout(job("--parallelism.expert_parallel_degree", "2",
                            model=copy.deepcopy(hybrid_flavors["debug"])), 2)
    with pytest.raises(ValueError, match=r"world size 4 != data_parallel_replicate_degree\(1\)"):
        validate_layout(job("--parallelism.data_parallel_shard_degree", "3"), 4)
    with pytest.raises(ValueError, match="mamba.n_groups=2 is not divisible by "
                                         "parallelism.tensor_parallel_degree=4"):
        validate_layout(job("--parallelism.tensor_parallel_degree", "4"), 4)
    validate_layout(job("--parallelism.tensor_parallel_degree", "2"), 4)

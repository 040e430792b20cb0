"""Every Mamba / attention / MLP / MoE / GDN layer and every bracket group is its own FSDP unit."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

import titan_hybrid.torchtitan_plugin  # noqa: F401  (TrainSpec, dataset; CPU runtime)
from titan_hybrid.model.args import hybrid_flavors
from titan_hybrid.model.model import HybridLayer, HybridModel, HybridStack
from titan_hybrid.parallel.data_parallel import SHARDING_STRATEGIES, apply_data_parallel


@pytest.fixture(scope="module")
def mesh():
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    if created:
        dist.destroy_process_group()


def unit_params(module):
    state = module._get_fsdp_state()
    group = state._fsdp_param_group
    return [] if group is None else [p._module_info.param_name for p in group.fsdp_params]


@pytest.mark.parametrize("flavor", ["debug", "debug_moe", "debug_grouped"])
@pytest.mark.parametrize("strategy", ["optim_grads_params", "no_shard"])
def test_each_layer_and_group_is_a_unit(mesh, flavor, strategy):
    args = copy.deepcopy(hybrid_flavors[flavor])
    with torch.device("meta"):
        model = HybridModel(args)
    apply_data_parallel(model, mesh, strategy=strategy, param_dtype=torch.float32,
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
    # Every parameter is managed by exactly one unit (norm + output share one).
    states = {id(m._get_fsdp_state()): m for m in model.modules() if isinstance(m, FSDPModule)}
    managed = [name for m in states.values() for name in unit_params(m)]
    assert len(managed) == len(list(model.parameters()))
    assert any(isinstance(m, HybridLayer) and m.symbol == "M" for m in model.modules())


def test_unknown_strategy_is_rejected(mesh):
    with torch.device("meta"):
        model = HybridModel(copy.deepcopy(hybrid_flavors["debug"]))
    with pytest.raises(ValueError, match="data_parallel_sharding_strategy 'zero3'"):
        apply_data_parallel(model, mesh, strategy="zero3", param_dtype=torch.float32,
                            reduce_dtype=torch.float32)
    assert "optim" in SHARDING_STRATEGIES

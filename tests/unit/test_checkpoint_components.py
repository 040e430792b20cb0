"""Fused tensors split into components on one process (no mesh): shapes, data, keys, casts."""

import torch

import titan_hybrid.torchtitan_plugin  # noqa: F401  (TrainSpec, dataset; CPU runtime)
from titan_hybrid.checkpoint.split import ComponentChunks, merge_state_dict, split_state_dict
from titan_hybrid.checkpoint.state import logical_keys
from titan_hybrid.parallel.tensor_parallel import TPLayout

LAYOUT = TPLayout(0, (4, 4, 2), partition_names=(".x", ".B", ".C"))


def test_split_merge_round_trip_and_component_data():
    weight = torch.arange(30.0).view(10, 3)
    state = {"layers.0.mamba.conv1d.weight": weight, "norm.weight": torch.ones(3)}
    split = split_state_dict(state, {"layers.0.mamba.conv1d.weight": (LAYOUT, weight)})
    assert sorted(split) == ["layers.0.mamba.conv1d.weight.B", "layers.0.mamba.conv1d.weight.C",
                             "layers.0.mamba.conv1d.weight.x", "norm.weight"]
    b = split["layers.0.mamba.conv1d.weight.B"]
    assert isinstance(b, ComponentChunks) and tuple(b.shape) == (4, 3)
    (offsets, view), = b.chunks
    assert tuple(offsets) == (0, 0) and torch.equal(view, weight[4:8])
    view.fill_(-1)  # pieces are views: a load lands in the parameter
    assert (weight[4:8] == -1).all()
    merged = merge_state_dict(split)
    assert merged["layers.0.mamba.conv1d.weight"] is weight and set(merged) == set(state)
    half = b.to(torch.bfloat16)
    assert half.chunks[0][1].dtype == torch.bfloat16 and tuple(half.shape) == (4, 3)


def test_grouped_keys_take_the_groups_logical_index():
    state = {"layers.0.layers.0.attention.wq.weight": 1, "layers.0.layers.1.mlp.fc1.weight_w": 2,
             "state.layers.3.layers.5.mamba.A_log.exp_avg": 3, "layers.2.mamba.D": 4,
             # two sub-layers of one kind in a group would collide: they keep their keys
             "layers.4.layers.0.mamba.D": 5, "layers.4.layers.1.mamba.D": 6}
    renamed, originals = logical_keys(state)
    assert set(renamed) == {"layers.0.attention.wq.weight", "layers.0.mlp.fc1.weight_w",
                            "state.layers.3.mamba.A_log.exp_avg", "layers.2.mamba.D",
                            "layers.4.layers.0.mamba.D", "layers.4.layers.1.mamba.D"}
    assert originals["layers.0.mlp.fc1.weight_w"] == "layers.0.layers.1.mlp.fc1.weight_w"


def test_layers_wrapped_for_activation_checkpointing_save_their_fused_tensors_split():
    """The plan's layouts are made before activation checkpointing wraps layers; a wrapped
    layer's fused tensors (Mamba2's in_proj, conv1d) must still be saved as components, or a
    checkpoint's keys would depend on the AC mode and a TP-interleaved tensor would be saved
    whole."""
    import dataclasses

    from titan_hybrid.checkpoint.state import SplitModelWrapper
    from titan_hybrid.config.sections import ActivationCheckpointSection
    from titan_hybrid.model.args import resolve_model_args
    from titan_hybrid.model.common import tensor_parallel_layouts
    from titan_hybrid.model.model import HybridModel
    from titan_hybrid.parallel.activation_checkpoint import apply_activation_checkpointing

    args = resolve_model_args("debug", pattern="M-M-G-", seq_len=64)
    plain = HybridModel(args)
    wrapped = HybridModel(dataclasses.replace(args))
    layouts = tensor_parallel_layouts(wrapped)
    apply_activation_checkpointing(
        wrapped, ActivationCheckpointSection(mode="selective", selective_ac_option="2"),
        model_compile_enabled=False, base_folder="")
    assert any("_checkpoint_wrapped_module" in name for name, _ in wrapped.named_parameters())
    keys = SplitModelWrapper(wrapped, layouts).state_dict().keys()
    assert keys == SplitModelWrapper(plain, tensor_parallel_layouts(plain)).state_dict().keys()
    assert {"layers.0.mamba.in_proj.weight.z", "layers.2.mamba.in_proj.weight.z"} <= set(keys)
    assert not any(key.endswith(("in_proj.weight", "conv1d.weight")) for key in keys)

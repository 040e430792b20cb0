"""HF Nemotron-H interop, single process, against `transformers`' NemotronHForCausalLM:
our weights written through the state-dict adapter load into transformers with the same
logits, and a transformers checkpoint loads into our model with the same logits. Both go
through DCP's Hugging Face storage writer / reader, as torchtitan's checkpointer does.

Tolerance 1e-5 absolute on logits of order 1 (fp32; the two SSD implementations sum in a
different order)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers  # noqa: E402  (the test extra installs it)
from torch.distributed.checkpoint import HuggingFaceStorageWriter

from titan_hybrid.checkpoint.state import SplitModelWrapper
from titan_hybrid.hf.families import FAMILIES
from titan_hybrid.hf.nemotron_h import (
    check_nemotron_h_compatible,
    model_args_from_nemotron_h_config,
    nemotron_h_config,
)
from titan_hybrid.model.args import AttentionArgs, MambaArgs, MLPArgs, hybrid_flavors
from titan_hybrid.model.common import tensor_parallel_layouts
from titan_hybrid.model.model import HybridModel

VOCAB, SEQ = 96, 20  # SEQ is not a multiple of the chunk size: both pad the last chunk


def small_args(pattern="M-M*-[M-]"):
    return dataclasses.replace(
        hybrid_flavors["debug_nemotron_h"], pattern=pattern, dim=32, vocab_size=VOCAB,
        max_seq_len=64, init_seed=3,
        attention=AttentionArgs(n_heads=4, n_kv_heads=2, head_dim=8, use_rope=False),
        mlp=MLPArgs(hidden_dim=40, activation="relu2"),
        mamba=MambaArgs(d_state=8, head_dim=8, n_groups=2, chunk_size=8,
                        dt_limit=(1e-3, float("inf"))))


def our_model(args):
    model = HybridModel(args)
    model.init_weights()
    return model


def tokens():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


def hf_logits(path):
    model = transformers.NemotronHForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(tokens()).logits


def distinctive_model(args):
    """Our model with A_log / D / dt_bias / conv biases distinctive, so that a misplaced
    component shows."""
    model = our_model(args)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model


def split_to_hf(args, model) -> dict:
    """The HF state dict of titan_hybrid's split state dict (its checkpoint manager's)."""
    split = SplitModelWrapper([model], tensor_parallel_layouts(model)).state_dict()
    return FAMILIES["nemotron_h"].adapter(args).to_hf(split)


def save_hf(hf_state_dict: dict, folder, args) -> None:
    """An HF folder transformers loads: the tensors (DCP's safetensors writer) and config.json."""
    dcp.save(hf_state_dict, storage_writer=HuggingFaceStorageWriter(
        path=str(folder), save_distributed=True, enable_consolidation=True))
    (folder / "config.json").write_text(json.dumps(nemotron_h_config(args)))


def test_our_checkpoint_in_hf_format_loads_into_transformers(tmp_path):
    args = small_args()
    model = distinctive_model(args)
    hf_state_dict = split_to_hf(args, model)
    assert "backbone.layers.0.mixer.in_proj.weight" in hf_state_dict
    assert "backbone.layers.6.mixer.up_proj.weight" in hf_state_dict  # the group's 2nd layer
    save_hf(hf_state_dict, tmp_path, args)

    with torch.no_grad():
        ours = model(tokens())
    theirs = hf_logits(str(tmp_path))
    assert ours.shape == theirs.shape == (2, SEQ, VOCAB)
    assert (ours - theirs).abs().max() < 1e-5, (ours - theirs).abs().max()


def test_transformers_checkpoint_loads_into_our_model(tmp_path):
    config = transformers.NemotronHConfig(**{
        key: value for key, value in nemotron_h_config(small_args("M-*M-")).items()
        if key not in ("architectures", "model_type")})
    torch.manual_seed(1)
    reference = transformers.NemotronHForCausalLM(config)
    with torch.no_grad():
        for param in reference.parameters():
            param.add_(0.05 * torch.randn_like(param))
    reference.save_pretrained(str(tmp_path))
    with torch.no_grad():
        theirs = reference(tokens()).logits

    with open(os.path.join(tmp_path, "config.json")) as f:
        args = model_args_from_nemotron_h_config(json.load(f))
    assert args.pattern == "M-*M-" and args.mlp.activation == "relu2"
    args = dataclasses.replace(args, max_seq_len=64)
    model = our_model(args)
    wrapper = SplitModelWrapper([model], tensor_parallel_layouts(model))
    adapter = FAMILIES["nemotron_h"].adapter(args, str(tmp_path))
    hf_state_dict = adapter.to_hf(wrapper.state_dict())
    dcp.load(hf_state_dict, storage_reader=adapter.get_hf_storage_reader(str(tmp_path)))
    wrapper.load_state_dict(adapter.from_hf(hf_state_dict))
    with torch.no_grad():
        ours = model(tokens())
    assert (ours - theirs).abs().max() < 1e-5, (ours - theirs).abs().max()


def test_plain_tensor_conversion_round_trips():
    args = small_args()
    model = our_model(args)
    plain = {key: value.clone() for key, value in model.state_dict().items()}
    adapter = FAMILIES["nemotron_h"].adapter(args)
    fused = {key: value for key, value in plain.items() if "in_proj" in key or "conv1d" in key}
    # A fused-key state dict (the model's own) is split by component sizes in from_hf.
    split = adapter.from_hf({
        f"backbone.layers.0.mixer.{name}": fused[f"layers.0.mamba.{name}"]
        for name in ("in_proj.weight", "conv1d.weight", "conv1d.bias")})
    d_inner, group_state = args.mamba_d_inner, args.mamba.n_groups * args.mamba.d_state
    assert split["layers.0.mamba.in_proj.weight.z"].shape == (d_inner, args.dim)
    assert split["layers.0.mamba.in_proj.weight.C"].shape == (group_state, args.dim)
    layer = {key: value for key, value in plain.items()  # the layer's other entries
             if key.startswith("layers.0.") and key not in fused}
    back = adapter.to_hf({**layer, **split})
    assert torch.equal(back["backbone.layers.0.mixer.in_proj.weight"],
                       fused["layers.0.mamba.in_proj.weight"])


def test_a_plain_state_dict_converts_whole_and_nothing_is_dropped(tmp_path):
    """torchtitan's own checkpointer (a user's torchtitan 0.3 job) hands the adapter the
    model's plain state dict, with in_proj / conv1d fused and grouped layers under their own
    keys: the same HF keys as the split one gives, each fused tensor the parameter itself (a
    load lands in it), and transformers computes our logits from them; a held layer's tensor
    without a source is an error naming it."""
    args = small_args()
    model = distinctive_model(args)
    split = split_to_hf(args, model)
    plain_state = model.state_dict()
    plain = FAMILIES["nemotron_h"].adapter(args)
    hf = plain.to_hf(plain_state)
    assert hf.keys() == split.keys() and len(hf) == len(plain_state)
    assert hf["backbone.layers.0.mixer.in_proj.weight"] is plain_state["layers.0.mamba.in_proj.weight"]
    save_hf(hf, tmp_path, args)
    with torch.no_grad():
        ours = model(tokens())
    assert (ours - hf_logits(str(tmp_path))).abs().max() < 1e-5
    back = plain.from_hf(hf)
    assert back.keys() == plain_state.keys()
    assert all(back[key] is plain_state[key] for key in plain_state)
    del plain_state["layers.0.mamba.conv1d.bias"]
    with pytest.raises(ValueError, match=r"no 'layers.0.mamba.conv1d.bias' .* HF tensor "
                                         r"'backbone.layers.0.mixer.conv1d.bias'"):
        plain.to_hf(plain_state)


def test_models_the_format_cannot_hold_are_rejected_by_field():
    with pytest.raises(ValueError, match=r"layer types \['G'\].*mlp.activation='swiglu'"):
        check_nemotron_h_compatible(hybrid_flavors["debug"])
    with pytest.raises(ValueError, match="attention.use_rope=True"):
        check_nemotron_h_compatible(dataclasses.replace(small_args(), attention=AttentionArgs()))
    config = nemotron_h_config(small_args())
    with pytest.raises(ValueError, match="mlp_hidden_act='silu'"):
        model_args_from_nemotron_h_config({**config, "mlp_hidden_act": "silu"})

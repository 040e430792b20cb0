"""DeepSeek-V3 / V3.2 interop: our `+-+-` / `D-D-` models and transformers'
DeepseekV3ForCausalLM / DeepseekV32ForCausalLM give the same logits on the same weights."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v32 import DeepseekV32Config, DeepseekV32ForCausalLM

from titan_hybrid.hf.deepseek import deepseek_config
from titan_hybrid.hf.families import FAMILIES, check_hf_compatible, hybrid_state_dict_adapter
from titan_hybrid.model.args import DSAArgs, MLAArgs, MLPArgs, hybrid_flavors
from titan_hybrid.model.model import HybridModel

SHAPES = dict(n_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
              qk_rope_head_dim=8, v_head_dim=12)
HF = {"+": (DeepseekV3Config, DeepseekV3ForCausalLM),
      "D": (DeepseekV32Config, DeepseekV32ForCausalLM)}


def tiny_args(pattern: str, **mla_changes):
    args = copy.deepcopy(hybrid_flavors["debug"])
    args.pattern, args.dim, args.vocab_size, args.max_seq_len = pattern, 48, 96, 64
    args.norm_eps = 1e-6
    args.mlp = MLPArgs(hidden_dim=40)
    shapes = {**SHAPES, **mla_changes}
    args.mla = MLAArgs(**shapes)
    # 6 of up to 20 keys per query: the sparse path is taken.
    args.dsa = DSAArgs(**shapes, index_n_heads=2, index_head_dim=16, index_topk=6)
    return args


def to_deepseek(state_dict: dict[str, torch.Tensor], args) -> dict:
    """Our model's plain state dict -> DeepSeek's keys (views of its tensors): the family's
    adapter, as an offline conversion uses it."""
    return FAMILIES["deepseek"].adapter(args).to_hf(state_dict)


def from_deepseek(hf_state_dict: dict[str, torch.Tensor], args) -> dict:
    """DeepSeek's keys -> our model's plain state dict: to_hf of such a dict first records
    which halves from_hf joins into fc1."""
    adapter = FAMILIES["deepseek"].adapter(args)
    with torch.device("meta"):
        adapter.to_hf(HybridModel(args).state_dict())
    return adapter.from_hf(hf_state_dict)


@pytest.mark.parametrize("pattern, mla_changes", [
    ("+-+-", {}),
    ("+-+-", {"q_lora_rank": None, "rope_interleave": False}),
    ("+-", {"yarn_factor": 4.0, "yarn_original_max_position_embeddings": 8,
            "yarn_mscale": 1.0, "yarn_mscale_all_dim": 1.0}),
    ("D-D-", {}),
])
def test_logits_match_transformers_deepseek_on_converted_weights(pattern, mla_changes):
    args = tiny_args(pattern, **mla_changes)
    config_class, model_class = HF[pattern[0]]
    torch.manual_seed(0)
    theirs = model_class(config_class(**deepseek_config(args), attn_implementation="eager")).eval()
    ours = HybridModel(args)
    ours.load_state_dict(from_deepseek(theirs.state_dict(), args), strict=True)
    tokens = torch.randint(0, args.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(tokens).logits
        got = ours(tokens)
    got = got[0] if isinstance(got, tuple) else got
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5 * expected.abs().max().item())
    # And back: every HF tensor, unchanged.
    back = to_deepseek(ours.state_dict(), args)
    assert back.keys() == theirs.state_dict().keys()
    assert all(torch.equal(back[key], value) for key, value in theirs.state_dict().items())


@pytest.mark.parametrize("pattern, message", [
    ("M+-", "must be '+-' or 'D-' repeated"),
    ("+-D-", "must be '+-' or 'D-' repeated"),
    ("[+-]", "has bracket groups"),
    ("+-/+-+-", "DeepSeek's MTP layers are one decoder layer a depth"),
    ("+E", "DeepSeek's MoE layers have SwiGLU experts, a sigmoid router with a choice bias"),
    ("+E+-", "must be '+-' or 'D-' repeated, then the same attention with MoE"),
])
def test_models_the_format_cannot_hold_are_named(pattern, message):
    with pytest.raises(ValueError, match=message.replace("+", r"\+")):
        deepseek_config(tiny_args(pattern))


def test_runs_pick_the_adapter_by_layer_kinds_and_it_renames_split_entries():
    """What `--checkpoint.*_in_hf` uses: DeepSeek's adapter for MLA / DSA models, Nemotron-H's
    for the others. It sees fc1 as its checkpoint components (`fc1.weight_w` / `_v`, as
    SplitModelWrapper hands them out) and renames every entry, handing back the same objects."""
    assert (hybrid_state_dict_adapter(tiny_args("M-*-"), None).format_name
            == FAMILIES["nemotron_h"].format_name)
    args = tiny_args("D-D-")
    adapter = hybrid_state_dict_adapter(args, None)
    assert adapter.format_name == FAMILIES["deepseek"].format_name
    model = HybridModel(args)
    # Defined values: before init_weights the parameters are torch.empty, which may hold NaN,
    # and torch.equal(NaN, NaN) is False.
    model.init_weights()
    full = model.state_dict()
    state = {}
    for key, value in full.items():
        if key.endswith("fc1.weight"):
            state[key + "_w"], state[key + "_v"] = value.chunk(2)
        else:
            state[key] = value
    hf = adapter.to_hf(state)
    offline = to_deepseek(full, args)  # the same tensors as the offline conversion's
    assert hf.keys() == offline.keys() and all(torch.equal(hf[k], offline[k]) for k in hf)
    back = adapter.from_hf(hf)
    assert back.keys() == state.keys() and all(back[key] is state[key] for key in state)
    # A pipeline stage's share: only its own entries.
    stage = {key: value for key, value in state.items() if key.startswith("layers.0.")}
    assert set(adapter.to_hf(stage)) == {key for key in hf if key.startswith("model.layers.0.")
                                         and "mlp" not in key and "post_attention" not in key}


def test_a_plain_state_dict_with_fc1_whole_converts_and_nothing_is_dropped():
    """torchtitan's own checkpointer hands the adapter the model's plain state dict (fc1 whole):
    its halves are DeepSeek's gate_proj / up_proj, and from_hf joins them again."""
    args = tiny_args("D-D-")
    model = HybridModel(args)
    model.init_weights()
    plain = model.state_dict()
    adapter = hybrid_state_dict_adapter(args, None)
    hf = adapter.to_hf(plain)
    offline = to_deepseek(plain, args)
    assert hf.keys() == offline.keys() and all(torch.equal(hf[k], offline[k]) for k in hf)
    back = adapter.from_hf(hf)
    assert back.keys() == plain.keys() and all(torch.equal(back[k], plain[k]) for k in plain)
    del plain["layers.1.mlp.fc1.weight"]
    with pytest.raises(ValueError, match=r"HF tensor 'model.layers.0.mlp.gate_proj.weight'"):
        adapter.to_hf(plain)


@pytest.mark.parametrize("pattern, message", [
    ("M+-", "cannot use the HF DeepSeek-V3 / V3.2 format: hybrid.pattern 'M+-' must be"),
    ("M-G-", "cannot use the HF Nemotron-H format: hybrid.pattern 'M-G-' has layer types"),
])
def test_a_model_its_format_cannot_hold_is_refused_with_the_rule(pattern, message):
    with pytest.raises(ValueError) as raised:
        check_hf_compatible(tiny_args(pattern))
    assert message in str(raised.value)
    assert "HF checkpoints take the format of the model's layer kinds: DeepSeek-V3 / V3.2 for " \
        "models with MLA / DSA layers (+, D), DeepSeek-V4 for models with its attention (W C " \
        "H), Nemotron-H for the others" in str(raised.value)

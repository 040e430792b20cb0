"""DeepSeek-V4 attention blocks to and from transformers' deepseek_v4 naming
(hf/deepseek_v4.py).

- Export: our `MC-MH-MW-` model's C, H and W layers become `model.layers.{0,1,2}.self_attn.*`
  of a DeepseekV4ForCausalLM built from the exported config: every self_attn tensor of that
  model is given and nothing else, and each HF attention block then computes what our layer
  computes (float64, the HF model's own rotary tables and mask).
- Import: a DeepseekV4ForCausalLM's random attention blocks loaded into our model give each
  of our layers the HF block's output.
- Refusals by name: layer types in another order, another head count, sections that disagree
  on a value transformers holds once, and patterns the format cannot hold.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from tests.unit.test_deepseek_v4 import _relative, randomize_
from tests.unit.test_deepseek_v4_hca import hf_forward
from titan_hybrid.hf.deepseek_v4 import (
    deepseek_v4_attention_config,
    from_deepseek_v4_attention,
    to_deepseek_v4_attention,
)
from titan_hybrid.model.args import hybrid_flavors
from titan_hybrid.model.layout import TokenLayout
from titan_hybrid.model.model import HybridModel

SEQ = 24


def v4_args():
    """debug_v4_all with one window for all three kinds (transformers has one)."""
    args = copy.deepcopy(hybrid_flavors["debug_v4_all"])
    args.window_attention.sliding_window = 8
    return args


def hf_model(args) -> tuple[DeepseekV4ForCausalLM, DeepseekV4Config]:
    config = DeepseekV4Config(**deepseek_v4_attention_config(args), mlp_layer_types=["moe"] * 3,
                              vocab_size=64, n_routed_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=16, attn_implementation="eager")
    return DeepseekV4ForCausalLM(config).double(), config


def our_model(args) -> HybridModel:
    model = HybridModel(args).double()
    return randomize_(model, seed=5)


def _layer_outputs_match(ours: HybridModel, hf: DeepseekV4ForCausalLM, config) -> None:
    torch.manual_seed(7)
    x = torch.randn(2, SEQ, config.hidden_size, dtype=torch.float64)
    for j, index in enumerate((1, 4, 7)):  # C, H and W of "MC-MH-MW-"
        mixer = ours.layers[str(index)].mixer
        got = mixer(x, TokenLayout(None, None))
        got = got[0] if isinstance(got, tuple) else got
        expected = hf_forward(hf.model.layers[j].self_attn, config, x)
        assert _relative(got, expected) < 1e-6, (j, index)


def test_export_loads_into_transformers_and_computes_the_same_attention():
    args = v4_args()
    ours = our_model(args)
    hf, config = hf_model(args)
    exported = to_deepseek_v4_attention(ours.state_dict(), args)
    hf_attention = {key for key in hf.state_dict() if ".self_attn." in key}
    assert set(exported) == hf_attention
    result = hf.load_state_dict(exported, strict=False)
    assert not result.unexpected_keys
    assert not [key for key in result.missing_keys if ".self_attn." in key]
    assert [layer.self_attn.compressor.__class__.__name__ if layer.self_attn.compressor
            else None for layer in hf.model.layers] == [
        "DeepseekV4CSACompressor", "DeepseekV4HCACompressor", None]
    _layer_outputs_match(ours, hf, config)


def test_import_gives_our_layers_the_transformers_attention():
    args = v4_args()
    hf, config = hf_model(args)
    randomize_(hf, seed=9)
    ours = our_model(args)
    imported = from_deepseek_v4_attention(hf.state_dict(), config.to_dict(), args)
    result = ours.load_state_dict(imported, strict=False)
    assert not result.unexpected_keys
    assert sorted(imported) == sorted(key for key in ours.state_dict() if any(
        key.startswith(f"layers.{index}.") and "attention." in key for index in (1, 4, 7)))
    _layer_outputs_match(ours, hf, config)


def test_import_refuses_a_checkpoint_of_other_layers_or_shapes():
    args = v4_args()
    hf, config = hf_model(args)
    state = hf.state_dict()
    swapped = config.to_dict() | {"layer_types": ["heavily_compressed_attention",
                                                  "compressed_sparse_attention",
                                                  "sliding_attention"]}
    with pytest.raises(ValueError, match=r"layer_types \['heavily_compressed_attention', "
                       r"'compressed_sparse_attention', 'sliding_attention'\] are not the "
                       r"pattern's V4 attention layers"):
        from_deepseek_v4_attention(state, swapped, args)
    with pytest.raises(ValueError, match="the checkpoint's num_attention_heads=8 is not the "
                       "model's 4"):
        from_deepseek_v4_attention(state, config.to_dict() | {"num_attention_heads": 8}, args)
    del state["model.layers.2.self_attn.sinks"]
    with pytest.raises(ValueError, match="lacks 1 tensors of this model, e.g. "
                       "'model.layers.2.self_attn.sinks'"):
        from_deepseek_v4_attention(state, config.to_dict(), args)


def test_models_the_format_cannot_hold_are_refused_by_name():
    with pytest.raises(ValueError, match=r"window_attention.sliding_window=16 differs from "
                       r"compressed_sparse_attention.sliding_window=8"):
        deepseek_v4_attention_config(hybrid_flavors["debug_v4_all"])
    for pattern, reason in (("[MC-]MW-", "has bracket groups"),
                            ("MC-MW-/W-", "has MTP depths"),
                            ("M*-", "has no DeepSeek-V4 attention layer")):
        args = v4_args()
        args.pattern = pattern
        with pytest.raises(ValueError, match=re.escape(
                f"model cannot use the DeepSeek-V4 attention blocks: hybrid.pattern "
                f"'{pattern}' {reason}")):
            deepseek_v4_attention_config(args)

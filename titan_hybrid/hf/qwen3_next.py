"""Hugging Face Qwen3-Next interop (`transformers`' `qwen3_next`): Qwen3.5's decoder layers
(qwen3_5.py: gated DeltaNet or gated attention, zero-centred norms) with an MLP or a MoE
layer each (`mlp_only_layers`, `decoder_sparse_step`), and the gated DeltaNet's projection in
two HF tensors whose rows go by key-head group:

    in_proj_qkvz: for each key head g, [query_g | key_g | values of g | z of g]
    in_proj_ba:   for each key head g, [beta of g | alpha of g]

where "of g" is the r = value heads / key heads value heads that read key head g (value head
m reads key head m // r, as in our layer). Our in_proj is [query | key | value | z | beta |
alpha] end to end, so each HF tensor is RowPieces of those components, read in place and
gathered for the trainer's HF export (engine.py).
"""

from __future__ import annotations

import dataclasses

from titan_hybrid.hf.engine import KeyMap, RowPieces
from titan_hybrid.hf.family import Family
from titan_hybrid.hf.qwen3_5 import (
    check_qwen3_5_compatible,
    check_text_config,
    experts_config,
    experts_of,
    layer_types,
    mixer_symbol,
    mtp_pattern,
    text_config,
    text_key_map,
    text_model_args,
)
from titan_hybrid.model import mlp, moe
from titan_hybrid.model.args import HybridModelArgs

FORMAT = "qwen3_next"
NAME = "Qwen3-Next"


def check_qwen3_next_compatible(args: HybridModelArgs) -> None:
    """ValueError naming the first field the HF Qwen3-Next format cannot represent."""
    check_qwen3_5_compatible(args, name=NAME, mixed_ffns=True)


def grouped_in_proj(module: str, in_proj: str, args: HybridModelArgs) -> KeyMap:
    """in_proj_qkvz and in_proj_ba as runs of our in_proj's components, key head by key
    head."""
    delta = args.gdn
    per_key = delta.n_value_heads // delta.n_key_heads
    values = per_key * delta.value_head_dim
    qkvz, ba = [], []
    for group in range(delta.n_key_heads):
        qkvz += [(f"{in_proj}.query", group * delta.key_head_dim, delta.key_head_dim),
                 (f"{in_proj}.key", group * delta.key_head_dim, delta.key_head_dim),
                 (f"{in_proj}.value", group * values, values),
                 (f"{in_proj}.z", group * values, values)]
        ba += [(f"{in_proj}.beta", group * per_key, per_key),
               (f"{in_proj}.alpha", group * per_key, per_key)]
    return {module + "in_proj_qkvz.weight": RowPieces(tuple(qkvz)),
            module + "in_proj_ba.weight": RowPieces(tuple(ba))}


def qwen3_next_key_map(args: HybridModelArgs) -> KeyMap:
    """Qwen3.5's key map with Qwen3-Next's in_proj; ValueError naming what its format cannot
    hold."""
    check_qwen3_next_compatible(args)
    return text_key_map(args, gdn_in_proj=grouped_in_proj)


def qwen3_next_config(args: HybridModelArgs) -> dict:
    """The config.json a `transformers` Qwen3NextForCausalLM needs."""
    check_qwen3_next_compatible(args)
    ffns = args.parsed_pattern.physical_layer_symbols()[1::2]  # main layers only
    with_experts = moe.KIND.symbol in ffns
    config = {"architectures": ["Qwen3NextForCausalLM"], "model_type": FORMAT,
              **text_config(args), "intermediate_size": args.mlp.hidden_dim,
              "decoder_sparse_step": 1, "norm_topk_prob": True,
              "num_nextn_predict_layers": args.parsed_pattern.mtp_depths,
              "mlp_only_layers": [i for i, symbol in enumerate(ffns) if symbol == mlp.KIND.symbol]}
    # No MoE layer at all: transformers' num_experts 0 makes every layer an MLP.
    config.update(experts_config(args.moe) if with_experts else {"num_experts": 0})
    return config


def model_args_from_qwen3_next_config(config: dict) -> HybridModelArgs:
    """HybridModelArgs for an HF Qwen3-Next config.json; ValueError naming the first setting
    the format cannot hold."""
    check_text_config(config)
    if config.get("norm_topk_prob", True) is not True:
        raise ValueError("norm_topk_prob=False is not supported (Qwen3-Next's routers "
                         "renormalise over the chosen experts)")
    dense = set(config.get("mlp_only_layers") or [])
    step = config.get("decoder_sparse_step", 1)
    with_experts = config.get("num_experts", 512) > 0
    pattern = "".join(
        mixer_symbol(kind) + (moe.KIND.symbol if with_experts and i not in dense
                              and (i + 1) % step == 0 else mlp.KIND.symbol)
        for i, kind in enumerate(layer_types(config)))
    pattern += mtp_pattern(config, "num_nextn_predict_layers",
                           moe.KIND.symbol if with_experts else mlp.KIND.symbol)
    defaults = {"intermediate_size": 5632, "num_experts": 512, "num_experts_per_tok": 10,
                "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                "head_dim": 256}
    config = {**defaults, **config}
    experts = experts_of(config) if moe.KIND.symbol in pattern else HybridModelArgs().moe
    return dataclasses.replace(text_model_args(config, pattern, experts), hf_format=FORMAT)


# The family, as titan_hybrid/hf/families.py lists it.
FAMILY = Family(
    name="qwen3_next", model_types=("qwen3_next",),
    format_name=NAME,
    key_map=qwen3_next_key_map,
    check=check_qwen3_next_compatible,
    config=qwen3_next_config,
    to_args=model_args_from_qwen3_next_config,
    mtp_marker=lambda args: "mtp.fc.weight",
    mtp_count_field="num_nextn_predict_layers")

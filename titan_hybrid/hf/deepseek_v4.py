"""DeepSeek-V4 attention blocks in transformers' `deepseek_v4` naming, both ways.

A DeepSeek-V4 model is more than its attention: hyper-connections (several residual streams
mixed by Sinkhorn-projected matrices), hash-routed MoE layers and its MTP block have no
counterpart here, so no whole V4 checkpoint maps onto a hybrid model. Its attention blocks do:
our `W`, `C` and `H` layers carry transformers' DeepseekV4Attention parameter names, so the
j-th V4 attention layer of our pattern (physical order, main part) is HF decoder layer j's
`model.layers.{j}.self_attn.*`, with layer type `sliding_attention`, `compressed_sparse_attention`
or `heavily_compressed_attention` (V4_KINDS).

- `to_deepseek_v4_attention`: our state dict -> those keys; `deepseek_v4_attention_config`: the
  config fields they need (layer_types and the attention shapes, which transformers holds once
  for all three types, so the sections of the kinds in the pattern must agree on them);
- `from_deepseek_v4_attention`: a V4 checkpoint's state dict and config.json -> our keys of
  those layers, after checking that its layer types and shapes are ours (one ValueError
  naming the first that is not). Load the result with `strict=False`: the rest of the model
  (embeddings, Mamba layers, MLPs) is ours to train.
"""

from __future__ import annotations

import torch

from titan_hybrid.model import deepseek_v4, deepseek_v4_csa, deepseek_v4_hca
from titan_hybrid.model.args import HybridModelArgs
from titan_hybrid.model.layer_kind import LayerKind

# Our kind of each transformers layer type.
V4_KINDS: dict[str, LayerKind] = {"sliding_attention": deepseek_v4.KIND,
                                  "compressed_sparse_attention": deepseek_v4_csa.KIND,
                                  "heavily_compressed_attention": deepseek_v4_hca.KIND}
FORMAT = "DeepSeek-V4 attention blocks"


def v4_attention_layers(args: HybridModelArgs) -> list[tuple[int, str]]:
    """(physical layer index, HF layer type) of each V4 attention layer, in order."""
    pattern = args.parsed_pattern
    problems = []
    if any(isinstance(item, tuple) for item in pattern.main):
        problems.append(f"hybrid.pattern '{args.pattern}' has bracket groups")
    if pattern.mtp_depths:
        problems.append(f"hybrid.pattern '{args.pattern}' has MTP depths (V4's MTP block is "
                        "not a hybrid layer)")
    by_symbol = {kind.symbol: layer_type for layer_type, kind in V4_KINDS.items()}
    layers = [(index, by_symbol[symbol]) for index, symbol in
              enumerate(pattern.physical_layer_symbols()) if symbol in by_symbol]
    if not layers:
        problems.append(f"hybrid.pattern '{args.pattern}' has no DeepSeek-V4 attention layer "
                        f"({' '.join(by_symbol)})")
    if problems:
        raise ValueError(f"model cannot use the {FORMAT}: " + "; ".join(problems))
    return layers


def _key(index: int, layer_type: str, parameter: str) -> str:
    return f"layers.{index}.{V4_KINDS[layer_type].name}.{parameter}"


def _parameter_names(args: HybridModelArgs, layer_type: str) -> list[str]:
    kind = V4_KINDS[layer_type]
    with torch.device("meta"):
        return list(kind.build(args.section(kind), args.dim, args.norm_eps).state_dict())


def _key_map(args: HybridModelArgs) -> dict[str, str]:
    """HF key -> our key, for every parameter of every V4 attention layer."""
    return {f"model.layers.{j}.self_attn.{parameter}": _key(index, layer_type, parameter)
            for j, (index, layer_type) in enumerate(v4_attention_layers(args))
            for parameter in _parameter_names(args, layer_type)}


def to_deepseek_v4_attention(state_dict: dict[str, torch.Tensor], args: HybridModelArgs
                             ) -> dict[str, torch.Tensor]:
    return {hf_key: state_dict[ours] for hf_key, ours in _key_map(args).items()}


def deepseek_v4_attention_config(args: HybridModelArgs) -> dict:
    """The DeepseekV4Config fields of the attention blocks; ValueError naming the first field
    on which two of the pattern's V4 sections disagree (transformers has one value)."""
    layers = v4_attention_layers(args)
    sections = {layer_type: args.section(V4_KINDS[layer_type]) for _, layer_type in layers}
    config: dict = {"layer_types": [layer_type for _, layer_type in layers],
                    "num_hidden_layers": len(layers), "hidden_size": args.dim}
    origin: dict[str, str] = {}

    def put(field: str, value, source: str) -> None:
        if field in config and config[field] != value:
            raise ValueError(f"model cannot use the {FORMAT}: {source}={value!r} differs from "
                             f"{origin[field]}={config[field]!r} (transformers' {field} is one "
                             "value for every layer)")
        config.setdefault(field, value)
        origin.setdefault(field, source)

    for layer_type, section in sections.items():
        name = V4_KINDS[layer_type].name
        for ours, theirs in (("n_heads", "num_attention_heads"), ("head_dim", "head_dim"),
                             ("q_lora_rank", "q_lora_rank"), ("o_groups", "o_groups"),
                             ("o_lora_rank", "o_lora_rank"), ("sliding_window", "sliding_window"),
                             ("norm_eps", "rms_norm_eps")):
            put(theirs, getattr(section, ours), f"{name}.{ours}")
        put("partial_rotary_factor", section.rope_head_dim / section.head_dim,
            f"{name}.rope_head_dim / head_dim")
        if not hasattr(section, "compress_ratio"):  # W: the "main" rotary table
            put("rope_theta", section.rope_theta, f"{name}.rope_theta")
            continue
        put("compress_rope_theta", section.rope_theta, f"{name}.rope_theta")
        config.setdefault("compress_rates", {})[layer_type] = section.compress_ratio
        yarn = None
        if section.rope_scaling_factor != 1.0:
            yarn = {"rope_type": "yarn", "factor": section.rope_scaling_factor,
                    "original_max_position_embeddings": section.original_max_position_embeddings,
                    "beta_fast": section.beta_fast, "beta_slow": section.beta_slow,
                    "attention_factor": section.attention_factor}
        put("rope_parameters", yarn, f"{name}'s YaRN fields")
        if hasattr(section, "index_topk"):  # C: its indexer
            for field in ("index_n_heads", "index_head_dim", "index_topk"):
                put(field, getattr(section, field), f"{name}.{field}")
    return config


def _compress_yarn(rope: dict) -> dict | None:
    """A rope-parameters dict as deepseek_v4_attention_config writes it: None unless YaRN."""
    if rope.get("rope_type", rope.get("type", "default")) != "yarn":
        return None
    return {"rope_type": "yarn", "factor": rope.get("factor"),
            "original_max_position_embeddings": rope.get("original_max_position_embeddings"),
            "beta_fast": rope.get("beta_fast"), "beta_slow": rope.get("beta_slow"),
            "attention_factor": rope.get("attention_factor", 1.0)}


def from_deepseek_v4_attention(hf_state_dict: dict[str, torch.Tensor], hf_config: dict,
                               args: HybridModelArgs) -> dict[str, torch.Tensor]:
    """Our keys of the V4 attention layers, from a V4 checkpoint whose layer types and
    attention shapes are the model's (ValueError naming the first that is not)."""
    ours = deepseek_v4_attention_config(args)
    theirs = list(hf_config.get("layer_types") or [])[:hf_config.get("num_hidden_layers")]
    if theirs != ours["layer_types"]:
        raise ValueError(f"{FORMAT}: the checkpoint's layer_types {theirs} are not the "
                         f"pattern's V4 attention layers {ours['layer_types']} "
                         f"(hybrid.pattern '{args.pattern}', in order)")
    for field, value in ours.items():
        if field in ("layer_types", "num_hidden_layers"):
            continue
        found = hf_config.get(field)
        if field == "compress_rates":  # the checkpoint may name rates of types it lacks
            value = {**(found or {}), **value}
        if field == "rope_parameters":  # a saved config nests them: {"main", "compress"}
            found = _compress_yarn((found or {}).get("compress", found or {}))
        if found != value:
            raise ValueError(f"{FORMAT}: the checkpoint's {field}={found!r} is not the "
                             f"model's {value!r}")
    mapping = _key_map(args)
    missing = [key for key in mapping if key not in hf_state_dict]
    if missing:
        raise ValueError(f"{FORMAT}: the checkpoint lacks {len(missing)} tensors of this "
                         f"model, e.g. {missing[0]!r}")
    return {our_key: hf_state_dict[hf_key] for hf_key, our_key in mapping.items()}


"""Hugging Face Granite 4.0-H interop (`transformers`' `granitemoehybrid`): Mamba2 and attention
layers, each followed by MoE with a shared MLP (or, without experts, by the shared MLP
alone). Patterns of `ME` / `*E` (or `M-` / `*-`) decoder layers.

HF decoder layer j is our layers 2j (`input_layernorm`, then `mamba.*` with Nemotron-H's names
for the same tensors, or `self_attn.*`) and 2j + 1 (`post_attention_layernorm`, then
`block_sparse_moe.*` and `shared_mlp.*`). Granite's fused SwiGLU tensors are ours whole
([gate; up] rows: the shared MLP's input_linear is our fc1, the experts' input_linear our
experts' fc1). Its scalars are the model's embedding_multiplier, residual_multiplier and
logits_scaling and the attention's softmax_scale (attention_multiplier); its attention has
no position embedding, or rotate-half RoPE on every channel.
"""

from __future__ import annotations

import dataclasses

from titan_hybrid.hf.bamba import mamba_args_from_config, mamba_config
from titan_hybrid.hf.engine import KeyMap
from titan_hybrid.hf.family import Family
from titan_hybrid.hf.key_map_parts import softmax_routed
from titan_hybrid.hf.nemotron_h import MIXER_NAMES
from titan_hybrid.model import attention, mamba, mlp, moe
from titan_hybrid.model.args import AttentionArgs, HybridModelArgs, MLPArgs, MoEArgs
from titan_hybrid.model.layer_kinds import LAYER_KINDS

FORMAT = "granite"
MIXERS = {mamba.KIND.symbol: "mamba", attention.KIND.symbol: "self_attn"}
FFNS = (mlp.KIND.symbol, moe.KIND.symbol)
LAYER_TYPES = {mamba.KIND.symbol: "linear_attention", attention.KIND.symbol: "full_attention"}
# transformers' other words for the same layer types
LAYER_TYPE_ALIASES = {"mamba": "linear_attention", "attention": "full_attention"}


def check_granite_compatible(args: HybridModelArgs) -> None:
    """ValueError naming the first field the HF Granite 4.0-H format cannot represent."""
    pattern = args.parsed_pattern
    symbols = pattern.physical_layer_symbols()
    ffns = symbols[1::2]
    problems = []
    if (not symbols or len(symbols) % 2 or any(s not in MIXERS for s in symbols[0::2])
            or any(s not in FFNS for s in ffns) or len(set(ffns)) > 1):
        problems.append(f"hybrid.pattern '{args.pattern}' must be 'M' / '*' layers each "
                        "followed by MoE ('E') or, in every layer, by an MLP ('-')")
    if any(isinstance(item, tuple) for item in pattern.main) or pattern.mtp_depths:
        problems.append(f"hybrid.pattern '{args.pattern}' has bracket groups or MTP depths")
    if args.norm_zero_centered or args.mlp.activation != "swiglu":
        problems.append(f"norm_zero_centered={args.norm_zero_centered}, mlp.activation="
                        f"'{args.mlp.activation}': Granite has plain norms and SwiGLU MLPs")
    heads = args.attention
    if attention.KIND.symbol in symbols and (
            heads.qk_norm or heads.output_gate or heads.head_dim * heads.n_heads != args.dim
            or (heads.use_rope and (heads.rope_interleave or heads.rotary_fraction != 1.0))):
        problems.append("attention: Granite's attention has n_heads * head_dim = dim, no q / k "
                        "norms or output gate, and no RoPE or rotate-half RoPE on every channel "
                        "(rope_interleave=False, rotary_fraction=1.0)")
    experts = args.moe
    if moe.KIND.symbol in ffns and not softmax_routed(experts, shared_expert_gate=False):
        problems.append("moe: Granite's MoE layers have SwiGLU experts, a softmax router "
                        "renormalised over the chosen experts (no bias, groups or scaling) "
                        "and an ungated shared MLP")
    if problems:
        raise ValueError("model cannot use the HF Granite 4.0-H format: " + "; ".join(problems))


def granite_key_map(args: HybridModelArgs) -> KeyMap:
    """HF key -> our key, or the tuple of our component keys of a fused HF tensor."""
    check_granite_compatible(args)
    mapping: KeyMap = {
        "model.embed_tokens.weight": "tok_embeddings.weight",
        "model.norm.weight": "norm.weight", "lm_head.weight": "output.weight"}
    symbols = args.parsed_pattern.physical_layer_symbols()
    for j in range(len(symbols) // 2):
        hf, mixer, ffn = f"model.layers.{j}.", f"layers.{2 * j}.", f"layers.{2 * j + 1}."
        kind, ffn_kind = LAYER_KINDS[symbols[2 * j]], LAYER_KINDS[symbols[2 * j + 1]]
        module = f"{hf}{MIXERS[kind.symbol]}."
        mapping[hf + "input_layernorm.weight"] = f"{mixer}{kind.name}_norm.weight"
        mapping[hf + "post_attention_layernorm.weight"] = f"{ffn}{ffn_kind.name}_norm.weight"
        names = MIXER_NAMES[kind.name]  # the same tensor names as Nemotron-H's mixers
        for ours, theirs in names.renames.items():
            mapping[module + theirs] = f"{mixer}{kind.name}.{ours}"
        for name, parts in names.fused.items():
            mapping[module + name] = tuple(f"{mixer}{kind.name}.{name}{part}" for part in parts)
        shared = f"{ffn}mlp." if ffn_kind is mlp.KIND else f"{ffn}moe.shared_expert."
        mapping[hf + "shared_mlp.input_linear.weight"] = (shared + "fc1.weight_w",
                                                          shared + "fc1.weight_v")
        mapping[hf + "shared_mlp.output_linear.weight"] = shared + "fc2.weight"
        if ffn_kind is moe.KIND:
            experts = f"{hf}block_sparse_moe."
            mapping[experts + "router.layer.weight"] = f"{ffn}moe.router.gate.weight"
            mapping[experts + "input_linear.weight"] = (f"{ffn}moe.experts.fc1_w",
                                                        f"{ffn}moe.experts.fc1_v")
            mapping[experts + "output_linear.weight"] = f"{ffn}moe.experts.fc2"
    return mapping


def granite_config(args: HybridModelArgs) -> dict:
    """The config.json a `transformers` GraniteMoeHybridForCausalLM needs."""
    check_granite_compatible(args)
    symbols = args.parsed_pattern.physical_layer_symbols()
    with_experts = moe.KIND.symbol in symbols
    heads, experts = args.attention, args.moe
    return {
        "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
        "vocab_size": args.vocab_size, "hidden_size": args.dim,
        "num_hidden_layers": len(symbols) // 2,
        "layer_types": [LAYER_TYPES[s] for s in symbols[0::2]],
        "num_attention_heads": heads.n_heads, "num_key_value_heads": heads.n_kv_heads,
        "hidden_act": "silu", "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "attention_bias": False,
        "embedding_multiplier": args.embedding_multiplier,
        "residual_multiplier": args.residual_multiplier, "logits_scaling": args.logits_scaling,
        "attention_multiplier": (heads.softmax_scale if heads.softmax_scale is not None
                                 else heads.head_dim ** -0.5),
        "position_embedding_type": "rope" if heads.use_rope else None,
        "rope_parameters": {"rope_type": "default", "rope_theta": heads.rope_theta},
        "num_local_experts": experts.num_experts if with_experts else 0,
        "num_experts_per_tok": experts.top_k,
        "intermediate_size": experts.hidden_dim if with_experts else args.mlp.hidden_dim,
        "shared_intermediate_size": (experts.shared_expert_hidden_dim if with_experts
                                     else args.mlp.hidden_dim),
        **mamba_config(args),
    }


def model_args_from_granite_config(config: dict) -> HybridModelArgs:
    """HybridModelArgs for an HF Granite 4.0-H config.json; ValueError naming the first
    setting the format cannot hold."""
    for field, expected in (("hidden_act", "silu"), ("attention_bias", False), ("mamba_conv_bias", True),
                            ("mamba_proj_bias", False)):
        if config.get(field, expected) != expected:
            raise ValueError(f"{field}={config[field]!r} is not supported (expected "
                             f"{expected!r})")
    dim, layers = config["hidden_size"], config["num_hidden_layers"]
    layer_types = config.get("layer_types") or config.get("layers_block_type") or [
        "linear_attention"] * layers
    layer_types = [LAYER_TYPE_ALIASES.get(t, t) for t in layer_types]
    unknown = sorted(set(layer_types) - set(LAYER_TYPES.values()))
    if unknown:
        raise ValueError(f"layer_types has {unknown}: the supported layer types are "
                         f"{', '.join(sorted(LAYER_TYPES.values()))}")
    position = config.get("position_embedding_type")
    if position not in (None, "nope", "rope"):
        raise ValueError(f"position_embedding_type={position!r} is not supported (None or "
                         "'rope')")
    with_experts = config.get("num_local_experts", 8) > 0
    heads = config["num_attention_heads"]
    rope = config.get("rope_parameters") or {}
    symbol = {"linear_attention": mamba.KIND.symbol, "full_attention": attention.KIND.symbol}
    ffn = moe.KIND.symbol if with_experts else mlp.KIND.symbol
    base = HybridModelArgs()
    shared = config.get("shared_intermediate_size", 1024)
    return dataclasses.replace(
        base, hf_format=FORMAT, pattern="".join(symbol[t] + ffn for t in layer_types),
        dim=dim, vocab_size=config["vocab_size"], norm_eps=config.get("rms_norm_eps", 1e-6),
        max_seq_len=config.get("max_position_embeddings", base.max_seq_len),
        embedding_multiplier=config.get("embedding_multiplier", 1.0),
        residual_multiplier=config.get("residual_multiplier", 1.0),
        logits_scaling=config.get("logits_scaling", 1.0),
        attention=AttentionArgs(
            n_heads=heads, n_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=dim // heads, rope_theta=rope.get("rope_theta", 10000.0),
            use_rope=position == "rope", rope_interleave=False,
            softmax_scale=config.get("attention_multiplier", 1.0)),
        mamba=mamba_args_from_config(config),
        mlp=MLPArgs(hidden_dim=shared, activation="swiglu"),
        moe=MoEArgs(num_experts=config.get("num_local_experts", 8),
                    top_k=config.get("num_experts_per_tok", 2),
                    hidden_dim=config.get("intermediate_size", base.moe.hidden_dim),
                    shared_expert_hidden_dim=shared, score_func="softmax",
                    norm_topk_prob=True) if with_experts else base.moe)


# The family, as titan_hybrid/hf/families.py lists it.
FAMILY = Family(
    name="granite", model_types=("granitemoehybrid",),
    format_name="Granite 4.0-H",
    key_map=granite_key_map,
    check=check_granite_compatible,
    config=granite_config,
    to_args=model_args_from_granite_config)

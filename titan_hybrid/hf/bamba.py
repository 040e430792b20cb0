"""Hugging Face Bamba interop (`transformers`' `bamba`): Mamba2 and attention layers, each
followed by a SwiGLU MLP. Patterns `M-` / `*-` repeated, attention with rotate-half RoPE on
half of each head's channels (`attention.rope_interleave = False`, `rotary_fraction = 0.5`).

HF decoder layer j is our layers 2j (`input_layernorm`, then `mamba.*` or `self_attn.*`, with
Nemotron-H's names for the same tensors: the Mamba2 mixer's fused in_proj [z|x|B|C|dt] and
conv [x|B|C] are our components end to end) and 2j + 1 (`pre_ff_layernorm`,
`feed_forward.gate_proj` / `up_proj` = the halves of our fused fc1, `down_proj` = fc2):
the key map that hf/engine.py's adapter reads.
"""

from __future__ import annotations

import dataclasses

from titan_hybrid.hf.engine import KeyMap
from titan_hybrid.hf.family import Family
from titan_hybrid.hf.key_map_parts import json_float, tagged_float
from titan_hybrid.hf.nemotron_h import MIXER_NAMES
from titan_hybrid.hf.vocabulary import swiglu_mlp
from titan_hybrid.model import attention, mamba, mlp
from titan_hybrid.model.args import AttentionArgs, HybridModelArgs, MambaArgs, MLPArgs
from titan_hybrid.model.layer_kinds import LAYER_KINDS

MIXERS = {mamba.KIND.symbol: "mamba", attention.KIND.symbol: "self_attn"}  # HF module names


def check_bamba_compatible(args: HybridModelArgs) -> None:
    """ValueError naming the first field the HF Bamba format cannot represent."""
    pattern = args.parsed_pattern
    symbols = pattern.physical_layer_symbols()
    problems = []
    pairs = [symbols[i:i + 2] for i in range(0, len(symbols), 2)]
    if not symbols or any(len(pair) != 2 or pair[0] not in MIXERS or pair[1] != mlp.KIND.symbol
                          for pair in pairs):
        problems.append(f"hybrid.pattern '{args.pattern}' must be 'M-' / '*-' decoder layers "
                        "(a Mamba2 or attention layer, then a SwiGLU MLP)")
    if any(isinstance(item, tuple) for item in pattern.main) or pattern.mtp_depths:
        problems.append(f"hybrid.pattern '{args.pattern}' has bracket groups or MTP depths")
    if args.mlp.activation != "swiglu":
        problems.append(f"mlp.activation='{args.mlp.activation}' must be 'swiglu'")
    if attention.KIND.symbol in symbols:
        heads = args.attention
        if not heads.use_rope or heads.rope_interleave or heads.rotary_fraction != 0.5:
            problems.append(
                f"attention: use_rope={heads.use_rope}, rope_interleave={heads.rope_interleave}, "
                f"rotary_fraction={heads.rotary_fraction}; Bamba rotates half of each head "
                "(use_rope=True, rope_interleave=False, rotary_fraction=0.5)")
    if problems:
        raise ValueError("model cannot use the HF Bamba format: " + "; ".join(problems))


def bamba_key_map(args: HybridModelArgs) -> KeyMap:
    """HF key -> our key, or the tuple of our component keys of a fused HF tensor."""
    check_bamba_compatible(args)
    mapping: KeyMap = {
        "model.embed_tokens.weight": "tok_embeddings.weight",
        "model.final_layernorm.weight": "norm.weight",
        "lm_head.weight": "output.weight",
    }
    symbols = args.parsed_pattern.physical_layer_symbols()
    for j in range(len(symbols) // 2):
        hf, mixer, ffn = f"model.layers.{j}.", f"layers.{2 * j}.", f"layers.{2 * j + 1}."
        kind = LAYER_KINDS[symbols[2 * j]]
        names, module = MIXER_NAMES[kind.name], f"{hf}{MIXERS[kind.symbol]}."
        mapping[hf + "input_layernorm.weight"] = f"{mixer}{kind.name}_norm.weight"
        for ours, theirs in names.renames.items():
            mapping[module + theirs] = f"{mixer}{kind.name}.{ours}"
        for name, parts in names.fused.items():
            mapping[module + name] = tuple(f"{mixer}{kind.name}.{name}{part}" for part in parts)
        mapping[hf + "pre_ff_layernorm.weight"] = f"{ffn}mlp_norm.weight"
        mapping.update(swiglu_mlp(hf + "feed_forward.", f"{ffn}mlp."))
    return mapping


def mamba_config(args: HybridModelArgs) -> dict:
    """The Mamba2 fields of a Bamba-style config.json (Bamba's, Granite 4.0-H's)."""
    ssm = args.mamba
    return {"mamba_n_heads": args.mamba_n_heads, "mamba_d_head": ssm.head_dim,
            "mamba_n_groups": ssm.n_groups, "mamba_d_state": ssm.d_state,
            "mamba_d_conv": ssm.conv_width, "mamba_expand": ssm.expand,
            "mamba_chunk_size": ssm.chunk_size, "mamba_conv_bias": True,
            "mamba_proj_bias": False,
            "time_step_limit": [tagged_float(bound) for bound in ssm.dt_limit]}


def mamba_args_from_config(config: dict) -> MambaArgs:
    """MambaArgs of a Bamba-style config.json; ValueError when its heads do not make up
    mamba_expand * hidden_size."""
    dim, ssm_heads = config["hidden_size"], config["mamba_n_heads"]
    expand = config.get("mamba_expand", 2)
    d_head = config.get("mamba_d_head", "auto")
    d_head = expand * dim // ssm_heads if d_head == "auto" else d_head
    if d_head * ssm_heads != expand * dim:
        raise ValueError(f"mamba_n_heads * mamba_d_head = {ssm_heads * d_head} must equal "
                         f"mamba_expand * hidden_size = {expand * dim}")
    limit = [json_float(bound) for bound in config.get("time_step_limit") or (0.0, "inf")]
    return MambaArgs(d_state=config.get("mamba_d_state", 256), head_dim=d_head,
                     n_groups=config.get("mamba_n_groups", 1), expand=expand,
                     conv_width=config.get("mamba_d_conv", 4),
                     chunk_size=config.get("mamba_chunk_size", 256),
                     dt_limit=(limit[0], limit[1]))


def bamba_config(args: HybridModelArgs) -> dict:
    """The config.json a `transformers` BambaForCausalLM needs for these weights."""
    check_bamba_compatible(args)
    symbols = args.parsed_pattern.physical_layer_symbols()
    heads = args.attention
    return {
        "architectures": ["BambaForCausalLM"], "model_type": "bamba",
        "vocab_size": args.vocab_size, "hidden_size": args.dim,
        "intermediate_size": args.mlp.hidden_dim, "num_hidden_layers": len(symbols) // 2,
        "attn_layer_indices": [j for j in range(len(symbols) // 2)
                               if symbols[2 * j] == attention.KIND.symbol],
        "num_attention_heads": heads.n_heads, "num_key_value_heads": heads.n_kv_heads,
        "head_dim": heads.head_dim, "hidden_act": "silu", "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "rope_parameters": {"rope_type": "default", "rope_theta": heads.rope_theta,
                            "partial_rotary_factor": heads.rotary_fraction},
        **mamba_config(args),
        "attention_bias": False, "mlp_bias": False,
    }


def model_args_from_bamba_config(config: dict) -> HybridModelArgs:
    """HybridModelArgs for an HF Bamba config.json; ValueError naming the first setting the
    format cannot hold."""
    for field, expected in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False),
                            ("mamba_conv_bias", True), ("mamba_proj_bias", False)):
        if config.get(field, expected) != expected:
            raise ValueError(f"{field}={config[field]!r} is not supported (expected "
                             f"{expected!r})")
    dim, layers = config["hidden_size"], config["num_hidden_layers"]
    attention_layers = set(config.get("attn_layer_indices") or [])
    heads = config["num_attention_heads"]
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters.rope_type={rope['rope_type']!r} is not supported "
                         "(default)")
    base = HybridModelArgs()
    return dataclasses.replace(
        base,
        pattern="".join((attention.KIND.symbol if j in attention_layers else mamba.KIND.symbol)
                        + mlp.KIND.symbol for j in range(layers)),
        dim=dim, vocab_size=config["vocab_size"], norm_eps=config.get("rms_norm_eps", 1e-5),
        max_seq_len=config.get("max_position_embeddings", base.max_seq_len),
        attention=AttentionArgs(
            n_heads=heads, n_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or dim // heads,
            rope_theta=rope.get("rope_theta", 10000.0), rope_interleave=False,
            # transformers' BambaConfig sets 0.5 whatever a config.json says
            rotary_fraction=0.5),
        mlp=MLPArgs(hidden_dim=config["intermediate_size"], activation="swiglu"),
        mamba=mamba_args_from_config(config),
        hf_format="bamba")


# The family, as titan_hybrid/hf/families.py lists it.
FAMILY = Family(
    name="bamba", model_types=("bamba",),
    format_name="Bamba",
    key_map=bamba_key_map,
    check=check_bamba_compatible,
    config=bamba_config,
    to_args=model_args_from_bamba_config)

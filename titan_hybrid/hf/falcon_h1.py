"""Hugging Face Falcon-H1 interop (`transformers`' `falcon_h1`, TII's Falcon-H1 90M to 34B):
each decoder layer runs a Mamba2 mixer and a RoPE GQA attention in parallel on one normed input
and adds them, then a SwiGLU MLP: a pattern of `(M*)-` pairs (a parallel group, then the MLP).

HF decoder layer j is our layers 2j (`input_layernorm` as the group's `mamba_attention_norm`,
`mamba.*`, `self_attn.*`) and 2j + 1 (`pre_ff_layernorm`, `feed_forward.*`); the final norm is
`final_layernorm`. The Mamba2 tensors are named and fused as Nemotron-H's.

Its µP multipliers stay scalars (folded into the weights they would change Adam's steps):
`embedding_multiplier` and `lm_head_multiplier` the model's; `key_multiplier`,
`attention_in_multiplier` and `attention_out_multiplier` the attention's; `ssm_in_multiplier`,
`ssm_multipliers` (the mup_vector over in_proj's z / x / B / C / dt rows) and
`ssm_out_multiplier` the Mamba2 mixer's; `mlp_multipliers` (gate, down) the MLP's. Its released
Mamba2 has no gated norm (`mamba_rms_norm` false: `mamba.gated_norm`); with one, the norm
must follow the gate (`mamba_norm_before_gate` false), as Mamba2's. Biases (`mamba_proj_bias`,
`projectors_bias`, `attention_bias`, `mlp_bias`) are refused by name.
"""

from __future__ import annotations

import dataclasses

from titan_hybrid.hf.engine import KeyMap
from titan_hybrid.hf.family import Family
from titan_hybrid.hf.key_map_parts import attention_problems, tagged_float, time_step_limit
from titan_hybrid.hf.nemotron_h import MIXER_NAMES
from titan_hybrid.hf.vocabulary import llama_attention, swiglu_mlp
from titan_hybrid.model import attention, mamba, mlp
from titan_hybrid.model.args import AttentionArgs, HybridModelArgs, MambaArgs, MLPArgs

FORMAT = "falcon_h1"
NAME = "Falcon-H1"
LAYER = f"({mamba.KIND.symbol}{attention.KIND.symbol})"  # the parallel group, as written
ATTENTION = dict(use_rope=True, rope_interleave=False, rotary_fraction=1.0, qk_norm=False,
                 output_gate=False, softmax_scale=None)
# Settings that must have these values (the others are read).
FIXED = (("hidden_act", "silu"), ("mamba_conv_bias", True), ("mamba_proj_bias", False),
         ("projectors_bias", False), ("attention_bias", False), ("mlp_bias", False))


def check_falcon_h1_compatible(args: HybridModelArgs) -> None:
    """ValueError naming the first field the HF Falcon-H1 format cannot represent."""
    pattern = args.parsed_pattern
    symbols = pattern.physical_layer_symbols(include_mtp=True)
    parallel = mamba.KIND.symbol + attention.KIND.symbol
    problems = []
    if (not symbols or len(symbols) % 2 or any(s != parallel for s in symbols[0::2])
            or any(s != mlp.KIND.symbol for s in symbols[1::2]) or pattern.mtp_depths
            or any(isinstance(item, tuple) for item in pattern.main)):
        problems.append(f"hybrid.pattern '{args.pattern}' must be parallel groups '{LAYER}' "
                        "each followed by an MLP ('-'), without bracket groups or MTP depths")
    if (args.norm_zero_centered or args.post_norm_mixers or args.logits_scaling != 1.0
            or args.residual_multiplier != 1.0):
        problems.append("norms must be pre-norms scaling by their weight, without logits "
                        "scaling or a residual multiplier")
    if args.mlp.activation != "swiglu":
        problems.append(f"mlp.activation='{args.mlp.activation}' must be 'swiglu'")
    problems += attention_problems(args, ATTENTION, NAME)
    if args.mamba.dt_limit[0] < 0:
        problems.append(f"mamba.dt_limit={args.mamba.dt_limit} must be >= 0")
    if problems:
        raise ValueError(f"model cannot use the HF {NAME} format: " + "; ".join(problems))


def falcon_h1_key_map(args: HybridModelArgs) -> KeyMap:
    check_falcon_h1_compatible(args)
    mapping: KeyMap = {"model.embed_tokens.weight": "tok_embeddings.weight",
                       "model.final_layernorm.weight": "norm.weight",
                       "lm_head.weight": "output.weight"}
    names = MIXER_NAMES[mamba.KIND.name]
    renames = {ours: theirs for ours, theirs in names.renames.items()
               if ours != "norm.weight" or args.mamba.gated_norm}
    for j in range(len(args.parsed_pattern.physical_layer_symbols()) // 2):
        hf, group, ffn = f"model.layers.{j}.", f"layers.{2 * j}.", f"layers.{2 * j + 1}."
        mapping[f"{hf}input_layernorm.weight"] = f"{group}mamba_attention_norm.weight"
        mapping[f"{hf}pre_ff_layernorm.weight"] = f"{ffn}mlp_norm.weight"
        for ours, theirs in renames.items():
            mapping[f"{hf}mamba.{theirs}"] = f"{group}mamba.{ours}"
        for name, parts in names.fused.items():
            mapping[f"{hf}mamba.{name}"] = tuple(f"{group}mamba.{name}{part}" for part in parts)
        mapping.update(llama_attention(f"{hf}self_attn.", f"{group}attention.", qk_norm=False))
        mapping.update(swiglu_mlp(f"{hf}feed_forward.", f"{ffn}mlp."))
    return mapping


def falcon_h1_config(args: HybridModelArgs) -> dict:
    """The config.json a `transformers` FalconH1ForCausalLM needs."""
    check_falcon_h1_compatible(args)
    heads, ssm, ffn = args.attention, args.mamba, args.mlp
    low, high = ssm.dt_limit
    return {
        "architectures": ["FalconH1ForCausalLM"], "model_type": FORMAT,
        "vocab_size": args.vocab_size, "hidden_size": args.dim,
        "intermediate_size": ffn.hidden_dim,
        "num_hidden_layers": len(args.parsed_pattern.physical_layer_symbols()) // 2,
        "num_attention_heads": heads.n_heads, "num_key_value_heads": heads.n_kv_heads,
        "head_dim": heads.head_dim, "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "rope_parameters": {"rope_type": "default", "rope_theta": heads.rope_theta},
        "mamba_d_ssm": args.mamba_d_inner, "mamba_n_heads": args.mamba_n_heads,
        "mamba_d_head": ssm.head_dim, "mamba_n_groups": ssm.n_groups,
        "mamba_d_state": ssm.d_state, "mamba_d_conv": ssm.conv_width,
        "mamba_expand": ssm.expand, "mamba_chunk_size": ssm.chunk_size,
        "mamba_rms_norm": ssm.gated_norm, "mamba_norm_before_gate": False,
        "time_step_limit": [tagged_float(low), tagged_float(high)],
        **dict(FIXED),
        "embedding_multiplier": args.embedding_multiplier,
        "lm_head_multiplier": args.lm_head_multiplier,
        "key_multiplier": heads.key_multiplier,
        "attention_in_multiplier": heads.input_multiplier,
        "attention_out_multiplier": heads.output_multiplier,
        "ssm_in_multiplier": ssm.input_multiplier,
        "ssm_multipliers": list(ssm.in_proj_multipliers),
        "ssm_out_multiplier": ssm.output_multiplier,
        "mlp_multipliers": [ffn.gate_multiplier, ffn.down_multiplier],
    }


def model_args_from_falcon_h1_config(config: dict) -> HybridModelArgs:
    """HybridModelArgs for an HF Falcon-H1 config.json; ValueError naming the first setting
    the format cannot hold."""
    for name, expected in FIXED:
        if config.get(name, expected) != expected:
            raise ValueError(f"{name}={config[name]!r} is not supported (expected "
                             f"{expected!r})")
    rms_norm = config.get("mamba_rms_norm", False)
    if rms_norm and config.get("mamba_norm_before_gate", True):
        raise ValueError("mamba_norm_before_gate=True with mamba_rms_norm=True is not "
                         "supported: titan_hybrid's Mamba2 norm follows its gate, "
                         "norm(y * silu(z))")
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters.rope_type={rope['rope_type']!r} is not supported "
                         "(default)")
    dim, heads = config["hidden_size"], config["num_attention_heads"]
    expand = config.get("mamba_expand", 2)
    d_ssm = config.get("mamba_d_ssm") or expand * dim
    ssm_heads = config.get("mamba_n_heads", 128)
    head_dim = config.get("mamba_d_head", "auto")
    head_dim = d_ssm // ssm_heads if head_dim == "auto" else head_dim
    if head_dim * ssm_heads != d_ssm:
        raise ValueError(f"mamba_d_head * mamba_n_heads = {head_dim * ssm_heads} must be the "
                         f"Mamba2 width {d_ssm}")
    low, high = time_step_limit(config)
    gate, down = config.get("mlp_multipliers") or (1.0, 1.0)
    base = HybridModelArgs()
    return dataclasses.replace(
        base, hf_format=FORMAT,
        pattern=(LAYER + mlp.KIND.symbol) * config["num_hidden_layers"],
        dim=dim, vocab_size=config["vocab_size"], norm_eps=config.get("rms_norm_eps", 1e-5),
        max_seq_len=config.get("max_position_embeddings", base.max_seq_len),
        embedding_multiplier=config.get("embedding_multiplier", 1.0),
        lm_head_multiplier=config.get("lm_head_multiplier", 1.0),
        attention=AttentionArgs(
            n_heads=heads, n_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or dim // heads,
            rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
            key_multiplier=config.get("key_multiplier", 1.0),
            input_multiplier=config.get("attention_in_multiplier", 1.0),
            output_multiplier=config.get("attention_out_multiplier", 1.0), **ATTENTION),
        mamba=MambaArgs(
            d_state=config.get("mamba_d_state", 256), head_dim=head_dim,
            n_groups=config.get("mamba_n_groups", 1), expand=expand,
            num_heads=0 if d_ssm == expand * dim else ssm_heads,
            conv_width=config.get("mamba_d_conv", 4),
            chunk_size=config.get("mamba_chunk_size", 256),
            dt_limit=(low, high), gated_norm=bool(rms_norm),
            input_multiplier=config.get("ssm_in_multiplier", 1.0),
            in_proj_multipliers=tuple(config.get("ssm_multipliers") or (1.0,) * 5),
            output_multiplier=config.get("ssm_out_multiplier", 1.0)),
        mlp=MLPArgs(hidden_dim=config["intermediate_size"], activation="swiglu",
                    gate_multiplier=gate, down_multiplier=down))


# The family, as titan_hybrid/hf/families.py lists it.
FAMILY = Family(
    name=FORMAT, model_types=(FORMAT,),
    format_name=NAME,
    key_map=falcon_h1_key_map,
    check=check_falcon_h1_compatible,
    config=falcon_h1_config,
    to_args=model_args_from_falcon_h1_config)

"""Hugging Face Qwen3.5 interop (`transformers`' `qwen3_5_text` / `qwen3_5_moe_text`, the text
models of Qwen3.5 and Qwen3.5-MoE): gated DeltaNet and gated attention layers, each followed
by a SwiGLU MLP or a MoE layer. Patterns of `G-` / `*-` (or `GE` / `*E`) decoder layers.

HF decoder layer j is our layers 2j (`input_layernorm`, then `linear_attn.*` or
`self_attn.*`) and 2j + 1 (`post_attention_layernorm`, `mlp.*`). Every norm but the gated
DeltaNet's output norm scales by 1 + weight (`norm_zero_centered`,
`attention.qk_norm_zero_centered`). The attention's q_proj rows are each head's
[query | gate] (`attention.output_gate`), its q / k norms are per head, and its rotary
embedding turns the first quarter of each head's channels with rotate-half pairs. The gated
DeltaNet's fused in_proj [query | key | value | z | beta | alpha] is four HF tensors
(in_proj_qkv, in_proj_z, in_proj_b, in_proj_a); its conv is [query | key | value] as ours. The
MoE layers route by a softmax renormalised over the chosen experts, with a shared expert
behind a sigmoid gate; each expert is one HF tensor per projection.
"""

from __future__ import annotations

import dataclasses

from titan_hybrid.hf.engine import KeyMap
from titan_hybrid.hf.family import Family
from titan_hybrid.hf.key_map_parts import attention_problems, softmax_routed
from titan_hybrid.hf.vocabulary import llama_attention, routed_experts, swiglu_mlp
from titan_hybrid.model import attention, gdn, mlp, moe
from titan_hybrid.model.args import (
    AttentionArgs,
    GDNArgs,
    HybridModelArgs,
    MLPArgs,
    MoEArgs,
)
from titan_hybrid.model.layer_kinds import LAYER_KINDS

FORMAT = "qwen3_5"
MIXERS = {gdn.KIND.symbol: "linear_attn", attention.KIND.symbol: "self_attn"}
FFNS = (mlp.KIND.symbol, moe.KIND.symbol)
MODEL_TYPES = {False: ("Qwen3_5ForCausalLM", "qwen3_5_text"),
               True: ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text")}  # by MoE layers
# Our attention options that Qwen3.5's attention has (its rotary_fraction is the config's
# partial_rotary_factor, 0.25 in released models).
GATED_ATTENTION = dict(use_rope=True, rope_interleave=False, qk_norm=True,
                       qk_norm_zero_centered=True, output_gate=True)


def check_qwen3_5_compatible(args: HybridModelArgs, *, name: str = "Qwen3.5",
                             mixed_ffns: bool = False) -> None:
    """ValueError naming the first field the HF Qwen3.5 format (or, with `name` and
    `mixed_ffns`, Qwen3-Next's, whose layers each have an MLP or MoE) cannot represent."""
    pattern = args.parsed_pattern
    symbols = pattern.physical_layer_symbols()
    problems = []
    ffns = symbols[1::2]
    if (not symbols or len(symbols) % 2 or any(s not in MIXERS for s in symbols[0::2])
            or any(s not in FFNS for s in ffns) or (len(set(ffns)) > 1 and not mixed_ffns)):
        which = ("an MLP ('-') or MoE ('E')" if mixed_ffns
                 else "an MLP ('-') or, in every layer, by MoE ('E')")
        problems.append(f"hybrid.pattern '{args.pattern}' must be 'G' / '*' layers each "
                        f"followed by {which}")
    if any(isinstance(item, tuple) for item in pattern.main + pattern.mtp):
        problems.append(f"hybrid.pattern '{args.pattern}' has bracket groups")
    if pattern.mtp_depths and (pattern.mtp_depths > 1 or len(pattern.mtp) != 2
                               or pattern.mtp[0] != attention.KIND.symbol
                               or pattern.mtp[1] not in FFNS):
        problems.append(f"hybrid.pattern '{args.pattern}': {name}'s MTP is one depth of one "
                        "attention layer and its MLP or MoE ('/*-' or '/*E')")
    if not args.norm_zero_centered:
        problems.append(f"norm_zero_centered=False: {name}'s norms scale by 1 + weight")
    if args.mlp.activation != "swiglu":
        problems.append(f"mlp.activation='{args.mlp.activation}' must be 'swiglu'")
    if attention.KIND.symbol in symbols:
        problems += attention_problems(args, GATED_ATTENTION, name)
    experts = args.moe
    if moe.KIND.symbol in ffns and not softmax_routed(experts, shared_expert_gate=True):
        problems.append(f"moe: {name}'s MoE layers have SwiGLU experts, a softmax router "
                        "renormalised over the chosen experts (no bias, groups or scaling) "
                        "and a shared expert behind a sigmoid gate")
    if problems:
        raise ValueError(f"model cannot use the HF {name} format: " + "; ".join(problems))


def qwen3_5_in_proj(module: str, in_proj: str, args: HybridModelArgs) -> KeyMap:
    """The gated DeltaNet's in_proj [query | key | value | z | beta | alpha] as Qwen3.5's four
    HF tensors."""
    return {module + "in_proj_qkv.weight": tuple(f"{in_proj}.{part}"
                                                 for part in ("query", "key", "value")),
            module + "in_proj_z.weight": f"{in_proj}.z",
            module + "in_proj_b.weight": f"{in_proj}.beta",
            module + "in_proj_a.weight": f"{in_proj}.alpha"}


def text_key_map(args: HybridModelArgs, gdn_in_proj=qwen3_5_in_proj) -> KeyMap:
    """The key map of Qwen3.5's and Qwen3-Next's text models: HF key -> our key (a component
    of a fused parameter: `<fqn>.<part>` / `<fqn>_<part>`), the tuple of our components of a
    fused HF tensor (or its RowPieces, from `gdn_in_proj(HF module prefix, our in_proj key,
    args)`), or one expert's slice.

    The MTP depth (vLLM's names; transformers skips mtp.* when it loads): `mtp.fc` reads
    [pre_fc_norm_embedding(embedding) | pre_fc_norm_hidden(hidden state)], `mtp.layers.0` is
    one decoder layer, `mtp.norm` the final norm before the shared head."""
    mapping: KeyMap = {
        "model.embed_tokens.weight": "tok_embeddings.weight",
        "model.norm.weight": "norm.weight", "lm_head.weight": "output.weight"}
    pattern = args.parsed_pattern
    symbols = pattern.physical_layer_symbols()
    for j in range(len(symbols) // 2):
        mapping.update(decoder_layer(f"model.layers.{j}.", f"layers.{2 * j}.",
                                     f"layers.{2 * j + 1}.", symbols[2 * j:2 * j + 2], args,
                                     gdn_in_proj))
    if pattern.mtp_depths:
        mapping.update(decoder_layer("mtp.layers.0.", "mtp.0.block.layers.0.",
                                     "mtp.0.block.layers.1.", pattern.mtp, args, gdn_in_proj))
        for theirs, ours in (("fc", "eh_proj"), ("pre_fc_norm_embedding", "embedding_norm"),
                             ("pre_fc_norm_hidden", "hidden_norm"), ("norm", "final_norm")):
            mapping[f"mtp.{theirs}.weight"] = f"mtp.0.{ours}.weight"
    return mapping


def decoder_layer(hf: str, mixer: str, ffn: str, symbols, args: HybridModelArgs,
                  gdn_in_proj) -> KeyMap:
    """The entries of HF decoder layer `hf` (its mixer and MLP / MoE): our layers `mixer` and
    `ffn` of the two `symbols`."""
    kind, ffn_kind = LAYER_KINDS[symbols[0]], LAYER_KINDS[symbols[1]]
    module = f"{hf}{MIXERS[kind.symbol]}."
    mapping: KeyMap = {hf + "input_layernorm.weight": f"{mixer}{kind.name}_norm.weight",
                       hf + "post_attention_layernorm.weight": f"{ffn}{ffn_kind.name}_norm.weight"}
    if kind is attention.KIND:
        mapping.update(llama_attention(module, f"{mixer}attention.", qk_norm=True))
    else:
        ours = f"{mixer}gdn."
        in_proj, conv = f"{ours}in_proj.weight", f"{ours}conv1d.weight"
        mapping.update(gdn_in_proj(module, in_proj, args))
        mapping[module + "conv1d.weight"] = tuple(
            f"{conv}.{part}" for part in ("query", "key", "value"))
        for name in ("A_log", "dt_bias", "norm.weight", "out_proj.weight"):
            mapping[module + name] = ours + name
    if ffn_kind is mlp.KIND:
        return mapping | swiglu_mlp(f"{hf}mlp.", f"{ffn}mlp.")
    ours = f"{ffn}moe."
    mapping[hf + "mlp.gate.weight"] = ours + "router.gate.weight"
    mapping[hf + "mlp.shared_expert_gate.weight"] = ours + "shared_expert_gate.weight"
    mapping.update(swiglu_mlp(f"{hf}mlp.shared_expert.", f"{ours}shared_expert."))
    return mapping | routed_experts(f"{hf}mlp.experts.", f"{ours}experts.",
                                    args.moe.num_experts)


def qwen3_5_key_map(args: HybridModelArgs) -> KeyMap:
    """Qwen3.5's key map; ValueError naming what its format cannot hold."""
    check_qwen3_5_compatible(args)
    return text_key_map(args)


def text_config(args: HybridModelArgs) -> dict:
    """The config.json fields Qwen3.5's and Qwen3-Next's text models share."""
    symbols = args.parsed_pattern.physical_layer_symbols()
    heads, delta = args.attention, args.gdn
    return {
        "vocab_size": args.vocab_size, "hidden_size": args.dim,
        "num_hidden_layers": len(symbols) // 2,
        "layer_types": ["full_attention" if s == attention.KIND.symbol else "linear_attention"
                        for s in symbols[0::2]],
        "num_attention_heads": heads.n_heads, "num_key_value_heads": heads.n_kv_heads,
        "head_dim": heads.head_dim, "hidden_act": "silu", "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": heads.rope_theta,
                            "partial_rotary_factor": heads.rotary_fraction},
        "linear_conv_kernel_dim": delta.conv_width, "linear_key_head_dim": delta.key_head_dim,
        "linear_value_head_dim": delta.value_head_dim,
        "linear_num_key_heads": delta.n_key_heads, "linear_num_value_heads": delta.n_value_heads,
    }


def experts_config(experts: MoEArgs) -> dict:
    return dict(num_experts=experts.num_experts, num_experts_per_tok=experts.top_k,
                moe_intermediate_size=experts.hidden_dim,
                shared_expert_intermediate_size=experts.shared_expert_hidden_dim)


def qwen3_5_config(args: HybridModelArgs) -> dict:
    """The config.json a `transformers` Qwen3_5ForCausalLM (or its MoE sibling) needs."""
    check_qwen3_5_compatible(args)
    with_experts = moe.KIND.symbol in args.parsed_pattern.physical_layer_symbols()
    architecture, model_type = MODEL_TYPES[with_experts]
    config = {"architectures": [architecture], "model_type": model_type, **text_config(args),
              "mtp_num_hidden_layers": args.parsed_pattern.mtp_depths}
    if with_experts:
        config.update(experts_config(args.moe))
    else:
        config["intermediate_size"] = args.mlp.hidden_dim
    return config


def check_text_config(config: dict) -> None:
    """ValueError naming a setting of a Qwen text config we cannot hold."""
    for field, expected in (("hidden_act", "silu"), ("attention_bias", False)):
        if config.get(field, expected) != expected:
            raise ValueError(f"{field}={config[field]!r} is not supported (expected "
                             f"{expected!r})")


def layer_types(config: dict) -> list[str]:
    """Each decoder layer's mixer, "full_attention" or "linear_attention"."""
    interval = config.get("full_attention_interval", 4)
    types = config.get("layer_types") or [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(config["num_hidden_layers"])]
    unknown = sorted(set(types) - {"full_attention", "linear_attention"})
    if unknown:
        raise ValueError(f"layer_types has {unknown}: the supported layer types are "
                         "full_attention, linear_attention")
    return types


def mtp_pattern(config: dict, field: str, ffn: str) -> str:
    """The pattern's MTP part ("/*-", "/*E" or "") for config.json's MTP layer count `field`;
    ValueError for what our MTP depths cannot hold."""
    layers = config.get(field) or 0
    if layers > 1:
        raise ValueError(f"{field}={layers} is not supported: its MTP layers share one fc and "
                         "its norms, step by step; titan_hybrid's MTP depths each have their "
                         "own (1 is supported)")
    if config.get("mtp_use_dedicated_embeddings"):
        raise ValueError("mtp_use_dedicated_embeddings=True is not supported: titan_hybrid's "
                         "MTP depths read the model's embedding")
    return f"/{attention.KIND.symbol}{ffn}" if layers else ""


def mixer_symbol(layer_type: str) -> str:
    return attention.KIND.symbol if layer_type == "full_attention" else gdn.KIND.symbol


def text_model_args(config: dict, pattern: str, experts: MoEArgs) -> HybridModelArgs:
    """HybridModelArgs of a Qwen3.5 / Qwen3-Next text config with the given pattern and MoE
    args. Rotary settings: `rope_parameters`, or the top-level `rope_theta` /
    `partial_rotary_factor` of configs written before transformers 5."""
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters.rope_type={rope['rope_type']!r} is not supported "
                         "(default)")
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    fraction = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))
    heads = config["num_attention_heads"]
    base = HybridModelArgs()
    return dataclasses.replace(
        base, norm_zero_centered=True, pattern=pattern,
        dim=config["hidden_size"], vocab_size=config["vocab_size"],
        norm_eps=config.get("rms_norm_eps", 1e-6),
        max_seq_len=config.get("max_position_embeddings", base.max_seq_len),
        attention=AttentionArgs(
            n_heads=heads, n_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rope_theta=theta, rotary_fraction=fraction, **GATED_ATTENTION),
        gdn=GDNArgs(key_head_dim=config["linear_key_head_dim"],
                    value_head_dim=config["linear_value_head_dim"],
                    n_key_heads=config["linear_num_key_heads"],
                    n_value_heads=config["linear_num_value_heads"],
                    conv_width=config.get("linear_conv_kernel_dim", 4)),
        mlp=MLPArgs(hidden_dim=config.get("intermediate_size", base.mlp.hidden_dim),
                    activation="swiglu"),
        moe=experts)


def experts_of(config: dict, normalizes_top_k: bool = True) -> MoEArgs:
    return MoEArgs(num_experts=config["num_experts"], top_k=config["num_experts_per_tok"],
                   hidden_dim=config["moe_intermediate_size"],
                   shared_expert_hidden_dim=config["shared_expert_intermediate_size"],
                   score_func="softmax", norm_topk_prob=normalizes_top_k,
                   shared_expert_gate=True)


def model_args_from_qwen3_5_config(config: dict) -> HybridModelArgs:
    """HybridModelArgs for an HF Qwen3.5 config.json (its text model: a multimodal config's
    `text_config`); ValueError naming the first setting the format cannot hold."""
    if "text_config" in config:
        config = {**config["text_config"], "model_type": config["model_type"]}
    check_text_config(config)
    with_experts = "moe" in config["model_type"]
    ffn = moe.KIND.symbol if with_experts else mlp.KIND.symbol
    pattern = "".join(mixer_symbol(kind) + ffn for kind in layer_types(config))
    pattern += mtp_pattern(config, "mtp_num_hidden_layers", ffn)
    experts = experts_of(config) if with_experts else HybridModelArgs().moe
    return dataclasses.replace(text_model_args(config, pattern, experts), hf_format=FORMAT)


# The family, as titan_hybrid/hf/families.py lists it.
FAMILY = Family(
    name="qwen3_5", model_types=("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"),
    format_name="Qwen3.5",
    key_map=qwen3_5_key_map,
    check=check_qwen3_5_compatible,
    config=qwen3_5_config,
    to_args=model_args_from_qwen3_5_config,
    mtp_marker=lambda args: "mtp.fc.weight",
    mtp_count_field="mtp_num_hidden_layers")

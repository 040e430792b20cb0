"""Hugging Face LFM2 interop (`transformers`' `lfm2`, Liquid AI's LFM2 / LFM2.5, and
`lfm2_moe`, LFM2-8B-A1B): gated short convolution and GQA attention decoder layers, each
followed by a SwiGLU MLP or (lfm2_moe, after its `num_dense_layers` dense ones) a MoE layer.
Patterns of `S-` / `*-` (and `SE` / `*E`) pairs.

HF decoder layer j is our layers 2j (`operator_norm`, then `conv.*` or `self_attn.*`) and
2j + 1 (`ffn_norm`, `feed_forward.*`); the final norm is `embedding_norm`. The short conv's
in_proj [B | C | x] is our in_proj's three components, its `conv.conv` our conv1d;
`conv_bias` puts biases on all three of its projections. The attention has per-head q / k
norms (`q_layernorm`, `k_layernorm`), rotate-half RoPE over whole heads, and its output
projection is `out_proj`. The MLP is w1 (gate), w3 (up), w2 (down); with
`block_auto_adjust_ff_dim` its width is derived from `intermediate_size` (2/3 of it, times
`block_ffn_dim_multiplier`, rounded up to `block_multiple_of`), and an export writes the width
itself (lfm2_moe's dense MLPs are `intermediate_size` wide as they are). lfm2_moe's router
is a sigmoid whose `expert_bias` (a buffer: our router's choice bias) only chooses, the chosen
scores renormalised with 1e-6 in the denominator (`moe.norm_topk_eps`) and scaled; its
experts are one HF tensor per projection and expert (`experts.N.w1`, as transformers
writes them) and it has no shared expert. Configs of the released models name some fields as LFM2's own code did
(`tie_embedding`, `block_ff_dim`); both spellings are read. The LM head is tied to the
embedding unless the config says otherwise.
"""

from __future__ import annotations

import dataclasses

from titan_hybrid.hf.engine import KeyMap
from titan_hybrid.hf.family import Family
from titan_hybrid.hf.key_map_parts import attention_problems
from titan_hybrid.hf.vocabulary import routed_experts
from titan_hybrid.model import attention, mlp, moe, short_conv
from titan_hybrid.model.args import (
    AttentionArgs,
    HybridModelArgs,
    MLPArgs,
    MoEArgs,
    ShortConvArgs,
)

FORMAT = "lfm2"
NAME = "LFM2"
MIXERS = {short_conv.KIND.symbol: "conv", attention.KIND.symbol: "full_attention"}
ATTENTION = dict(use_rope=True, rope_interleave=False, rotary_fraction=1.0, qk_norm=True,
                 qk_norm_scope="head", qk_norm_zero_centered=False, output_gate=False,
                 softmax_scale=None)
DEFAULT_ROPE_THETA = 1_000_000.0  # Lfm2Config.default_theta
MODEL_TYPES = {False: ("Lfm2ForCausalLM", "lfm2"),
               True: ("Lfm2MoeForCausalLM", "lfm2_moe")}  # by MoE layers
ROUTER_NORM_EPS = 1e-6  # Lfm2MoeTopKRouter's renormalisation
# Names of released LFM2 configs -> transformers' names.
ALIASES = {"tie_embedding": "tie_word_embeddings", "block_ff_dim": "intermediate_size"}


def check_lfm2_compatible(args: HybridModelArgs) -> None:
    """ValueError naming the first field the HF LFM2 format cannot represent."""
    pattern = args.parsed_pattern
    symbols = pattern.physical_layer_symbols()
    problems = []
    ffns = "".join(symbols[1::2])
    dense = len(ffns) - len(ffns.lstrip(mlp.KIND.symbol))
    if (not symbols or len(symbols) % 2 or any(s not in MIXERS for s in symbols[0::2])
            or set(ffns[dense:]) - {moe.KIND.symbol}):
        problems.append(f"hybrid.pattern '{args.pattern}' must be 'S' / '*' layers each "
                        "followed by an MLP ('-') or, after the MLP ones, a MoE layer ('E')")
    experts = args.moe
    if moe.KIND.symbol in ffns and (
            experts.activation, experts.score_func, experts.normalizes_top_k and
            experts.norm_topk_eps, experts.n_group, experts.shared_expert_hidden_dim,
            experts.shared_expert_gate) not in (
            ("swiglu", "sigmoid", ROUTER_NORM_EPS, 1, 0, False),
            ("swiglu", "sigmoid", False, 1, 0, False)):
        problems.append(f"moe: lfm2_moe's MoE layers have SwiGLU experts, a sigmoid router "
                        f"(renormalised with moe.norm_topk_eps={ROUTER_NORM_EPS}, or not), "
                        "no groups and no shared expert")
    if any(isinstance(item, tuple) for item in pattern.main) or pattern.mtp_depths:
        problems.append(f"hybrid.pattern '{args.pattern}' has bracket groups or MTP depths")
    if args.norm_zero_centered or args.post_norm_mixers or args.mlp.activation != "swiglu":
        problems.append("norms must be pre-norms scaling by their weight and the MLP must be "
                        "SwiGLU")
    if attention.KIND.symbol in symbols:
        problems += attention_problems(args, ATTENTION, NAME, whole_heads=True)
    if problems:
        raise ValueError(f"model cannot use the HF {NAME} format: " + "; ".join(problems))


def lfm2_key_map(args: HybridModelArgs) -> KeyMap:
    """HF key -> ours (a fused HF tensor: the tuple of our components)."""
    check_lfm2_compatible(args)
    mapping: KeyMap = {"model.embed_tokens.weight": "tok_embeddings.weight",
                       "model.embedding_norm.weight": "norm.weight",
                       "lm_head.weight": "output.weight"}
    symbols = args.parsed_pattern.physical_layer_symbols()
    for j in range(len(symbols) // 2):
        hf, mixer, ffn = f"model.layers.{j}.", f"layers.{2 * j}.", f"layers.{2 * j + 1}."
        mapping.update(feed_forward(args, f"{hf}", ffn, symbols[2 * j + 1]))
        if symbols[2 * j] == attention.KIND.symbol:
            mapping[f"{hf}operator_norm.weight"] = f"{mixer}attention_norm.weight"
            for theirs, name in (("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv"),
                                 ("out_proj", "wo"), ("q_layernorm", "q_norm"),
                                 ("k_layernorm", "k_norm")):
                mapping[f"{hf}self_attn.{theirs}.weight"] = f"{mixer}attention.{name}.weight"
            continue
        mapping[f"{hf}operator_norm.weight"] = f"{mixer}short_conv_norm.weight"
        module, ours = f"{hf}conv.", f"{mixer}short_conv."
        tensors = ("weight", "bias") if args.short_conv.bias else ("weight",)
        for tensor in tensors:
            mapping[f"{module}in_proj.{tensor}"] = tuple(
                f"{ours}in_proj.{tensor}{part}" for part in short_conv.IN_PROJ_PARTS)
            mapping[f"{module}conv.{tensor}"] = f"{ours}conv1d.{tensor}"
            mapping[f"{module}out_proj.{tensor}"] = f"{ours}out_proj.{tensor}"
    return mapping


def feed_forward(args: HybridModelArgs, hf: str, ours: str, symbol: str) -> KeyMap:
    """HF decoder layer `hf`'s ffn_norm and feed_forward (an MLP or, lfm2_moe's, a MoE
    layer) as our layer `ours` of kind `symbol`."""
    if symbol == mlp.KIND.symbol:
        mapping: KeyMap = {f"{hf}ffn_norm.weight": f"{ours}mlp_norm.weight"}
        for theirs, name in (("w1", "fc1.weight_w"), ("w3", "fc1.weight_v"),
                             ("w2", "fc2.weight")):
            mapping[f"{hf}feed_forward.{theirs}.weight"] = f"{ours}mlp.{name}"
        return mapping
    mapping = {f"{hf}ffn_norm.weight": f"{ours}moe_norm.weight",
               f"{hf}feed_forward.gate.weight": f"{ours}moe.router.gate.weight"}
    if args.moe.score_correction_bias:
        mapping[f"{hf}feed_forward.expert_bias"] = f"{ours}moe.router.e_score_correction_bias"
    return mapping | routed_experts(f"{hf}feed_forward.experts.", f"{ours}moe.experts.",
                                    args.moe.num_experts, names=("w1", "w3", "w2"))


def lfm2_config(args: HybridModelArgs) -> dict:
    """The config.json a `transformers` Lfm2ForCausalLM (Lfm2MoeForCausalLM, with MoE
    layers) needs."""
    check_lfm2_compatible(args)
    symbols = args.parsed_pattern.physical_layer_symbols()
    heads, experts = args.attention, args.moe
    with_experts = moe.KIND.symbol in symbols
    architecture, model_type = MODEL_TYPES[with_experts]
    ffns = "".join(symbols[1::2])
    mlp_config = ({"num_dense_layers": len(ffns) - len(ffns.lstrip(mlp.KIND.symbol)),
                   "num_experts": experts.num_experts,
                   "num_experts_per_tok": experts.top_k,
                   "moe_intermediate_size": experts.hidden_dim,
                   "use_expert_bias": experts.score_correction_bias,
                   "routed_scaling_factor": experts.routed_scaling_factor,
                   "norm_topk_prob": experts.normalizes_top_k}
                  if with_experts else {"block_auto_adjust_ff_dim": False})
    return {
        "architectures": [architecture], "model_type": model_type,
        "vocab_size": args.vocab_size, "hidden_size": args.dim,
        "intermediate_size": args.mlp.hidden_dim, **mlp_config,
        "num_hidden_layers": len(symbols) // 2,
        "layer_types": [MIXERS[s] for s in symbols[0::2]],
        "num_attention_heads": heads.n_heads, "num_key_value_heads": heads.n_kv_heads,
        "norm_eps": args.norm_eps, "max_position_embeddings": args.max_seq_len,
        "rope_parameters": {"rope_type": "default", "rope_theta": heads.rope_theta},
        "conv_bias": args.short_conv.bias, "conv_L_cache": args.short_conv.conv_width,
    }


def canonical_config(config: dict) -> dict:
    """The config with released LFM2 configs' field names (ALIASES) as transformers'."""
    return {**{ALIASES[k]: v for k, v in config.items() if k in ALIASES},
            **{k: v for k, v in config.items() if k not in ALIASES}}


def mlp_width(config: dict) -> int:
    """The MLP's hidden width, as Lfm2MLP derives it (Lfm2MoeMLP takes it as it is)."""
    width = config.get("intermediate_size", 12288)
    if config["model_type"] == MODEL_TYPES[True][1] or not config.get(
            "block_auto_adjust_ff_dim", True):
        return width
    width = int(2 * width / 3)
    multiplier = config.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is not None:
        multiple = config.get("block_multiple_of", 256)
        width = multiple * ((int(multiplier * width) + multiple - 1) // multiple)
    return width


def layer_types(config: dict) -> list[str]:
    layers = config["num_hidden_layers"]
    attention_layers = config.get("full_attn_idxs")
    if attention_layers is None:
        attention_layers = range(layers)
    types = config.get("layer_types") or [
        "full_attention" if i in attention_layers else "conv" for i in range(layers)]
    unknown = sorted(set(types) - set(MIXERS.values()))
    if unknown:
        raise ValueError(f"layer_types has {unknown}: the supported layer types are "
                         f"{', '.join(MIXERS.values())}")
    return types


def model_args_from_lfm2_config(config: dict) -> HybridModelArgs:
    """HybridModelArgs for an HF LFM2 config.json; ValueError naming the first setting the
    format cannot hold."""
    config = canonical_config(config)
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters.rope_type={rope['rope_type']!r} is not supported "
                         "(default)")
    dim, heads = config["hidden_size"], config["num_attention_heads"]
    symbol_of = {kind: symbol for symbol, kind in MIXERS.items()}
    base = HybridModelArgs()
    experts, dense = base.moe, len(layer_types(config))
    if config["model_type"] == MODEL_TYPES[True][1]:
        dense = config.get("num_dense_layers", 2)
        experts = MoEArgs(num_experts=config.get("num_experts", 32),
                          top_k=config.get("num_experts_per_tok", 4),
                          hidden_dim=config.get("moe_intermediate_size", 1792),
                          score_func="sigmoid",
                          score_correction_bias=config.get("use_expert_bias", True),
                          norm_topk_prob=config.get("norm_topk_prob", True),
                          norm_topk_eps=ROUTER_NORM_EPS,
                          routed_scaling_factor=config.get("routed_scaling_factor", 1.0))
    return dataclasses.replace(
        base, hf_format=FORMAT, moe=experts,
        pattern="".join(symbol_of[kind] + (mlp.KIND.symbol if j < dense else moe.KIND.symbol)
                        for j, kind in enumerate(layer_types(config))),
        dim=dim, vocab_size=config["vocab_size"], norm_eps=config.get("norm_eps", 1e-5),
        max_seq_len=config.get("max_position_embeddings", base.max_seq_len),
        attention=AttentionArgs(
            n_heads=heads, n_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=dim // heads,
            rope_theta=rope.get("rope_theta", config.get("rope_theta", DEFAULT_ROPE_THETA)),
            **ATTENTION),
        short_conv=ShortConvArgs(conv_width=config.get("conv_L_cache", 3),
                                 bias=bool(config.get("conv_bias", False))),
        mlp=MLPArgs(hidden_dim=mlp_width(config), activation="swiglu"))


# The family, as titan_hybrid/hf/families.py lists it.
FAMILY = Family(
    name=FORMAT, model_types=tuple(model_type for _, model_type in MODEL_TYPES.values()),
    format_name=NAME,
    key_map=lfm2_key_map,
    check=check_lfm2_compatible,
    config=lfm2_config,
    to_args=model_args_from_lfm2_config,
    ties=lambda config: bool(canonical_config(config).get("tie_word_embeddings", True)))

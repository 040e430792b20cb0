"""Hugging Face DeepSeek-V4 (transformers' `deepseek_v4`, DeepseekV4ForCausalLM) interop: a whole
V4 model, its hyper-connections, hash-routed MoE layers and MTP block included.

HF decoder layer j is our layers 2j and 2j + 1:
- 2j is its attention, `W`, `C` or `H` by `layer_types[j]` (sliding, compressed sparse,
  heavily compressed). Its parameters carry transformers' in-memory names already; on disk they
  go by DeepSeek's (`attn.wq_a`, `attn.compressor.wkv`, `attn.indexer.wq_b`, ...: RELEASE_NAMES).
- 2j + 1 is its MoE, `E`: sqrtsoftplus (or sigmoid) scores with a choice bias (`ffn.gate.bias`),
  the chosen weights normalised and scaled, SwiGLU experts and one shared expert clamped at
  `swiglu_limit`. The first `moe.hash_layers` route by the token-id table (`ffn.gate.tid2eid`:
  `mlp_layer_types` "hash_moe") and have no choice bias.
- `hc_attn_*` / `hc_ffn_*` are the two layers' hyper-connections (`fn`, `base`, `scale`),
  `attn_norm` / `ffn_norm` their input norms; `hc_head` is the model's hyper head.

MTP depth d is `mtp.{d}.*` (DeepSeek's naming; transformers models no MTP and skips these on
load): a decoder layer (`W` and `E`, top-k routed) with `enorm`, `hnorm`, `e_proj`, `h_proj`,
a hyper head `hc_head_*` and its final `norm`; the embedding and head are the main model's.

Two namings are read, and transformers' is written:
- transformers' save_pretrained: `model.layers.{j}.` + DeepSeek's layer names,
  `model.embed_tokens.weight`, `model.norm.weight`, `model.hc_head.hc_fn`, `head.weight`;
- DeepSeek's release: the layers without `model.`, `embed.weight`, `norm.weight`,
  `hc_head_fn`, `head.weight` (`deepseek_v4_file_key_map` takes a file's).
Quantized releases (FP8 / FP4 experts with `.scale` tensors) are refused: their scale tensors
have no place in the model, and an error names them.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from titan_hybrid.hf.engine import KeyMap, Shapes
from titan_hybrid.hf.family import Family
from titan_hybrid.hf.vocabulary import routed_experts
from titan_hybrid.model import deepseek_v4, deepseek_v4_csa, deepseek_v4_hca
from titan_hybrid.model.args import HybridModelArgs, MoEArgs
from titan_hybrid.model.layer_kind import LayerKind
from titan_hybrid.model.moe import KIND as MOE

# Our kind of each transformers layer type.
V4_KINDS: dict[str, LayerKind] = {"sliding_attention": deepseek_v4.KIND,
                                  "compressed_sparse_attention": deepseek_v4_csa.KIND,
                                  "heavily_compressed_attention": deepseek_v4_hca.KIND}
LAYER_TYPE = {kind.symbol: layer_type for layer_type, kind in V4_KINDS.items()}
FORMAT = "HF DeepSeek-V4"
MTP_LAYER = deepseek_v4.KIND.symbol + MOE.symbol  # DeepSeek's MTP block: sliding window, MoE
SCORE_FUNCTIONS = ("sqrtsoftplus", "sigmoid")  # the ones transformers' V4 routers compute
# Our (transformers' in-memory) attention parameter names -> DeepSeek's, name part by name part.
RELEASE_NAMES = {"q_a_proj": "wq_a", "q_b_proj": "wq_b", "kv_proj": "wkv", "gate_proj": "wgate",
                 "o_a_proj": "wo_a", "o_b_proj": "wo_b", "q_a_norm": "q_norm", "kv_norm": "norm",
                 "position_bias": "ape", "sinks": "attn_sink"}
INDEXER = "compressor.indexer."


def release_name(parameter: str) -> str:
    """DeepSeek's name of one of our V4 attention parameters: renamed part by part, and the
    indexer's own compressor under `indexer.compressor.` (its query projection and scorer
    directly under `indexer.`)."""
    if parameter.startswith(INDEXER):
        rest = parameter[len(INDEXER):]
        if rest.startswith("scorer."):
            return "indexer." + rest[len("scorer."):]
        if rest.startswith("q_b_proj."):
            return "indexer." + release_name(rest)
        return "indexer.compressor." + release_name(rest)
    return ".".join(RELEASE_NAMES.get(part, part) for part in parameter.split("."))


# --------------------------------------------------------------------------- what it holds
def check_deepseek_v4_compatible(args: HybridModelArgs) -> None:
    """ValueError naming the first of the model's settings the format cannot hold."""
    problems = _pattern_problems(args)
    if args.hc_mult < 1:
        problems.append(f"hc_mult={args.hc_mult}: DeepSeek-V4's residual stream is hc_mult >= 1 "
                        "hyper-connection streams")
    experts = args.moe
    if (experts.activation, experts.score_correction_bias, experts.normalizes_top_k,
            experts.n_group, experts.shared_expert_gate, experts.latent_dim) != (
            "swiglu", True, True, 1, False, 0) or experts.score_func not in SCORE_FUNCTIONS \
            or experts.shared_expert_hidden_dim != experts.hidden_dim:
        problems.append(
            f"moe: activation={experts.activation!r}, score_func={experts.score_func!r}, "
            f"score_correction_bias={experts.score_correction_bias}, normalizes the top-k: "
            f"{experts.normalizes_top_k}, n_group={experts.n_group}, shared_expert_gate="
            f"{experts.shared_expert_gate}, latent_dim={experts.latent_dim}, "
            f"shared_expert_hidden_dim={experts.shared_expert_hidden_dim} (hidden_dim "
            f"{experts.hidden_dim}); DeepSeek-V4's MoE layers have SwiGLU experts, a "
            f"{' or '.join(SCORE_FUNCTIONS)} router with a choice bias whose chosen weights are "
            "normalised, and one shared expert of the experts' width")
    if experts.swiglu_limit <= 0:
        problems.append(f"moe.swiglu_limit={experts.swiglu_limit}: DeepSeek-V4 always clamps "
                        "its SwiGLU (> 0)")
    for field in ("norm_zero_centered", "post_norm_mixers"):
        if getattr(args, field):
            problems.append(f"{field}={getattr(args, field)!r} must be off")
    for field in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
        if getattr(args, field) != 1.0:
            problems.append(f"{field}={getattr(args, field)} must be 1")
    if not problems:
        _attention_config(args)  # ValueError naming two sections that disagree
        return
    raise ValueError(f"model cannot use the {FORMAT} format: " + "; ".join(problems))


def _pattern_problems(args: HybridModelArgs) -> list[str]:
    pattern = args.parsed_pattern
    symbols = pattern.physical_layer_symbols()
    problems = []
    if any(isinstance(item, tuple) for item in pattern.main):
        problems.append(f"hybrid.pattern '{args.pattern}' has bracket groups")
    elif (not symbols or len(symbols) % 2 or any(symbol not in LAYER_TYPE
                                                 for symbol in symbols[0::2])
          or set(symbols[1::2]) != {MOE.symbol}):
        problems.append(f"hybrid.pattern '{args.pattern}' must be DeepSeek-V4's decoder layers: "
                        f"an attention layer ({' '.join(LAYER_TYPE)}) and a MoE layer "
                        f"('{MOE.symbol}') each")
    if pattern.mtp_depths and "".join(pattern.mtp) != MTP_LAYER:
        problems.append(f"hybrid.pattern '{args.pattern}': DeepSeek-V4's MTP block is one "
                        f"decoder layer a depth, '{MTP_LAYER}'")
    return problems


def _attention_config(args: HybridModelArgs) -> dict:
    """The DeepseekV4Config fields of the attention blocks; ValueError naming the first field
    on which two of the pattern's V4 sections disagree (transformers has one value)."""
    symbols = args.parsed_pattern.physical_layer_symbols(include_mtp=True)
    kinds = [V4_KINDS[LAYER_TYPE[symbol]] for symbol in dict.fromkeys(symbols)
             if symbol in LAYER_TYPE]
    config: dict = {"rms_norm_eps": args.norm_eps}
    origin: dict[str, str] = {"rms_norm_eps": "norm_eps"}

    def put(field: str, value, source: str) -> None:
        if field in config and config[field] != value:
            raise ValueError(f"model cannot use the {FORMAT} format: {source}={value!r} differs "
                             f"from {origin[field]}={config[field]!r} (transformers' {field} is "
                             "one value for every layer)")
        config.setdefault(field, value)
        origin.setdefault(field, source)

    for kind in kinds:
        section, name = args.section(kind), kind.name
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
        config.setdefault("compress_rates", {})[LAYER_TYPE[kind.symbol]] = section.compress_ratio
        put("compress_yarn", _yarn_of(section), f"{name}'s YaRN fields")
        if hasattr(section, "index_topk"):  # C: its indexer
            for field in ("index_n_heads", "index_head_dim", "index_topk"):
                put(field, getattr(section, field), f"{name}.{field}")
    return config


def _yarn_of(section) -> dict | None:
    if section.rope_scaling_factor == 1.0:
        return None
    return {"rope_type": "yarn", "factor": section.rope_scaling_factor,
            "original_max_position_embeddings": section.original_max_position_embeddings,
            "beta_fast": section.beta_fast, "beta_slow": section.beta_slow,
            "attention_factor": section.attention_factor}


# --------------------------------------------------------------------------- config.json
def deepseek_v4_config(args: HybridModelArgs) -> dict:
    """The config.json transformers' DeepseekV4ForCausalLM reads."""
    check_deepseek_v4_compatible(args)
    attention = _attention_config(args)
    yarn = attention.pop("compress_yarn", None)
    symbols = args.parsed_pattern.physical_layer_symbols()
    layer_types = [LAYER_TYPE[symbol] for symbol in symbols[0::2]]
    experts = args.moe
    compress_rope = yarn or {"rope_type": "default"}
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": args.vocab_size, "hidden_size": args.dim,
        "num_hidden_layers": len(layer_types), "layer_types": layer_types,
        "mlp_layer_types": ["hash_moe" if hashed else "moe"
                            for hashed in args.hash_routed(symbols)[1::2]],
        "num_key_value_heads": 1, "max_position_embeddings": args.max_seq_len,
        **attention,
        "rope_parameters": {
            "main": {"rope_type": "default", "rope_theta": attention.get("rope_theta", 10000.0),
                     "partial_rotary_factor": attention["partial_rotary_factor"]},
            "compress": {**compress_rope,
                         "rope_theta": attention.get("compress_rope_theta", 160000.0),
                         "partial_rotary_factor": attention["partial_rotary_factor"]}},
        "n_routed_experts": experts.num_experts, "num_experts_per_tok": experts.top_k,
        "moe_intermediate_size": experts.hidden_dim, "n_shared_experts": 1,
        "scoring_func": experts.score_func, "norm_topk_prob": True,
        "routed_scaling_factor": experts.routed_scaling_factor,
        "swiglu_limit": experts.swiglu_limit, "hidden_act": "silu",
        "hc_mult": args.hc_mult, "hc_sinkhorn_iters": args.hc_sinkhorn_iters,
        "hc_eps": args.hc_eps, "num_nextn_predict_layers": args.parsed_pattern.mtp_depths,
        "attention_bias": False, "mlp_bias": False,
    }


# --------------------------------------------------------------------------- tensors
def _decoder_layer(args: HybridModelArgs, hf: str, mixer: str, ffn: str, attention: LayerKind,
                   hash_routed: bool) -> KeyMap:
    """The entries of one decoder layer in DeepSeek's names under `hf`: our attention layer
    `mixer` and MoE layer `ffn`."""
    with torch.device("meta"):
        parameters = list(attention.build(args.section(attention), args.dim,
                                          args.norm_eps).state_dict())
    moe = f"{ffn}moe."
    mapping: KeyMap = {f"{hf}attn_norm.weight": f"{mixer}{attention.name}_norm.weight",
                       f"{hf}ffn_norm.weight": f"{ffn}{MOE.name}_norm.weight",
                       f"{hf}ffn.gate.weight": f"{moe}router.gate.weight"}
    for parameter in parameters:
        mapping[f"{hf}attn.{release_name(parameter)}"] = f"{mixer}{attention.name}.{parameter}"
    for site, layer in (("attn", mixer), ("ffn", ffn)):
        for part in ("fn", "base", "scale"):
            mapping[f"{hf}hc_{site}_{part}"] = f"{layer}hyper_connection.{part}"
    if hash_routed:
        mapping[f"{hf}ffn.gate.tid2eid"] = f"{moe}router.tid2eid"
    else:
        mapping[f"{hf}ffn.gate.bias"] = f"{moe}router.e_score_correction_bias"
    for theirs, ours in (("w1", "fc1.weight_w"), ("w3", "fc1.weight_v"), ("w2", "fc2.weight")):
        mapping[f"{hf}ffn.shared_experts.{theirs}.weight"] = f"{moe}shared_expert.{ours}"
    return mapping | routed_experts(f"{hf}ffn.experts.", f"{moe}experts.",
                                    args.moe.num_experts, names=("w1", "w3", "w2"))


def deepseek_v4_key_map(args: HybridModelArgs, release: bool = False) -> KeyMap:
    """HF key -> ours, in DeepSeek's release naming or transformers' save_pretrained one (what
    an export writes). Every HF tensor is one of ours under another name, or one expert's
    slice of our experts (fc1's halves are the split state dict's components `fc1.weight_w` /
    `_v`), so each rank writes or reads the pieces it holds under any layout."""
    check_deepseek_v4_compatible(args)
    model = "" if release else "model."
    mapping: KeyMap = {("embed.weight" if release else "model.embed_tokens.weight"):
                       "tok_embeddings.weight",
                       f"{model}norm.weight": "norm.weight", "head.weight": "output.weight"}
    for part in ("fn", "base", "scale"):
        mapping[f"hc_head_{part}" if release else f"model.hc_head.hc_{part}"] = (
            f"hc_head.hc_{part}")
    pattern = args.parsed_pattern
    symbols = pattern.physical_layer_symbols()
    hashed = args.hash_routed(symbols)
    for j in range(len(symbols) // 2):
        mapping.update(_decoder_layer(args, f"{model}layers.{j}.", f"layers.{2 * j}.",
                                      f"layers.{2 * j + 1}.",
                                      V4_KINDS[LAYER_TYPE[symbols[2 * j]]], hashed[2 * j + 1]))
    for depth in range(pattern.mtp_depths):
        hf, ours = f"mtp.{depth}.", f"mtp.{depth}."
        mapping.update(_decoder_layer(args, hf, f"{ours}block.layers.0.",
                                      f"{ours}block.layers.1.", deepseek_v4.KIND, False))
        for theirs, name in (("enorm.weight", "embedding_norm.weight"),
                             ("hnorm.weight", "hidden_norm.weight"),
                             ("e_proj.weight", "e_proj.weight"),
                             ("h_proj.weight", "h_proj.weight"),
                             ("norm.weight", "final_norm.weight"),
                             *((f"hc_head_{part}", f"hc_head.hc_{part}")
                               for part in ("fn", "base", "scale"))):
            mapping[hf + theirs] = ours + name
    return mapping


def deepseek_v4_file_key_map(args: HybridModelArgs, stored: Shapes) -> KeyMap:
    """The key map of a file whose tensors are `stored`: DeepSeek's release names its
    embedding `embed.weight`."""
    return deepseek_v4_key_map(args, release="embed.weight" in stored)


# --------------------------------------------------------------------------- config -> args
def _refusals(config: dict) -> list[str]:
    """The settings of a V4 config.json that titan_hybrid's layers do not compute."""
    problems = []
    for field, expected in (("hidden_act", "silu"), ("attention_bias", False),
                            ("mlp_bias", False), ("num_key_value_heads", 1),
                            ("n_shared_experts", 1), ("norm_topk_prob", True),
                            ("router_jitter_noise", 0.0), ("quantization_config", None)):
        if config.get(field, expected) != expected:
            problems.append(f"{field}={config[field]!r} is not supported (titan_hybrid's V4 "
                            f"layers compute {field}={expected!r})")
    if config.get("scoring_func", "sqrtsoftplus") not in SCORE_FUNCTIONS:
        problems.append(f"scoring_func={config['scoring_func']!r} is not one of "
                        f"{SCORE_FUNCTIONS}")
    kinds = config.get("mlp_layer_types") or []
    hashed = kinds.count("hash_moe")
    if kinds[:hashed] != ["hash_moe"] * hashed:
        problems.append(f"mlp_layer_types={kinds}: hash-routed layers ('hash_moe') come first "
                        "in titan_hybrid (moe.hash_layers)")
    compress = (config.get("rope_parameters") or {}).get("compress") or {}
    if compress.get("truncate", True) is not True:
        problems.append(f"rope_parameters.compress.truncate={compress['truncate']!r}: the "
                        "compressed layers' YaRN table rounds its correction range")
    main = (config.get("rope_parameters") or {}).get("main") or {}
    if main.get("rope_type", "default") != "default":
        problems.append(f"rope_parameters.main.rope_type={main['rope_type']!r}: the sliding "
                        "layers' table is plain RoPE")
    return problems


def _yarn_attention_factor(yarn: dict, factor: float) -> float:
    """The factor on a YaRN table's cos and sin: the config's, else what transformers infers,
    0.1 ln(factor) + 1 (with `mscale` and `mscale_all_dim`, the ratio of two such)."""
    if yarn.get("attention_factor") is not None:
        return yarn["attention_factor"]

    def mscale(scale: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    if yarn.get("mscale") and yarn.get("mscale_all_dim"):
        return mscale(yarn["mscale"]) / mscale(yarn["mscale_all_dim"])
    return mscale()


def model_args_from_deepseek_v4_config(config: dict) -> HybridModelArgs:
    """HybridModelArgs for a DeepSeek-V4 config.json; ValueError naming the first setting the
    format's layers cannot hold."""
    problems = _refusals(config)
    if problems:
        raise ValueError("; ".join(problems))
    layer_types = list(config["layer_types"])[:config["num_hidden_layers"]]
    unknown = [layer_type for layer_type in layer_types if layer_type not in V4_KINDS]
    if unknown:
        raise ValueError(f"layer_types {unknown} are not DeepSeek-V4's {list(V4_KINDS)}")
    head_dim, eps = config["head_dim"], config.get("rms_norm_eps", 1e-6)
    rope_head_dim = round(head_dim * config["partial_rotary_factor"])
    rope = config.get("rope_parameters") or {}
    compress = rope.get("compress") or {}
    base = HybridModelArgs()
    shared = dict(n_heads=config["num_attention_heads"], head_dim=head_dim,
                  rope_head_dim=rope_head_dim, q_lora_rank=config["q_lora_rank"],
                  o_groups=config["o_groups"], o_lora_rank=config["o_lora_rank"],
                  sliding_window=config["sliding_window"], norm_eps=eps)
    rates = config.get("compress_rates") or {}
    compressed = dict(shared, rope_theta=config.get("compress_rope_theta", 160000.0))
    if compress.get("rope_type", "default") == "yarn":
        original = compress["original_max_position_embeddings"]
        factor = compress.get("factor") or config["max_position_embeddings"] / original
        compressed.update(rope_scaling_factor=factor, original_max_position_embeddings=original,
                          beta_fast=compress.get("beta_fast") or 32.0,
                          beta_slow=compress.get("beta_slow") or 1.0,
                          attention_factor=_yarn_attention_factor(compress, factor))
    sections = {
        deepseek_v4.KIND.name: dict(shared, rope_theta=config.get("rope_theta", 10000.0)),
        deepseek_v4_hca.KIND.name: dict(
            compressed, compress_ratio=rates.get("heavily_compressed_attention", 128)),
        deepseek_v4_csa.KIND.name: dict(
            compressed, compress_ratio=rates.get("compressed_sparse_attention", 4),
            index_n_heads=config["index_n_heads"], index_head_dim=config["index_head_dim"],
            index_topk=config["index_topk"]),
    }
    experts = MoEArgs(
        num_experts=config["n_routed_experts"], top_k=config["num_experts_per_tok"],
        hidden_dim=config["moe_intermediate_size"],
        shared_expert_hidden_dim=config["moe_intermediate_size"],
        score_func=config.get("scoring_func", "sqrtsoftplus"), score_correction_bias=True,
        norm_topk_prob=True, routed_scaling_factor=config.get("routed_scaling_factor", 1.0),
        swiglu_limit=config.get("swiglu_limit", 10.0),
        hash_layers=(config.get("mlp_layer_types") or []).count("hash_moe"))
    main = "".join(V4_KINDS[layer_type].symbol + MOE.symbol for layer_type in layer_types)
    mtp = f"/{MTP_LAYER}" * (config.get("num_nextn_predict_layers") or 0)
    return dataclasses.replace(
        base, hf_format="deepseek_v4", pattern=main + mtp, dim=config["hidden_size"],
        vocab_size=config["vocab_size"], norm_eps=eps,
        max_seq_len=config.get("max_position_embeddings", base.max_seq_len), moe=experts,
        hc_mult=config.get("hc_mult", 4), hc_sinkhorn_iters=config.get("hc_sinkhorn_iters", 20),
        hc_eps=config.get("hc_eps", 1e-6),
        **{name: dataclasses.replace(getattr(base, name), **fields)
           for name, fields in sections.items()})


# The family, as titan_hybrid/hf/families.py lists it.
FAMILY = Family(
    name="deepseek_v4", model_types=("deepseek_v4",),
    format_name="DeepSeek-V4",
    key_map=deepseek_v4_key_map,
    file_key_map=deepseek_v4_file_key_map,
    check=check_deepseek_v4_compatible,
    config=deepseek_v4_config,
    to_args=model_args_from_deepseek_v4_config,
    ties_embeddings=False,
    mtp_marker=lambda args: "mtp.0.e_proj.weight",
    mtp_count_field="num_nextn_predict_layers")

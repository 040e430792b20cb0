"""Hugging Face DeepSeek-V3 / V3.2 interop for models whose layers pair up as DeepSeek's
decoder layers: patterns `+-+-...` (DeepseekV3ForCausalLM) or `D-D-...` (DeepseekV32ForCausalLM)
with SwiGLU MLPs, then the same attention with MoE layers, and MTP depths. The key map of
`--checkpoint.initial_load_in_hf` / `--checkpoint.last_save_in_hf` for such models
(families.py picks it by the layer kinds), and config.json.

HF decoder layer j is our layers 2j (`input_layernorm`, `self_attn.*`: the MLA / DSA layer,
whose parameter names are transformers' already) and 2j + 1 (`post_attention_layernorm`,
`mlp.gate_proj` / `up_proj` = the halves of our fused fc1, `mlp.down_proj` = fc2; or the MoE
layer: `mlp.gate`, `mlp.shared_experts.*`, `mlp.experts.{e}.*`). What the format cannot hold
(another router, bracket groups, ...) is refused by name.
"""

from __future__ import annotations

import dataclasses

import torch

from titan_hybrid.hf.engine import KeyMap
from titan_hybrid.hf.family import Family
from titan_hybrid.hf.key_map_parts import ExpertSlice, SharedCopy
from titan_hybrid.hf.vocabulary import routed_experts, swiglu_mlp
from titan_hybrid.model.args import HybridModelArgs, MoEArgs
from titan_hybrid.model.dsa import KIND as DSA
from titan_hybrid.model.layer_kind import LayerKind
from titan_hybrid.model.layer_kinds import LAYER_KINDS
from titan_hybrid.model.mla import KIND as MLA
from titan_hybrid.model.mlp import KIND as MLP
from titan_hybrid.model.moe import KIND as MOE

# (architecture, model_type) of the decoder layer's attention kind: MLA or DSA, by kind name.
ARCHITECTURES = {MLA.name: ("DeepseekV3ForCausalLM", "deepseek_v3"),
                 DSA.name: ("DeepseekV32ForCausalLM", "deepseek_v32")}
ATTENTION_KINDS = [kind for kind in LAYER_KINDS.values() if kind.name in ARCHITECTURES]


def feed_forward_problems(args: HybridModelArgs, has_experts: bool, whose: str) -> list[str]:
    """What DeepSeek's MLP and MoE layers (Kimi Linear's too) cannot hold of the model's."""
    problems = []
    if args.mlp.activation != "swiglu":
        problems.append(f"mlp.activation='{args.mlp.activation}' must be 'swiglu'")
    experts = args.moe
    if has_experts and (
            (experts.activation, experts.score_func, experts.score_correction_bias)
            != ("swiglu", "sigmoid", True) or not experts.shared_expert_hidden_dim
            or experts.shared_expert_hidden_dim % experts.hidden_dim):
        problems.append(
            f"moe: activation={experts.activation!r}, score_func={experts.score_func!r}, "
            f"score_correction_bias={experts.score_correction_bias}, shared_expert_hidden_dim="
            f"{experts.shared_expert_hidden_dim}; {whose} MoE layers have SwiGLU experts, a "
            "sigmoid router with a choice bias and shared experts of the experts' width")
    return problems


def check_deepseek_compatible(args: HybridModelArgs) -> LayerKind:
    """The attention kind (MLA or DSA) of a model the format can hold; ValueError naming
    the first field it cannot."""
    pattern = args.parsed_pattern
    symbols = pattern.physical_layer_symbols()
    attention = LAYER_KINDS[symbols[0]] if symbols else None
    problems = []
    ffns = symbols[1::2]
    dense = ffns.count(MLP.symbol)
    if (attention is None or attention.name not in ARCHITECTURES or len(symbols) % 2
            or symbols[0::2] != [attention.symbol] * len(ffns)
            or ffns != [MLP.symbol] * dense + [MOE.symbol] * (len(ffns) - dense)):
        decoder_layers = " or ".join(f"'{kind.symbol}{MLP.symbol}'" for kind in ATTENTION_KINDS)
        problems.append(f"hybrid.pattern '{args.pattern}' must be {decoder_layers} repeated, "
                        f"then the same attention with MoE ('{MOE.symbol}') layers (DeepSeek's "
                        "dense decoder layers, then its MoE ones)")
    if any(isinstance(item, tuple) for item in pattern.main):
        problems.append(f"hybrid.pattern '{args.pattern}' has bracket groups")
    if pattern.mtp_depths and (len(pattern.mtp) != 2 or pattern.mtp[0] != attention.symbol
                               or pattern.mtp[1] not in (MLP.symbol, MOE.symbol)):
        problems.append(f"hybrid.pattern '{args.pattern}': DeepSeek's MTP layers are one "
                        "decoder layer a depth, its attention then an MLP or MoE")
    if attention is not None and attention.name in ARCHITECTURES and args.section(
            attention).output_gate:
        problems.append(f"{attention.name}.output_gate=True: DeepSeek's attention has no "
                        "output gate")
    problems += feed_forward_problems(args, MOE.symbol in ffns, "DeepSeek's")
    if problems:
        raise ValueError("model cannot use the HF DeepSeek-V3 / V3.2 format: " + "; ".join(problems))
    return attention


def mixer_parameter_names(args: HybridModelArgs, kind: LayerKind) -> list[str]:
    """The state-dict names of one `kind` mixer of the model's args (built on meta)."""
    with torch.device("meta"):
        layer = kind.build(args.section(kind), args.dim, args.norm_eps)
    return list(layer.state_dict())


def deepseek_key_map(args: HybridModelArgs) -> KeyMap:
    """HF key -> our key, one expert's slice of our experts' parameter, or a copy of a tensor
    our model shares; the gate / up halves of an MLP or expert map to our fc1 with a suffix _w
    / _v (the split state dict's components). No MLA / DSA parameter is fused: every HF tensor
    is one entry of ours under another key, so each rank writes or reads the pieces it holds
    under any TP / FSDP layout, nothing is gathered, and a load lands in the very entries
    `to_hf` handed out.

    MTP depth d is decoder layer L + d (L main ones), as in DeepSeek-V3's checkpoints (vLLM's
    and SGLang's names; transformers skips it): its enorm, hnorm and eh_proj, the decoder
    layer, shared_head.norm (our final norm), and copies of the embedding and of the head."""
    kind = check_deepseek_compatible(args)
    mapping: dict[str, str | ExpertSlice | SharedCopy] = {
        "model.embed_tokens.weight": "tok_embeddings.weight",
        "model.norm.weight": "norm.weight", "lm_head.weight": "output.weight"}
    attention_names = mixer_parameter_names(args, kind)
    pattern = args.parsed_pattern
    symbols = pattern.physical_layer_symbols()
    for j in range(len(symbols) // 2):
        mapping.update(_decoder_layer(args, kind, attention_names, f"model.layers.{j}.",
                                      f"layers.{2 * j}.", f"layers.{2 * j + 1}.",
                                      symbols[2 * j + 1]))
    for depth in range(pattern.mtp_depths):
        hf, ours = f"model.layers.{len(symbols) // 2 + depth}.", f"mtp.{depth}."
        mapping.update(_decoder_layer(args, kind, attention_names, hf, f"{ours}block.layers.0.",
                                      f"{ours}block.layers.1.", pattern.mtp[1]))
        for theirs, name in (("enorm", "embedding_norm"), ("hnorm", "hidden_norm"),
                             ("eh_proj", "eh_proj"), ("shared_head.norm", "final_norm")):
            mapping[f"{hf}{theirs}.weight"] = f"{ours}{name}.weight"
        mapping[f"{hf}embed_tokens.weight"] = SharedCopy("tok_embeddings.weight",
                                                         "model.embed_tokens.weight")
        mapping[f"{hf}shared_head.head.weight"] = SharedCopy("output.weight", "lm_head.weight")
    return mapping


def _decoder_layer(args: HybridModelArgs, kind: LayerKind, attention_names: list[str],
                   hf: str, mixer: str, ffn: str, ffn_symbol: str) -> dict:
    """The entries of HF decoder layer `hf`: our attention layer `mixer` and MLP / MoE `ffn`."""
    mapping: dict[str, str | ExpertSlice] = {
        hf + "input_layernorm.weight": f"{mixer}{kind.name}_norm.weight"}
    for parameter in attention_names:
        mapping[f"{hf}self_attn.{parameter}"] = f"{mixer}{kind.name}.{parameter}"
    ffn_kind = LAYER_KINDS[ffn_symbol].name
    mapping[hf + "post_attention_layernorm.weight"] = f"{ffn}{ffn_kind}_norm.weight"
    if ffn_symbol == MLP.symbol:
        return mapping | swiglu_mlp(hf + "mlp.", f"{ffn}mlp.")
    moe = f"{ffn}moe."
    mapping[hf + "mlp.gate.weight"] = moe + "router.gate.weight"
    mapping[hf + "mlp.gate.e_score_correction_bias"] = moe + "router.e_score_correction_bias"
    mapping.update(swiglu_mlp(hf + "mlp.shared_experts.", moe + "shared_expert."))
    return mapping | routed_experts(hf + "mlp.experts.", moe + "experts.", args.moe.num_experts)


def deepseek_config(args: HybridModelArgs) -> dict:
    """The config.json transformers' DeepseekV3ForCausalLM / DeepseekV32ForCausalLM needs."""
    kind = check_deepseek_compatible(args)
    architecture, model_type = ARCHITECTURES[kind.name]
    mla = args.section(kind)
    rope = {"rope_type": "default", "rope_theta": mla.rope_theta}
    if mla.yarn_factor != 1.0:
        rope.update(rope_type="yarn", factor=mla.yarn_factor,
                    original_max_position_embeddings=mla.yarn_original_max_position_embeddings,
                    beta_fast=mla.yarn_beta_fast, beta_slow=mla.yarn_beta_slow,
                    mscale=mla.yarn_mscale, mscale_all_dim=mla.yarn_mscale_all_dim)
    symbols = args.parsed_pattern.physical_layer_symbols()
    num_layers = len(symbols) // 2
    config = {
        "architectures": [architecture], "model_type": model_type,
        "vocab_size": args.vocab_size, "hidden_size": args.dim,
        "intermediate_size": args.mlp.hidden_dim, "num_hidden_layers": num_layers,
        "first_k_dense_replace": symbols[1::2].count(MLP.symbol),  # the dense layers first
        "num_attention_heads": mla.n_heads, "num_key_value_heads": mla.n_heads,
        "q_lora_rank": mla.q_lora_rank, "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim, "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim, "rms_norm_eps": args.norm_eps, "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len, "rope_parameters": rope,
        "attention_bias": False, "attention_dropout": 0.0,
        "num_nextn_predict_layers": args.parsed_pattern.mtp_depths,
    }
    if MOE.symbol in symbols:
        experts = args.moe
        config.update(
            n_routed_experts=experts.num_experts, num_experts_per_tok=experts.top_k,
            moe_intermediate_size=experts.hidden_dim,
            n_shared_experts=experts.shared_expert_hidden_dim // experts.hidden_dim,
            n_group=experts.n_group, topk_group=experts.topk_group,
            routed_scaling_factor=experts.routed_scaling_factor,
            norm_topk_prob=experts.normalizes_top_k)
    if kind is MLA:
        config["rope_interleave"] = mla.rope_interleave
    else:
        if not mla.rope_interleave:
            raise ValueError("dsa.rope_interleave=False: DeepSeek-V3.2 rotates interleaved pairs")
        config.update(index_n_heads=mla.index_n_heads, index_head_dim=mla.index_head_dim,
                      index_topk=mla.index_topk)
    return config


def model_args_from_deepseek_config(config: dict) -> HybridModelArgs:
    """HybridModelArgs for a DeepSeek-V3 / V3.2 config.json (MLA or DSA attention, SwiGLU
    MLPs in the first `first_k_dense_replace` layers, MoE layers after them); ValueError naming
    the first setting the format cannot hold."""
    num_layers = config["num_hidden_layers"]
    dense = min(config.get("first_k_dense_replace", num_layers), num_layers)
    if dense < num_layers and not config.get("n_routed_experts"):
        raise ValueError(f"first_k_dense_replace={dense} < num_hidden_layers={num_layers} "
                         "but n_routed_experts is not set")
    for field, expected in (("hidden_act", "silu"), ("attention_bias", False),
                            ("scoring_func", "sigmoid"),
                            ("topk_method", "noaux_tc")):
        if config.get(field, expected) != expected:
            raise ValueError(f"{field}={config[field]!r} is not supported (expected "
                             f"{expected!r})")
    heads = config["num_attention_heads"]
    if config.get("num_key_value_heads", heads) != heads:
        raise ValueError(f"num_key_value_heads={config['num_key_value_heads']} must equal "
                         f"num_attention_heads={heads} (MLA shares one latent per head)")
    rope = config.get("rope_parameters") or {"rope_type": "default",
                                             "rope_theta": config.get("rope_theta", 10000.0)}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"rope_parameters.rope_type={rope_type!r} is not supported "
                         "(default or yarn)")
    kind = DSA if config["model_type"] == "deepseek_v32" else MLA
    section = dict(n_heads=heads, q_lora_rank=config.get("q_lora_rank"),
                   kv_lora_rank=config["kv_lora_rank"],
                   qk_nope_head_dim=config["qk_nope_head_dim"],
                   qk_rope_head_dim=config["qk_rope_head_dim"],
                   v_head_dim=config["v_head_dim"], rope_theta=rope.get("rope_theta", 10000.0),
                   rope_interleave=config.get("rope_interleave", True))
    if rope_type == "yarn":
        section.update(yarn_factor=rope["factor"],
                       yarn_original_max_position_embeddings=rope[
                           "original_max_position_embeddings"],
                       yarn_beta_fast=rope.get("beta_fast", 32.0),
                       yarn_beta_slow=rope.get("beta_slow", 1.0),
                       yarn_mscale=rope.get("mscale", 1.0),
                       yarn_mscale_all_dim=rope.get("mscale_all_dim", 0.0))
    if kind is DSA:
        section.update(index_n_heads=config["index_n_heads"],
                       index_head_dim=config["index_head_dim"], index_topk=config["index_topk"])
    base = HybridModelArgs()
    experts = base.moe
    if dense < num_layers:
        experts = MoEArgs(
            num_experts=config["n_routed_experts"], top_k=config["num_experts_per_tok"],
            hidden_dim=config["moe_intermediate_size"],
            shared_expert_hidden_dim=config.get("n_shared_experts", 1)
            * config["moe_intermediate_size"],
            score_func="sigmoid", score_correction_bias=True,
            n_group=config.get("n_group", 1), topk_group=config.get("topk_group", 1),
            routed_scaling_factor=config.get("routed_scaling_factor", 1.0),
            norm_topk_prob=config.get("norm_topk_prob", True))
    main = (kind.symbol + MLP.symbol) * dense + (kind.symbol + MOE.symbol) * (num_layers - dense)
    # MTP depths: decoder layers after the main ones, MoE when the model's later layers are.
    mtp = f"/{kind.symbol}{MOE.symbol if MOE.symbol in main else MLP.symbol}" * (
        config.get("num_nextn_predict_layers") or 0)
    return dataclasses.replace(
        base, hf_format="deepseek", moe=experts,
        pattern=main + mtp,
        dim=config["hidden_size"],
        vocab_size=config["vocab_size"], norm_eps=config.get("rms_norm_eps", 1e-6),
        max_seq_len=config.get("max_position_embeddings", base.max_seq_len),
        mlp=dataclasses.replace(base.mlp, hidden_dim=config["intermediate_size"],
                                activation="swiglu"),
        **{kind.name: dataclasses.replace(base.section(kind), **section)})


# The family, as titan_hybrid/hf/families.py lists it.
FAMILY = Family(
    name="deepseek", model_types=("deepseek_v3", "deepseek_v32"),
    format_name="DeepSeek-V3 / V3.2",
    key_map=deepseek_key_map,
    check=check_deepseek_compatible,
    config=deepseek_config,
    to_args=model_args_from_deepseek_config,
    ties_embeddings=False,
    mtp_marker=lambda args: "model.layers.{}.eh_proj.weight".format(
        len(args.parsed_pattern.physical_layer_symbols()) // 2),
    mtp_count_field="num_nextn_predict_layers")

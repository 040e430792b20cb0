"""Hugging Face Ling 3.0 interop (`transformers`' `bailing_hybrid`: inclusionAI's Ling-3.0 tiny
and flash): KDA decoder layers with an MLA one every `layer_group_size`, each followed by a
dense SwiGLU MLP (the first `first_k_dense_replace`) or a DeepSeek-style MoE layer. Patterns of
`K` / `+` layers each followed by `-` or `E`.

HF decoder layer j is our layers 2j (`input_layernorm`, then `attention.*`) and 2j + 1
(`post_attention_layernorm`, `mlp.*`), named as Ling's checkpoints are (transformers reads them
under its own names and writes them back so): `model.word_embeddings`, `attention.dense` for
the output projection. Its KDA has full-rank gates (`kda.low_rank_gates = false`:
`f_proj`, `g_proj`), the bounded forget gate (`kda_safe_gate`: `kda.gate_lower_bound` =
`kda_lower_bound`), three q / k / v convolutions, and a sigmoid-gated output norm. Its MLA
(rotary pairs interleaved) has a sigmoid gate per head on its output (`mla.output_gate`,
`g_proj`). The MoE router is DeepSeek-V3's (sigmoid scores, `expert_bias` to choose, groups,
scaling, renormalised; shared experts), each expert one HF tensor per projection.

MTP (`num_mtp_layers`, transformers' `num_nextn_predict_layers`): depth d is decoder layer
L + d after the L main ones, as vLLM's Bailing MTP reads Ling's checkpoints (transformers skips
them): `enorm`, `hnorm`, `eh_proj` on [enorm(embedding) | hnorm(hidden state after the final
norm)], an MLA decoder layer with a MoE layer (`/+E`), and `final_layernorm` before the shared
head. A folder whose config declares MTP layers its weights lack imports without them.
"""

from __future__ import annotations

import dataclasses

from titan_hybrid.hf.deepseek import feed_forward_problems, mixer_parameter_names
from titan_hybrid.hf.engine import KeyMap
from titan_hybrid.hf.family import Family
from titan_hybrid.hf.kimi_linear import (
    DENSE,
    FULL,
    LINEAR,
    SPARSE,
    checked_layer_types,
    first_set,
    kda_mla_pattern,
    sigmoid_routed_experts,
)
from titan_hybrid.hf.vocabulary import routed_experts, swiglu_mlp
from titan_hybrid.model import kda as kda_kind
from titan_hybrid.model import mla as mla_kind
from titan_hybrid.model import mlp as mlp_kind
from titan_hybrid.model import moe as moe_kind
from titan_hybrid.model.args import HybridModelArgs

FORMAT = "bailing_hybrid"
NAME = "Ling 3.0 (bailing_hybrid)"
KDA, MLA, MLP, MOE = kda_kind.KIND, mla_kind.KIND, mlp_kind.KIND, moe_kind.KIND
MTP_LAYERS = [MLA.symbol, MOE.symbol]  # an MTP depth's decoder layer (vLLM's Bailing MTP)
# Our parameter -> Ling's, where the names differ (under `attention.`).
RENAMED = {"o_proj.weight": "dense.weight"}


def check_bailing_hybrid_compatible(args: HybridModelArgs) -> None:
    """ValueError naming the first field the format cannot hold."""
    pattern = args.parsed_pattern
    symbols = pattern.physical_layer_symbols(include_mtp=True)
    ffns = "".join(symbols[1::2])
    dense = len(ffns) - len(ffns.lstrip(MLP.symbol))
    problems = []
    if (not symbols or len(symbols) % 2
            or any(s not in (KDA.symbol, MLA.symbol) for s in symbols[0::2])
            or set(ffns[dense:]) - {MOE.symbol}
            or (pattern.mtp_depths and pattern.mtp != MTP_LAYERS)
            or any(isinstance(item, tuple) for item in pattern.main)):
        problems.append(f"hybrid.pattern '{args.pattern}' must be '{KDA.symbol}' / "
                        f"'{MLA.symbol}' layers each followed by '{MLP.symbol}' or, after the "
                        f"'{MLP.symbol}' ones, '{MOE.symbol}', without groups; its MTP depths "
                        f"'/{''.join(MTP_LAYERS)}'")
    if args.norm_zero_centered or args.post_norm_mixers:
        problems.append("norms must be pre-norms scaling by their weight")
    mla, kda = args.mla, args.kda
    if MLA.symbol in symbols and (not mla.rotary or not mla.rope_interleave
                                  or mla.yarn_factor != 1.0 or not mla.output_gate):
        problems.append("mla: Ling's MLA has interleaved RoPE without YaRN and an output gate "
                        "(rotary, rope_interleave, output_gate)")
    if KDA.symbol in symbols and (kda.low_rank_gates or kda.norm_eps not in (0.0, args.norm_eps)):
        problems.append(f"kda: low_rank_gates={kda.low_rank_gates}, norm_eps={kda.norm_eps}; "
                        "Ling's KDA has full-rank gates and the model's norm epsilon")
    if KDA.symbol in symbols and MLA.symbol in symbols and kda.n_heads != mla.n_heads:
        problems.append(f"kda.n_heads={kda.n_heads} must be mla.n_heads={mla.n_heads} (one "
                        "num_attention_heads)")
    problems += feed_forward_problems(args, MOE.symbol in ffns, "Ling's")
    if problems:
        raise ValueError(f"model cannot use the HF {NAME} format: " + "; ".join(problems))


def bailing_hybrid_key_map(args: HybridModelArgs) -> KeyMap:
    check_bailing_hybrid_compatible(args)
    mapping: KeyMap = {"model.word_embeddings.weight": "tok_embeddings.weight",
                       "model.norm.weight": "norm.weight", "lm_head.weight": "output.weight"}
    names = {kind.symbol: mixer_parameter_names(args, kind) for kind in (KDA, MLA)
             if kind in args.kinds()}
    pattern = args.parsed_pattern
    symbols = pattern.physical_layer_symbols()
    for j in range(len(symbols) // 2):
        mapping.update(decoder_layer(args, names, f"model.layers.{j}.", f"layers.{2 * j}.",
                                     f"layers.{2 * j + 1}.", symbols[2 * j:2 * j + 2]))
    for depth in range(pattern.mtp_depths):
        hf, ours = f"model.layers.{len(symbols) // 2 + depth}.", f"mtp.{depth}."
        mapping.update(decoder_layer(args, names, hf, f"{ours}block.layers.0.",
                                     f"{ours}block.layers.1.", MTP_LAYERS))
        for theirs, name in (("enorm", "embedding_norm"), ("hnorm", "hidden_norm"),
                             ("eh_proj", "eh_proj"), ("final_layernorm", "final_norm")):
            mapping[f"{hf}{theirs}.weight"] = f"{ours}{name}.weight"
    return mapping


def decoder_layer(args: HybridModelArgs, names: dict, hf: str, mixer: str, ffn: str,
                  symbols) -> KeyMap:
    """HF decoder layer `hf` (its attention and MLP / MoE) as our layers `mixer` and `ffn` of
    the two `symbols`; `names`: each mixer kind's parameter names."""
    kind = KDA if symbols[0] == KDA.symbol else MLA
    mapping: KeyMap = {hf + "input_layernorm.weight": f"{mixer}{kind.name}_norm.weight"}
    for parameter in names[kind.symbol]:
        mapping[f"{hf}attention.{RENAMED.get(parameter, parameter)}"] = (
            f"{mixer}{kind.name}.{parameter}")
    ffn_kind = MLP if symbols[1] == MLP.symbol else MOE
    mapping[hf + "post_attention_layernorm.weight"] = f"{ffn}{ffn_kind.name}_norm.weight"
    if ffn_kind is MLP:
        return mapping | swiglu_mlp(f"{hf}mlp.", f"{ffn}mlp.")
    theirs, moe = hf + "mlp.", f"{ffn}moe."
    mapping[theirs + "gate.weight"] = moe + "router.gate.weight"
    mapping[theirs + "gate.expert_bias"] = moe + "router.e_score_correction_bias"
    mapping.update(swiglu_mlp(f"{theirs}shared_experts.", f"{moe}shared_expert."))
    return mapping | routed_experts(f"{theirs}experts.", f"{moe}experts.", args.moe.num_experts)


def bailing_hybrid_config(args: HybridModelArgs) -> dict:
    """The config.json transformers' BailingHybridForCausalLM reads."""
    check_bailing_hybrid_compatible(args)
    symbols = args.parsed_pattern.physical_layer_symbols()
    mixers, ffns = symbols[0::2], symbols[1::2]
    mla, kda, experts = args.mla, args.kda, args.moe
    config = {
        "architectures": ["BailingHybridForCausalLM"], "model_type": FORMAT,
        "vocab_size": args.vocab_size, "hidden_size": args.dim,
        "intermediate_size": args.mlp.hidden_dim, "num_hidden_layers": len(mixers),
        "num_attention_heads": mla.n_heads if MLA.symbol in mixers else kda.n_heads,
        "num_key_value_heads": mla.n_heads if MLA.symbol in mixers else kda.n_heads,
        "q_lora_rank": mla.q_lora_rank, "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim, "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "rope_parameters": {"rope_type": "default", "rope_theta": mla.rope_theta},
        # head_dim is KDA's (transformers reads linear_head_dim from it)
        "head_dim": kda.head_dim, "short_conv_kernel_size": kda.conv_width,
        "kda_safe_gate": kda.gate_lower_bound < 0,
        "kda_lower_bound": kda.gate_lower_bound if kda.gate_lower_bound < 0 else -5.0,
        "layer_types": [LINEAR if s == KDA.symbol else FULL for s in mixers],
        "mlp_layer_types": [DENSE if s == MLP.symbol else SPARSE for s in ffns],
        "first_k_dense_replace": ffns.count(MLP.symbol),
        "rms_norm_eps": args.norm_eps, "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "num_mtp_layers": args.parsed_pattern.mtp_depths,
        # Ling's padding and end ids lie beyond a smaller vocabulary; the exported tokenizer's
        # files name its special tokens.
        "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
    }
    if MOE.symbol in ffns:
        config.update(
            num_experts=experts.num_experts, num_experts_per_tok=experts.top_k,
            moe_intermediate_size=experts.hidden_dim,
            n_shared_experts=experts.shared_expert_hidden_dim // experts.hidden_dim,
            n_group=experts.n_group, topk_group=experts.topk_group,
            routed_scaling_factor=experts.routed_scaling_factor,
            norm_topk_prob=experts.normalizes_top_k)
    return config


def model_args_from_bailing_hybrid_config(config: dict) -> HybridModelArgs:
    """HybridModelArgs for a Ling 3.0 config.json; ValueError naming the first setting the
    format cannot hold."""
    layers = config["num_hidden_layers"]
    group = config.get("layer_group_size", 6)
    mixers = config.get("layer_types") or [FULL if (i + 1) % group == 0 else LINEAR
                                           for i in range(layers)]
    ffns = config.get("mlp_layer_types") or [
        DENSE if i < config.get("first_k_dense_replace", 2) else SPARSE for i in range(layers)]
    checked_layer_types(config, mixers, ffns)
    if config.get("attention_bias", False):
        raise ValueError("attention_bias=True is not supported (expected False)")
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters.rope_type={rope['rope_type']!r} is not supported "
                         "(default)")
    heads = config["num_attention_heads"]
    base = HybridModelArgs()
    experts = (sigmoid_routed_experts(config, n_group=8, topk_group=4, routed_scaling_factor=2.5)
               if SPARSE in ffns else base.moe)
    pattern = kda_mla_pattern(mixers, ffns)
    depths = first_set(config, "num_nextn_predict_layers", "num_mtp_layers", default=0)
    pattern += f"/{''.join(MTP_LAYERS)}" * depths
    mla = dataclasses.replace(
        base.mla, n_heads=heads, q_lora_rank=config.get("q_lora_rank"),
        kv_lora_rank=config.get("kv_lora_rank", 512),
        qk_nope_head_dim=config.get("qk_nope_head_dim", 128),
        qk_rope_head_dim=config.get("qk_rope_head_dim", 64),
        v_head_dim=config.get("v_head_dim", 128),
        rope_theta=rope.get("rope_theta", config.get("rope_theta", 6_000_000.0)),
        rope_interleave=True, output_gate=True)
    kda = dataclasses.replace(
        base.kda, head_dim=first_set(config, "linear_head_dim", "head_dim", default=128),
        n_heads=heads, conv_width=config.get("short_conv_kernel_size", 4),
        low_rank_gates=False,
        gate_lower_bound=(config.get("kda_lower_bound", -5.0)
                          if config.get("kda_safe_gate", True) else 0.0))
    return dataclasses.replace(
        base, hf_format=FORMAT, pattern=pattern, moe=experts, mla=mla, kda=kda,
        dim=config["hidden_size"], vocab_size=config["vocab_size"],
        norm_eps=config.get("rms_norm_eps", 1e-6),
        max_seq_len=first_set(config, "max_position_embeddings", "model_max_length",
                              default=base.max_seq_len),
        mlp=dataclasses.replace(base.mlp, hidden_dim=config["intermediate_size"],
                                activation="swiglu"))


# The family, as titan_hybrid/hf/families.py lists it.
FAMILY = Family(
    name=FORMAT, model_types=(FORMAT,),
    format_name=NAME,
    key_map=bailing_hybrid_key_map,
    check=check_bailing_hybrid_compatible,
    config=bailing_hybrid_config,
    to_args=model_args_from_bailing_hybrid_config,
    mtp_marker=lambda args: "model.layers.{}.eh_proj.weight".format(
        len(args.parsed_pattern.physical_layer_symbols()) // 2),
    mtp_count_field="num_nextn_predict_layers")

"""Hugging Face Kimi Linear interop (`kimi_linear`: KimiLinearForCausalLM): KDA (`K`) and
MLA without position encoding (`+` with `mla.rotary=False`) decoder layers, each with a SwiGLU
MLP (`-`) or DeepSeek-style MoE (`E`), no MTP, no tied head. The key map, config.json and the
model args of one.

HF decoder layer j is our layers 2j (`input_layernorm`, `self_attn.*`) and 2j + 1
(`post_attention_layernorm`, then `mlp.gate_proj` / `up_proj` / `down_proj` (or under
`block_sparse_moe.` in a folder transformers saved), or the MoE's
`block_sparse_moe.gate`, `.experts.{e}.w1` / `w3` / `w2` and `.shared_experts.*`): the names of
Kimi's checkpoints, which transformers' conversion mapping reads (it fuses the three convs and
the experts in memory; our KDA layer holds Kimi's names already, and its A_log is [heads] where
the checkpoint's is [1, 1, heads, 1]). Which layers are KDA and which are dense follows the
config's `linear_attn_config` (1-based `kda_layers` / `full_attn_layers`) or `layer_types`, and
`mlp_layer_types` or `first_k_dense_replace`.
"""

from __future__ import annotations

import dataclasses

from titan_hybrid.hf.deepseek import feed_forward_problems, mixer_parameter_names
from titan_hybrid.hf.engine import KeyMap, Shapes
from titan_hybrid.hf.family import Family
from titan_hybrid.hf.key_map_parts import Reshaped
from titan_hybrid.hf.vocabulary import routed_experts, swiglu_mlp
from titan_hybrid.model.args import HybridModelArgs, MoEArgs
from titan_hybrid.model.kda import KIND as KDA
from titan_hybrid.model.mla import KIND as MLA
from titan_hybrid.model.mlp import KIND as MLP
from titan_hybrid.model.moe import KIND as MOE

NAME = "Kimi Linear"
LINEAR, FULL = "linear_attention", "full_attention"  # transformers' layer_types words
DENSE, SPARSE = "dense", "sparse"  # ... and mlp_layer_types'


def check_kimi_linear_compatible(args: HybridModelArgs) -> None:
    """ValueError naming the first field the format cannot hold."""
    pattern = args.parsed_pattern
    symbols = pattern.physical_layer_symbols()
    problems = []
    if (len(symbols) % 2 or any(s not in (KDA.symbol, MLA.symbol) for s in symbols[0::2])
            or any(s not in (MLP.symbol, MOE.symbol) for s in symbols[1::2])):
        problems.append(f"hybrid.pattern '{args.pattern}' must be decoder layers of '"
                        f"{KDA.symbol}' or '{MLA.symbol}' each followed by '{MLP.symbol}' or "
                        f"'{MOE.symbol}'")
    if any(isinstance(item, tuple) for item in pattern.main) or pattern.mtp_depths:
        problems.append(f"hybrid.pattern '{args.pattern}' has bracket groups or MTP depths")
    if MLA.symbol in symbols and (args.mla.rotary or args.mla.yarn_factor != 1.0
                                  or args.mla.output_gate):
        problems.append("mla.rotary=True or mla.output_gate=True: Kimi Linear's MLA has no "
                        "position encoding and no output gate")
    kda = args.kda
    if KDA.symbol in symbols and (not kda.low_rank_gates or kda.gate_lower_bound
                                  or kda.norm_eps not in (0.0, args.norm_eps)):
        problems.append(f"kda: low_rank_gates={kda.low_rank_gates}, gate_lower_bound="
                        f"{kda.gate_lower_bound}, norm_eps={kda.norm_eps}; Kimi Linear's KDA "
                        "has low-rank gates, no bound and the model's norm epsilon")
    problems += feed_forward_problems(args, MOE.symbol in symbols, "Kimi Linear's")
    if problems:
        raise ValueError(f"model cannot use the HF {NAME} format: " + "; ".join(problems))


def kimi_linear_key_map(args: HybridModelArgs, dense: str = "mlp.") -> KeyMap:
    """HF key -> ours (every HF tensor one entry of ours, one expert's slice, or A_log's view,
    as DeepSeek's); `dense`: the dense MLPs' prefix, `mlp.` in Kimi's checkpoints and an
    export (transformers' save_pretrained writes them under `block_sparse_moe.`, reversing its
    rename of every layer's)."""
    check_kimi_linear_compatible(args)
    mapping: KeyMap = {"model.embed_tokens.weight": "tok_embeddings.weight",
                     "model.norm.weight": "norm.weight", "lm_head.weight": "output.weight"}
    names = {kind.symbol: mixer_parameter_names(args, kind) for kind in (KDA, MLA)
             if kind in args.kinds()}
    symbols = args.parsed_pattern.physical_layer_symbols()
    for j in range(len(symbols) // 2):
        hf, mixer, ffn = f"model.layers.{j}.", f"layers.{2 * j}.", f"layers.{2 * j + 1}."
        kind = KDA if symbols[2 * j] == KDA.symbol else MLA
        mapping[hf + "input_layernorm.weight"] = f"{mixer}{kind.name}_norm.weight"
        for parameter in names[kind.symbol]:
            ours = f"{mixer}{kind.name}.{parameter}"
            mapping[f"{hf}self_attn.{parameter}"] = (
                Reshaped(ours, (1, 1, args.kda.n_heads, 1)) if kind is KDA
                and parameter == "A_log" else ours)
        ffn_kind = MLP if symbols[2 * j + 1] == MLP.symbol else MOE
        mapping[hf + "post_attention_layernorm.weight"] = f"{ffn}{ffn_kind.name}_norm.weight"
        if ffn_kind is MLP:
            mapping.update(swiglu_mlp(f"{hf}{dense}", f"{ffn}mlp."))
            continue
        theirs, moe = hf + "block_sparse_moe.", f"{ffn}moe."
        mapping[theirs + "gate.weight"] = moe + "router.gate.weight"
        mapping[theirs + "gate.e_score_correction_bias"] = moe + "router.e_score_correction_bias"
        mapping.update(swiglu_mlp(f"{theirs}shared_experts.", f"{moe}shared_expert."))
        mapping.update(routed_experts(f"{theirs}experts.", f"{moe}experts.",
                                      args.moe.num_experts, names=("w1", "w3", "w2")))
    return mapping


def kimi_linear_file_key_map(args: HybridModelArgs, stored: Shapes) -> KeyMap:
    """The key map of a file whose tensors are `stored`: a folder transformers saved names
    its dense MLPs as its MoE layers."""
    saved_by_transformers = any(key.endswith("block_sparse_moe.gate_proj.weight")
                                for key in stored)
    return kimi_linear_key_map(args, "block_sparse_moe." if saved_by_transformers else "mlp.")


def kimi_linear_config(args: HybridModelArgs) -> dict:
    """The config.json transformers' KimiLinearForCausalLM reads (Kimi's own field names)."""
    check_kimi_linear_compatible(args)
    symbols = args.parsed_pattern.physical_layer_symbols()
    mixers, ffns = symbols[0::2], symbols[1::2]
    mla, kda = args.mla, args.kda
    config = {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
        "vocab_size": args.vocab_size, "hidden_size": args.dim,
        "intermediate_size": args.mlp.hidden_dim, "num_hidden_layers": len(mixers),
        "num_attention_heads": mla.n_heads, "num_key_value_heads": mla.n_heads,
        "q_lora_rank": mla.q_lora_rank, "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim, "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim, "rms_norm_eps": args.norm_eps, "hidden_act": "silu",
        "model_max_length": args.max_seq_len,
        # Kimi's padding token is its vocabulary's last (163839 of 163840); transformers'
        # default, that very number, would be out of a smaller vocabulary
        "pad_token_id": args.vocab_size - 1,
        "linear_attn_config": {
            "num_heads": kda.n_heads, "head_dim": kda.head_dim,
            "short_conv_kernel_size": kda.conv_width,
            "kda_layers": [i + 1 for i, s in enumerate(mixers) if s == KDA.symbol],
            "full_attn_layers": [i + 1 for i, s in enumerate(mixers) if s == MLA.symbol]},
        "mlp_layer_types": [DENSE if s == MLP.symbol else SPARSE for s in ffns],
    }
    if MOE.symbol in ffns:
        experts = args.moe
        config.update(
            num_experts=experts.num_experts, num_experts_per_token=experts.top_k,
            moe_intermediate_size=experts.hidden_dim,
            num_shared_experts=experts.shared_expert_hidden_dim // experts.hidden_dim,
            num_expert_group=experts.n_group, topk_group=experts.topk_group,
            routed_scaling_factor=experts.routed_scaling_factor,
            moe_renormalize=experts.normalizes_top_k)
    return config


def first_set(config: dict, *names, default=None):
    """The value of the first of `names` (a field and transformers' aliases of it) set."""
    return next((config[name] for name in names if config.get(name) is not None), default)


def checked_layer_types(config: dict, mixers: list[str], ffns: list[str]) -> None:
    """ValueError unless every layer has a mixer (LINEAR, FULL) and a feed-forward (DENSE,
    SPARSE), MLA's heads each have their latent, and the activation is SiLU."""
    layers = config["num_hidden_layers"]
    for field, values, allowed in (("layer_types", mixers, (LINEAR, FULL)),
                                   ("mlp_layer_types", ffns, (DENSE, SPARSE))):
        if len(values) != layers or any(value not in allowed for value in values):
            raise ValueError(f"{field}={values} must give each of the {layers} layers one of "
                             f"{allowed}")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={config['hidden_act']!r} is not supported (expected "
                         "'silu')")
    heads = config["num_attention_heads"]
    if first_set(config, "num_key_value_heads", default=heads) != heads:
        raise ValueError(f"num_key_value_heads={config['num_key_value_heads']} must equal "
                         f"num_attention_heads={heads} (MLA shares one latent per head)")


def sigmoid_routed_experts(config: dict, *, n_group: int, topk_group: int,
                           routed_scaling_factor: float) -> MoEArgs:
    """DeepSeek-V3's MoE layers (sigmoid scores, a choice bias, groups, scaling, shared
    experts) as Kimi Linear's and Ling 3.0's configs give them, under either family's field
    names; the keywords: the family's defaults."""
    hidden = config["moe_intermediate_size"]
    return MoEArgs(
        num_experts=first_set(config, "num_experts", "num_local_experts"),
        top_k=first_set(config, "num_experts_per_token", "num_experts_per_tok"),
        hidden_dim=hidden,
        shared_expert_hidden_dim=first_set(config, "num_shared_experts", "n_shared_experts",
                                           default=1) * hidden,
        score_func="sigmoid", score_correction_bias=True,
        n_group=first_set(config, "num_expert_group", "n_group", default=n_group),
        topk_group=first_set(config, "topk_group", default=topk_group),
        routed_scaling_factor=first_set(config, "routed_scaling_factor",
                                        default=routed_scaling_factor),
        norm_topk_prob=first_set(config, "moe_renormalize", "norm_topk_prob", default=True))


def kda_mla_pattern(mixers: list[str], ffns: list[str]) -> str:
    """The main pattern of these layer types: `K` / `+` layers each followed by `-` / `E`."""
    return "".join((KDA.symbol if mixer == LINEAR else MLA.symbol)
                   + (MLP.symbol if ffn == DENSE else MOE.symbol)
                   for mixer, ffn in zip(mixers, ffns))


def model_args_from_kimi_linear_config(config: dict) -> HybridModelArgs:
    """HybridModelArgs for a Kimi Linear config.json; ValueError naming the first setting the
    format cannot hold."""
    layers = config["num_hidden_layers"]
    linear = config.get("linear_attn_config") or {}
    mixers = config.get("layer_types")
    if mixers is None and "kda_layers" in linear and "full_attn_layers" in linear:
        mixers = [None] * layers
        for layer in linear["full_attn_layers"]:
            mixers[layer - 1] = FULL
        for layer in linear["kda_layers"]:
            mixers[layer - 1] = LINEAR
    if mixers is None:  # transformers' default: full attention every fourth layer from 4
        mixers = [FULL if i and i % 4 == 0 else LINEAR for i in range(layers)]
    ffns = config.get("mlp_layer_types") or [
        DENSE if i < config.get("first_k_dense_replace", 1) else SPARSE for i in range(layers)]
    checked_layer_types(config, mixers, ffns)
    heads = config["num_attention_heads"]
    base = HybridModelArgs()
    experts = (sigmoid_routed_experts(config, n_group=1, topk_group=1,
                                      routed_scaling_factor=2.446)
               if SPARSE in ffns else base.moe)
    pattern = kda_mla_pattern(mixers, ffns)
    mla = dataclasses.replace(
        base.mla, n_heads=heads, q_lora_rank=config.get("q_lora_rank"),
        kv_lora_rank=config["kv_lora_rank"], qk_nope_head_dim=config["qk_nope_head_dim"],
        qk_rope_head_dim=config["qk_rope_head_dim"], v_head_dim=config["v_head_dim"],
        rotary=False)
    kda = dataclasses.replace(
        base.kda, head_dim=first_set(linear, "head_dim", default=config.get("linear_head_dim", 128)),
        n_heads=first_set(linear, "num_heads", default=config.get("linear_num_heads", 32)),
        conv_width=first_set(linear, "short_conv_kernel_size",
                             default=config.get("linear_conv_kernel_dim", 4)))
    return dataclasses.replace(
        base, hf_format="kimi_linear", pattern=pattern, moe=experts, mla=mla, kda=kda,
        dim=config["hidden_size"], vocab_size=config["vocab_size"],
        norm_eps=config.get("rms_norm_eps", 1e-5),
        max_seq_len=first_set(config, "model_max_length", "max_position_embeddings",
                              default=base.max_seq_len),
        mlp=dataclasses.replace(base.mlp, hidden_dim=config["intermediate_size"],
                                activation="swiglu"))


# The family, as titan_hybrid/hf/families.py lists it.
FAMILY = Family(
    name="kimi_linear", model_types=("kimi_linear",),
    format_name=NAME,
    key_map=kimi_linear_key_map,
    file_key_map=kimi_linear_file_key_map,
    check=check_kimi_linear_compatible,
    config=kimi_linear_config,
    to_args=model_args_from_kimi_linear_config,
    ties_embeddings=False)

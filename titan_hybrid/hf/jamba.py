"""Hugging Face Jamba interop (`transformers`' `jamba`: AI21's Jamba v0.1, Jamba 1.5 / 1.6 / 1.7
Mini and Large, Jamba Reasoning 3B): decoder layers of a Mamba1 mixer or a GQA attention
without RoPE, each followed by a SwiGLU MLP or a MoE layer. Patterns of `M` / `*` each
followed by `-` / `E`, with `m_layers = "mamba1"` and Jamba's weighted dt / B / C norms.

HF decoder layer j is our layers 2j (`input_layernorm`, then `mamba.*`, transformers' Mamba1
names, or `self_attn.*`) and 2j + 1 (`pre_ff_layernorm`, then `feed_forward.*`); the final
norm is `final_layernorm`. Jamba says where attention and MoE layers go by periods: layer j is
attention when j % attn_layer_period == attn_layer_offset, MoE when j % expert_layer_period ==
expert_layer_offset. An export finds the periods of the pattern's layers, and a pattern that
has none is refused by name. The router is a softmax over all experts whose top-k weights are
not renormalised (our softmax router's default), `router.weight`; the experts are one tensor
per projection and expert (as transformers writes them), MLP and experts both
`intermediate_size` wide; `router_aux_loss_coef` is the balance loss's coefficient. The mixer's
norms take the model's `rms_norm_eps`; in / out projection biases (`mamba_proj_bias`) and
another activation are refused by name.
"""

from __future__ import annotations

import dataclasses
import math

from titan_hybrid.hf.engine import KeyMap
from titan_hybrid.hf.family import Family
from titan_hybrid.hf.key_map_parts import attention_problems
from titan_hybrid.hf.mamba import mamba1_entries
from titan_hybrid.hf.vocabulary import llama_attention, routed_experts, swiglu_mlp
from titan_hybrid.model import attention, mamba1, mlp, moe
from titan_hybrid.model.args import AttentionArgs, HybridModelArgs, MLPArgs, MoEArgs

FORMAT = "jamba"
NAME = "Jamba"
MIXERS = (mamba1.KIND.symbol, attention.KIND.symbol)
FFNS = (mlp.KIND.symbol, moe.KIND.symbol)
FIXED = (("hidden_act", "silu"), ("mamba_conv_bias", True), ("mamba_proj_bias", False))
ATTENTION = dict(use_rope=False, qk_norm=False, output_gate=False, softmax_scale=None)


def period_of(flags: list[bool]) -> tuple[int, int] | None:
    """(period, offset) with offset < period such that flags[j] == (j % period == offset) for
    every j, the shortest such period; None when there is none. No flag set: len + 1, len."""
    count = len(flags)
    if not any(flags):
        return count + 1, count
    for period in range(1, count + 1):
        offset = flags.index(True) % period
        if all(flag == (j % period == offset) for j, flag in enumerate(flags)):
            return period, offset
    return None


def check_jamba_compatible(args: HybridModelArgs) -> None:
    """ValueError naming the first field the HF Jamba format cannot hold."""
    pattern = args.parsed_pattern
    symbols = pattern.physical_layer_symbols()
    problems = []
    if (not symbols or len(symbols) % 2 or any(s not in MIXERS for s in symbols[0::2])
            or any(s not in FFNS for s in symbols[1::2])
            or any(isinstance(item, tuple) for item in pattern.main) or pattern.mtp_depths):
        problems.append(f"hybrid.pattern '{args.pattern}' must be 'M' / '*' layers each "
                        "followed by an MLP ('-') or a MoE layer ('E'), without groups or MTP")
    else:
        for what, symbol, where in (("attention", attention.KIND.symbol, symbols[0::2]),
                                    ("MoE", moe.KIND.symbol, symbols[1::2])):
            if period_of([s == symbol for s in where]) is None:
                problems.append(f"hybrid.pattern '{args.pattern}': its {what} layers do not "
                                "recur with one period, which is how Jamba places them")
    if mamba1.KIND.symbol in symbols and (args.m_layers != mamba1.KIND.name
                                          or args.mamba1.dt_bc_norm != "weighted"):
        problems.append(f"m_layers='{args.m_layers}', mamba1.dt_bc_norm="
                        f"'{args.mamba1.dt_bc_norm}': Jamba's 'M' layers are Mamba1 "
                        "(m_layers 'mamba1') with weighted dt / B / C norms")
    if args.norm_zero_centered or args.post_norm_mixers or args.mlp.activation != "swiglu":
        problems.append("norms must be pre-norms scaling by their weight and the MLP must be "
                        "SwiGLU")
    if attention.KIND.symbol in symbols:
        problems += attention_problems(args, ATTENTION, NAME, whole_heads=True)
    experts = args.moe
    if moe.KIND.symbol in symbols and (
            experts.activation, experts.score_func, experts.normalizes_top_k,
            experts.score_correction_bias, experts.n_group, experts.routed_scaling_factor,
            experts.shared_expert_hidden_dim, experts.latent_dim, experts.hash_layers,
            experts.hidden_dim) != ("swiglu", "softmax", False, False, 1, 1.0, 0, 0, 0,
                                    args.mlp.hidden_dim):
        problems.append("moe: Jamba's MoE layers have SwiGLU experts as wide as its MLPs "
                        f"(moe.hidden_dim = mlp.hidden_dim = {args.mlp.hidden_dim}), a softmax "
                        "router without renormalisation, bias, groups or scaling, and no "
                        "shared, latent or hash-routed experts")
    if problems:
        raise ValueError(f"model cannot use the HF {NAME} format: " + "; ".join(problems))


def jamba_key_map(args: HybridModelArgs) -> KeyMap:
    check_jamba_compatible(args)
    mapping: KeyMap = {"model.embed_tokens.weight": "tok_embeddings.weight",
                       "model.final_layernorm.weight": "norm.weight",
                       "lm_head.weight": "output.weight"}
    symbols = args.parsed_pattern.physical_layer_symbols()
    for j in range(len(symbols) // 2):
        hf, mixer, ffn = f"model.layers.{j}.", f"layers.{2 * j}.", f"layers.{2 * j + 1}."
        if symbols[2 * j] == attention.KIND.symbol:
            mapping[f"{hf}input_layernorm.weight"] = f"{mixer}attention_norm.weight"
            mapping.update(llama_attention(f"{hf}self_attn.", f"{mixer}attention.",
                                           qk_norm=False))
        else:
            mapping[f"{hf}input_layernorm.weight"] = f"{mixer}mamba1_norm.weight"
            mapping.update(mamba1_entries(f"{hf}mamba.", f"{mixer}mamba1.",
                                          mamba1.PARAMETERS + mamba1.WEIGHTED_NORMS))
        if symbols[2 * j + 1] == mlp.KIND.symbol:
            mapping[f"{hf}pre_ff_layernorm.weight"] = f"{ffn}mlp_norm.weight"
            mapping.update(swiglu_mlp(f"{hf}feed_forward.", f"{ffn}mlp."))
        else:
            mapping[f"{hf}pre_ff_layernorm.weight"] = f"{ffn}moe_norm.weight"
            mapping[f"{hf}feed_forward.router.weight"] = f"{ffn}moe.router.gate.weight"
            mapping.update(routed_experts(f"{hf}feed_forward.experts.", f"{ffn}moe.experts.",
                                          args.moe.num_experts))
    return mapping


def jamba_config(args: HybridModelArgs) -> dict:
    """The config.json a `transformers` JambaForCausalLM needs."""
    check_jamba_compatible(args)
    symbols = args.parsed_pattern.physical_layer_symbols()
    attn_period, attn_offset = period_of([s == attention.KIND.symbol for s in symbols[0::2]])
    expert_period, expert_offset = period_of([s == moe.KIND.symbol for s in symbols[1::2]])
    heads, ssm = args.attention, args.mamba1
    return {
        "architectures": ["JambaForCausalLM"], "model_type": FORMAT,
        "vocab_size": args.vocab_size, "hidden_size": args.dim,
        "intermediate_size": args.mlp.hidden_dim, "num_hidden_layers": len(symbols) // 2,
        "num_attention_heads": heads.n_heads, "num_key_value_heads": heads.n_kv_heads,
        "rms_norm_eps": args.norm_eps, "max_position_embeddings": args.max_seq_len,
        "attn_layer_period": attn_period, "attn_layer_offset": attn_offset,
        "expert_layer_period": expert_period, "expert_layer_offset": expert_offset,
        "num_experts": args.moe.num_experts, "num_experts_per_tok": args.moe.top_k,
        "router_aux_loss_coef": args.moe.aux_loss_coeff,
        "mamba_d_state": ssm.d_state, "mamba_d_conv": ssm.conv_width,
        "mamba_expand": ssm.expand, "mamba_dt_rank": ssm.rank(args.dim), **dict(FIXED),
    }


def model_args_from_jamba_config(config: dict) -> HybridModelArgs:
    """HybridModelArgs for an HF Jamba config.json; ValueError naming the first setting the
    format cannot hold."""
    for name, expected in FIXED:
        if config.get(name, expected) != expected:
            raise ValueError(f"{name}={config[name]!r} is not supported (expected "
                             f"{expected!r})")
    dim, heads = config["hidden_size"], config["num_attention_heads"]
    layers, experts = config["num_hidden_layers"], config.get("num_experts", 16)
    attn_period, attn_offset = (config.get("attn_layer_period", 8),
                                config.get("attn_layer_offset", 4))
    expert_period, expert_offset = (config.get("expert_layer_period", 2),
                                    config.get("expert_layer_offset", 1))
    pattern = "".join(
        (attention.KIND.symbol if j % attn_period == attn_offset else mamba1.KIND.symbol)
        + (moe.KIND.symbol if experts > 1 and j % expert_period == expert_offset
           else mlp.KIND.symbol)
        for j in range(layers))
    rank = config.get("mamba_dt_rank", "auto")
    width = config.get("intermediate_size", 14336)
    base = HybridModelArgs()
    return dataclasses.replace(
        base, hf_format=FORMAT, m_layers=mamba1.KIND.name, pattern=pattern, dim=dim,
        vocab_size=config["vocab_size"], norm_eps=config.get("rms_norm_eps", 1e-6),
        max_seq_len=config.get("max_position_embeddings", base.max_seq_len),
        attention=AttentionArgs(
            n_heads=heads, n_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=dim // heads, **ATTENTION),
        mamba1=mamba1.Mamba1Args(
            d_state=config.get("mamba_d_state", 16), expand=config.get("mamba_expand", 2),
            conv_width=config.get("mamba_d_conv", 4),
            dt_rank=math.ceil(dim / 16) if rank == "auto" else rank, dt_bc_norm="weighted"),
        mlp=MLPArgs(hidden_dim=width, activation="swiglu"),
        moe=MoEArgs(num_experts=max(experts, 1), top_k=config.get("num_experts_per_tok", 2),
                    hidden_dim=width, score_func="softmax", norm_topk_prob=False,
                    aux_loss_coeff=config.get("router_aux_loss_coef", 0.001)))


# The family, as titan_hybrid/hf/families.py lists it.
FAMILY = Family(
    name=FORMAT, model_types=(FORMAT,), format_name=NAME,
    key_map=jamba_key_map,
    check=check_jamba_compatible,
    config=jamba_config,
    to_args=model_args_from_jamba_config,
    ties=lambda config: bool(config.get("tie_word_embeddings", False)),
    variants=(mamba1.KIND.name,))

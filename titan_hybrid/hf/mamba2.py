"""Hugging Face Mamba2 interop (`transformers`' `mamba2`: mamba2-130m to 2.7b as transformers
writes them, Mamba-Codestral-7B): Mamba2 layers only, a pattern of `M`s. The tensors are named
as Nemotron-H's Mamba2 layers (`backbone.layers.N.mixer.*`, `backbone.embeddings`,
`backbone.norm_f`), whose key map this one is.

The config read is transformers' Mamba2Config (`model_type: "mamba2"`). mamba_ssm's own
config.json (`d_model`, `n_layer`, `ssm_cfg`, no model_type), which the state-spaces/mamba2-*
repositories hold, is refused by name (families.py): its tensors are named otherwise
(`backbone.embedding`). `residual_in_fp32` keeps the residual stream in fp32 under a
half-precision model; here the stream's precision is the training's
(`training.mixed_precision_param`), so the field is read and written but computes nothing of
its own.
"""

from __future__ import annotations

import dataclasses

from titan_hybrid.hf.engine import KeyMap
from titan_hybrid.hf.family import Family
from titan_hybrid.hf.key_map_parts import tagged_float, time_step_limit
from titan_hybrid.hf.nemotron_h import layer_entries, physical_layer_prefixes
from titan_hybrid.model import mamba
from titan_hybrid.model.args import HybridModelArgs, MambaArgs

FORMAT = "mamba2"
NAME = "Mamba2"
# Settings of Mamba2Config that must have these values (the others are read).
FIXED = (("hidden_act", "silu"), ("use_bias", False), ("use_conv_bias", True))
# mamba_ssm's own config.json: fields that say a folder holds one (families.py refuses it).
MAMBA_SSM_FIELDS = ("d_model", "ssm_cfg")


def check_mamba2_compatible(args: HybridModelArgs) -> None:
    """ValueError naming the first field the HF Mamba2 format cannot represent."""
    pattern = args.parsed_pattern
    problems = []
    if (set(pattern.physical_layer_symbols(include_mtp=True)) != {mamba.KIND.symbol}
            or pattern.mtp_depths or any(isinstance(item, tuple) for item in pattern.main)):
        problems.append(f"hybrid.pattern '{args.pattern}' must be Mamba2 layers ('M') only, "
                        "without groups or MTP depths")
    if args.norm_zero_centered or args.post_norm_mixers:
        problems.append("norms must be pre-norms scaling by their weight")
    if args.mamba.num_heads and args.mamba.num_heads * args.mamba.head_dim != (
            args.mamba.expand * args.dim):
        problems.append(f"mamba.num_heads={args.mamba.num_heads}: Mamba2's width is "
                        "expand * dim")
    if problems:
        raise ValueError(f"model cannot use the HF {NAME} format: " + "; ".join(problems))


def mamba2_key_map(args: HybridModelArgs) -> KeyMap:
    check_mamba2_compatible(args)
    mapping: KeyMap = {"backbone.embeddings.weight": "tok_embeddings.weight",
                       "backbone.norm_f.weight": "norm.weight",
                       "lm_head.weight": "output.weight"}
    for number, (prefix, kind) in enumerate(physical_layer_prefixes(args)):
        mapping.update(layer_entries(args, f"backbone.layers.{number}.", prefix, kind))
    return mapping


def mamba2_config(args: HybridModelArgs) -> dict:
    """The config.json a `transformers` Mamba2ForCausalLM needs."""
    check_mamba2_compatible(args)
    ssm = args.mamba
    low, high = ssm.dt_limit
    return {
        "architectures": ["Mamba2ForCausalLM"], "model_type": FORMAT,
        "vocab_size": args.vocab_size, "hidden_size": args.dim,
        "num_hidden_layers": len(args.parsed_pattern.physical_layer_symbols()),
        "layer_norm_epsilon": args.norm_eps, "state_size": ssm.d_state,
        "num_heads": args.mamba_n_heads, "head_dim": ssm.head_dim, "expand": ssm.expand,
        "n_groups": ssm.n_groups, "conv_kernel": ssm.conv_width, "chunk_size": ssm.chunk_size,
        "time_step_min": ssm.dt_min, "time_step_max": ssm.dt_max,
        "time_step_floor": ssm.dt_init_floor,
        "time_step_limit": [tagged_float(low), tagged_float(high)],
        **dict(FIXED), "residual_in_fp32": True,
    }


def model_args_from_mamba2_config(config: dict) -> HybridModelArgs:
    """HybridModelArgs for an HF Mamba2 config.json; ValueError naming the first setting the
    format cannot hold."""
    for name, expected in FIXED:
        if config.get(name, expected) != expected:
            raise ValueError(f"{name}={config[name]!r} is not supported (expected "
                             f"{expected!r})")
    dim, expand = config["hidden_size"], config.get("expand", 2)
    heads, head_dim = config.get("num_heads", 128), config.get("head_dim", 64)
    if heads * head_dim != expand * dim:
        raise ValueError(f"num_heads * head_dim = {heads * head_dim} must be hidden_size * "
                         f"expand = {expand * dim}")
    low, high = time_step_limit(config)
    base = HybridModelArgs()
    return dataclasses.replace(
        base, hf_format=FORMAT, pattern=mamba.KIND.symbol * config["num_hidden_layers"],
        dim=dim, vocab_size=config["vocab_size"],
        norm_eps=config.get("layer_norm_epsilon", 1e-5),
        mamba=MambaArgs(d_state=config.get("state_size", 128),
                        head_dim=head_dim, n_groups=config.get("n_groups", 8), expand=expand,
                        conv_width=config.get("conv_kernel", 4),
                        chunk_size=config.get("chunk_size", 256),
                        dt_min=config.get("time_step_min", 1e-3),
                        dt_max=config.get("time_step_max", 0.1),
                        dt_init_floor=config.get("time_step_floor", 1e-4),
                        dt_limit=(low, high)))


# The family, as titan_hybrid/hf/families.py lists it.
FAMILY = Family(
    name=FORMAT, model_types=(FORMAT,),
    format_name=NAME,
    key_map=mamba2_key_map,
    check=check_mamba2_compatible,
    config=mamba2_config,
    to_args=model_args_from_mamba2_config)

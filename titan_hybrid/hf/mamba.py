"""Hugging Face Mamba and Falcon-Mamba interop (`transformers`' `mamba`: the original Mamba
checkpoints, 130m to 2.8b as transformers writes them; `falcon_mamba`: Falcon-Mamba-7B): Mamba1
layers only, a pattern of `M`s with `m_layers = "mamba1"` (model/mamba1.py).

The tensors are `backbone.embeddings`, `backbone.layers.N.norm` and `.mixer.*` (transformers'
MambaMixer names, which the Mamba1 mixer keeps), `backbone.norm_f` and `lm_head`. Falcon-Mamba's
mixer has weightless RMS norms of dt, B and C (`mamba1.dt_bc_norm = "weightless"`, epsilon
`mixer_rms_eps`). The LM head is tied to the embedding unless the config says otherwise.
`residual_in_fp32` is read and written, the residual's precision being the training's; biases
(`use_bias`, no `use_conv_bias`) and another activation are refused by name.
"""

from __future__ import annotations

import dataclasses

from titan_hybrid.hf.engine import KeyMap
from titan_hybrid.hf.family import Family
from titan_hybrid.model import mamba1
from titan_hybrid.model.args import HybridModelArgs

FORMAT = "mamba"
NAME = "Mamba / Falcon-Mamba"
MODEL_TYPES = {"none": ("MambaForCausalLM", "mamba"),
               "weightless": ("FalconMambaForCausalLM", "falcon_mamba")}  # by dt_bc_norm
FIXED = (("hidden_act", "silu"), ("use_bias", False), ("use_conv_bias", True))


def check_mamba_compatible(args: HybridModelArgs) -> None:
    """ValueError naming the first field the HF Mamba / Falcon-Mamba format cannot hold."""
    pattern = args.parsed_pattern
    problems = []
    if (set(pattern.physical_layer_symbols(include_mtp=True)) != {mamba1.KIND.symbol}
            or args.m_layers != mamba1.KIND.name or pattern.mtp_depths
            or any(isinstance(item, tuple) for item in pattern.main)):
        problems.append(f"hybrid.pattern '{args.pattern}' with m_layers='{args.m_layers}' must "
                        "be Mamba1 layers ('M', m_layers 'mamba1') only, without groups or MTP")
    if args.norm_zero_centered or args.post_norm_mixers:
        problems.append("norms must be pre-norms scaling by their weight")
    if args.mamba1.dt_bc_norm not in MODEL_TYPES:
        problems.append(f"mamba1.dt_bc_norm='{args.mamba1.dt_bc_norm}': Mamba's has none, "
                        "Falcon-Mamba's weightless ones")
    if problems:
        raise ValueError(f"model cannot use the HF {NAME} format: " + "; ".join(problems))


def mamba_key_map(args: HybridModelArgs) -> KeyMap:
    check_mamba_compatible(args)
    mapping: KeyMap = {"backbone.embeddings.weight": "tok_embeddings.weight",
                       "backbone.norm_f.weight": "norm.weight", "lm_head.weight": "output.weight"}
    for j in range(len(args.parsed_pattern.physical_layer_symbols())):
        hf, ours = f"backbone.layers.{j}.", f"layers.{j}."
        mapping[hf + "norm.weight"] = f"{ours}mamba1_norm.weight"
        mapping.update(mamba1_entries(f"{hf}mixer.", f"{ours}mamba1."))
    return mapping


def mamba1_entries(hf: str, ours: str, names: tuple[str, ...] = mamba1.PARAMETERS) -> KeyMap:
    """transformers' Mamba1 mixer at `hf` (MambaMixer's names) as ours at `ours`: in_proj
    [x | z] is the tuple of its two components (our split state dict's)."""
    return {f"{hf}{name}": (tuple(f"{ours}{name}{part}" for part in mamba1.IN_PROJ_PARTS)
                            if name == "in_proj.weight" else f"{ours}{name}")
            for name in names}


def mamba_config(args: HybridModelArgs) -> dict:
    """The config.json a `transformers` MambaForCausalLM (FalconMambaForCausalLM, with the
    weightless dt / B / C norms) needs."""
    check_mamba_compatible(args)
    ssm = args.mamba1
    architecture, model_type = MODEL_TYPES[ssm.dt_bc_norm]
    config = {
        "architectures": [architecture], "model_type": model_type,
        "vocab_size": args.vocab_size, "hidden_size": args.dim,
        "num_hidden_layers": len(args.parsed_pattern.physical_layer_symbols()),
        "layer_norm_epsilon": args.norm_eps, "state_size": ssm.d_state, "expand": ssm.expand,
        "conv_kernel": ssm.conv_width, "time_step_rank": ssm.rank(args.dim),
        "time_step_min": ssm.dt_min, "time_step_max": ssm.dt_max,
        "time_step_floor": ssm.dt_init_floor, **dict(FIXED), "residual_in_fp32": True,
    }
    if ssm.dt_bc_norm == "weightless":
        config["mixer_rms_eps"] = ssm.norm_eps or args.norm_eps
    return config


def model_args_from_mamba_config(config: dict) -> HybridModelArgs:
    """HybridModelArgs for an HF Mamba or Falcon-Mamba config.json; ValueError naming the
    first setting the format cannot hold."""
    for name, expected in FIXED:
        if config.get(name, expected) != expected:
            raise ValueError(f"{name}={config[name]!r} is not supported (expected "
                             f"{expected!r})")
    falcon = config["model_type"] == MODEL_TYPES["weightless"][1]
    rank = config.get("time_step_rank", "auto")
    base = HybridModelArgs()
    return dataclasses.replace(
        base, hf_format=FORMAT, m_layers=mamba1.KIND.name,
        pattern=mamba1.KIND.symbol * config["num_hidden_layers"],
        dim=config["hidden_size"], vocab_size=config["vocab_size"],
        norm_eps=config.get("layer_norm_epsilon", 1e-5),
        mamba1=mamba1.Mamba1Args(
            d_state=config.get("state_size", 16), expand=config.get("expand", 2),
            conv_width=config.get("conv_kernel", 4), dt_rank=0 if rank == "auto" else rank,
            dt_bc_norm="weightless" if falcon else "none",
            norm_eps=config.get("mixer_rms_eps", 1e-6) if falcon else 0.0,
            dt_min=config.get("time_step_min", 1e-3), dt_max=config.get("time_step_max", 0.1),
            dt_init_floor=config.get("time_step_floor", 1e-4)))


# The family, as titan_hybrid/hf/families.py lists it.
FAMILY = Family(
    name=FORMAT, model_types=tuple(model_type for _, model_type in MODEL_TYPES.values()),
    format_name=NAME,
    key_map=mamba_key_map,
    check=check_mamba_compatible,
    config=mamba_config,
    to_args=model_args_from_mamba_config,
    ties=lambda config: bool(config.get("tie_word_embeddings", True)),
    variants=(mamba1.KIND.name,))

"""Hugging Face Nemotron-H interop: the key map of the hub format that `transformers`'
`nemotron_h` model reads (`backbone.layers.N.mixer.*`), and config.json <-> HybridModelArgs.

With it `--checkpoint.initial_load_in_hf` and `--checkpoint.last_save_in_hf` work under any
TP / FSDP layout. The state-dict adapter (engine.py) sees the state dict of SplitModelWrapper,
whose fused tensors are already components in global coordinates, so a fused HF tensor (Mamba
in_proj [z | x | B | C | dt], conv [x | B | C]) is those components laid end to end: every
rank writes or reads only the pieces it holds, nothing is gathered.

Nemotron-H has Mamba2, attention without position embeddings and a non-gated squared-ReLU MLP:
patterns of `M`, `*`, `-` with `mlp.activation = "relu2"` and `attention.use_rope = False`;
Nemotron 3 adds MoE layers (`E`: squared-ReLU experts, one HF tensor per expert, a shared
expert, the sigmoid router with its choice bias). Other models get a ValueError naming the
field when the adapter is used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from titan_hybrid.hf.engine import KeyMap
from titan_hybrid.hf.family import Family
from titan_hybrid.hf.key_map_parts import ExpertSlice
from titan_hybrid.model import attention, mamba, mlp, moe
from titan_hybrid.model.args import AttentionArgs, HybridModelArgs, MambaArgs, MLPArgs, MoEArgs
from titan_hybrid.model.layer_kind import LayerKind
from titan_hybrid.model.layer_kinds import LAYER_KINDS
from titan_hybrid.model.mamba import FUSED_COMPONENTS

FORMAT = "nemotron_h"


@dataclass(frozen=True)
class MixerNames:
    """How Nemotron-H names one kind's layers (Bamba's and Granite's mixers take the same
    tensor names)."""

    block_type: str  # the format's layer-type word (hybrid_override_pattern)
    renames: dict[str, str]  # our parameter -> the format's parameter under `mixer.`
    fused: dict[str, tuple[str, ...]] = field(default_factory=dict)  # HF tensor -> components
    # our [experts, ...] parameter -> the format's name of one expert's slice, with "{}" for
    # the expert's number (one HF tensor per expert)
    per_expert: dict[str, str] = field(default_factory=dict)
    # our optional parameter -> whether the kind's args (its section) give the layer one
    optional: dict[str, Callable[[Any], bool]] = field(default_factory=dict)


# The kinds this format holds, by kind name.
MIXER_NAMES = {
    mamba.KIND.name: MixerNames(
        block_type="mamba",
        renames={name: name for name in ("A_log", "D", "dt_bias", "norm.weight",
                                         "out_proj.weight")},
        fused=FUSED_COMPONENTS),  # HF fuses the same components in the same order
    attention.KIND.name: MixerNames(
        block_type="attention",
        renames={"wq.weight": "q_proj.weight", "wk.weight": "k_proj.weight",
                 "wv.weight": "v_proj.weight", "wo.weight": "o_proj.weight"}),
    mlp.KIND.name: MixerNames(
        block_type="mlp", renames={"fc1.weight": "up_proj.weight",
                                   "fc2.weight": "down_proj.weight"}),
    moe.KIND.name: MixerNames(
        block_type="moe",
        renames={"router.gate.weight": "gate.weight",
                 "router.e_score_correction_bias": "gate.e_score_correction_bias",
                 "shared_expert.fc1.weight": "shared_experts.up_proj.weight",
                 "shared_expert.fc2.weight": "shared_experts.down_proj.weight",
                 "fc1_latent.weight": "fc1_latent_proj.weight",
                 "fc2_latent.weight": "fc2_latent_proj.weight"},
        per_expert={"experts.fc1": "experts.{}.up_proj.weight",
                    "experts.fc2": "experts.{}.down_proj.weight"},
        optional={"fc1_latent.weight": lambda section: section.latent_dim > 0,
                  "fc2_latent.weight": lambda section: section.latent_dim > 0}),
}
# hybrid_override_pattern symbols: the kinds this format names.
HF_BLOCK_TYPES = {symbol: MIXER_NAMES[kind.name].block_type
                  for symbol, kind in LAYER_KINDS.items() if kind.name in MIXER_NAMES}
# layers_block_type words (configs without hybrid_override_pattern) -> our symbols: each
# kind's block type, and the other words transformers uses for the same layers.
_BLOCK_TYPE_ALIASES = {"linear_attention": mamba.KIND, "full_attention": attention.KIND}
HF_LAYER_TYPES = {**{block_type: symbol for symbol, block_type in HF_BLOCK_TYPES.items()},
                  **{word: kind.symbol for word, kind in _BLOCK_TYPE_ALIASES.items()}}


def check_nemotron_h_compatible(args: HybridModelArgs) -> None:
    """ValueError naming the first field the HF Nemotron-H format cannot represent."""
    pattern = args.parsed_pattern
    unsupported = sorted(set(pattern.physical_layer_symbols(include_mtp=True)) - set(HF_BLOCK_TYPES))
    problems = []
    if unsupported:
        problems.append(f"hybrid.pattern '{args.pattern}' has layer types {unsupported}; the "
                        f"format holds only {', '.join(HF_BLOCK_TYPES)}")
    kinds = {kind.name for kind in args.kinds()}
    if mlp.KIND.name in kinds and args.mlp.activation != "relu2":
        problems.append(f"mlp.activation='{args.mlp.activation}' must be 'relu2'")
    if attention.KIND.name in kinds and args.attention.use_rope:
        problems.append("attention.use_rope=True: Nemotron-H attention has no position embedding")
    if mamba.KIND.name in kinds and args.mamba.dt_limit[1] != float("inf"):
        problems.append(f"mamba.dt_limit={args.mamba.dt_limit} must have no upper bound")
    experts = args.moe
    if moe.KIND.name in kinds and (experts.activation, experts.score_func,
                                   experts.score_correction_bias,
                                   experts.shared_expert_hidden_dim > 0) != NEMOTRON_3_MOE:
        problems.append(
            f"moe: activation={experts.activation!r}, score_func={experts.score_func!r}, "
            f"score_correction_bias={experts.score_correction_bias}, shared_expert_hidden_dim="
            f"{experts.shared_expert_hidden_dim}; Nemotron 3's MoE layers have squared-ReLU "
            "experts, a sigmoid router with a choice bias and a shared expert")
    if problems:
        raise ValueError("model cannot use the HF Nemotron-H format: " + "; ".join(problems))


# (moe.activation, score_func, score_correction_bias, a shared expert) of Nemotron 3's MoE.
NEMOTRON_3_MOE = ("relu2", "sigmoid", True, True)


def physical_layer_prefixes(args: HybridModelArgs) -> list[tuple[str, LayerKind]]:
    """(checkpoint key prefix, kind) of each physical layer in order: HF layer N is entry N.
    Prefixes are the LOGICAL keys SplitModelWrapper uses (a group's sub-layer takes the group's
    index unless its kind occurs twice in the group)."""
    return _prefixes(args.parsed_pattern.main, "layers.")


def mtp_layer_prefixes(args: HybridModelArgs, depth: int) -> list[tuple[str, LayerKind]]:
    """The same for the layers of MTP depth `depth`."""
    return _prefixes(args.parsed_pattern.mtp, f"mtp.{depth}.block.layers.")


def _prefixes(items, base: str) -> list[tuple[str, LayerKind]]:
    layers = []
    for index, item in enumerate(items):
        if isinstance(item, str):
            layers.append((f"{base}{index}.", LAYER_KINDS[item]))
            continue
        for inner, symbol in enumerate(item):
            unique = item.count(symbol) == 1
            prefix = f"{base}{index}." if unique else f"{base}{index}.layers.{inner}."
            layers.append((prefix, LAYER_KINDS[symbol]))
    return layers


def layer_entries(args: HybridModelArgs, hf: str, prefix: str, kind: LayerKind) -> dict:
    """HF key -> our key of one layer: HF prefix `hf`, ours `prefix`."""
    names, section = MIXER_NAMES[kind.name], args.section(kind)
    entries: dict = {hf + "norm.weight": f"{prefix}{kind.name}_norm.weight"}
    for ours, theirs in names.renames.items():
        if ours not in names.optional or names.optional[ours](section):
            entries[f"{hf}mixer.{theirs}"] = f"{prefix}{kind.name}.{ours}"
    for name, parts in names.fused.items():
        entries[f"{hf}mixer.{name}"] = tuple(f"{prefix}{kind.name}.{name}{part}"
                                             for part in parts)
    for ours, theirs in names.per_expert.items():
        for expert in range(section.num_experts):
            entries[f"{hf}mixer.{theirs.format(expert)}"] = ExpertSlice(
                f"{prefix}{kind.name}.{ours}", expert)
    return entries


def nemotron_h_key_map(args: HybridModelArgs) -> KeyMap:
    """HF key -> our key, the tuple of our component keys of a fused HF tensor (Mamba2's
    in_proj and conv1d: HF fuses the same components in the same order, so the HF tensor is
    the parameter whole), or one expert's slice of our parameter."""
    check_nemotron_h_compatible(args)
    mapping: KeyMap = {
        "backbone.embeddings.weight": "tok_embeddings.weight",
        "backbone.norm_f.weight": "norm.weight",
        "lm_head.weight": "output.weight",
    }
    for number, (prefix, kind) in enumerate(physical_layer_prefixes(args)):
        mapping.update(layer_entries(args, f"backbone.layers.{number}.", prefix, kind))
    # MTP (Megatron-Bridge's and vLLM's names; transformers does not model it): depth d's
    # layer j is mtp.layers.{d * P + j}, P layers a depth, named as backbone layers; the
    # depth's first layer holds its input norms and projection, its last the final norm.
    for depth in range(args.parsed_pattern.mtp_depths):
        layers = mtp_layer_prefixes(args, depth)
        first, last = depth * len(layers), (depth + 1) * len(layers) - 1
        for j, (prefix, kind) in enumerate(layers):
            mapping.update(layer_entries(args, f"mtp.layers.{first + j}.", prefix, kind))
        for theirs, ours in (("enorm", "embedding_norm"), ("hnorm", "hidden_norm"),
                             ("eh_proj", "eh_proj")):
            mapping[f"mtp.layers.{first}.{theirs}.weight"] = f"mtp.{depth}.{ours}.weight"
        mapping[f"mtp.layers.{last}.final_layernorm.weight"] = (
            f"mtp.{depth}.final_norm.weight")
    return mapping


# --------------------------------------------------------------------------- config.json
def nemotron_h_config(args: HybridModelArgs) -> dict:
    """The config.json a `transformers` NemotronHForCausalLM needs for these weights."""
    check_nemotron_h_compatible(args)
    pattern = args.parsed_pattern.physical_layer_symbols(include_mtp=False)
    attention, mamba = args.attention, args.mamba
    return {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "hybrid_override_pattern": "".join(pattern),
        "num_hidden_layers": len(pattern),
        "layer_norm_epsilon": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "num_attention_heads": attention.n_heads,
        "num_key_value_heads": attention.n_kv_heads,
        "head_dim": attention.head_dim,
        "attention_bias": False,
        "intermediate_size": args.mlp.hidden_dim,
        "mlp_hidden_act": "relu2",
        "mlp_bias": False,
        "mamba_num_heads": args.mamba_n_heads,
        "mamba_head_dim": mamba.head_dim,
        "n_groups": mamba.n_groups,
        "ssm_state_size": mamba.d_state,
        "conv_kernel": mamba.conv_width,
        "chunk_size": mamba.chunk_size,
        "expand": mamba.expand,
        "mamba_hidden_act": "silu",
        "use_bias": False,
        "use_conv_bias": True,
        # transformers clamps softplus(dt + dt_bias) from below at time_step_min.
        "time_step_min": mamba.dt_limit[0],
        "time_step_max": mamba.dt_max,
        "time_step_floor": mamba.dt_init_floor,
        "residual_in_fp32": False,
        **_moe_config(args),
        **_mtp_config(args),
    }


def _mtp_config(args: HybridModelArgs) -> dict:
    pattern = args.parsed_pattern
    if not pattern.mtp_depths:
        return {}
    return {"num_nextn_predict_layers": pattern.mtp_depths,  # each depth's layers alike
            "mtp_layers_block_type": [HF_BLOCK_TYPES[symbol] for item in pattern.mtp
                                      for symbol in item]}


def _moe_config(args: HybridModelArgs) -> dict:
    if moe.KIND.symbol not in args.symbols():
        return {}
    experts = args.moe
    return {"n_routed_experts": experts.num_experts, "num_experts_per_tok": experts.top_k,
            "moe_intermediate_size": experts.hidden_dim,
            "moe_shared_expert_intermediate_size": experts.shared_expert_hidden_dim,
            "moe_latent_size": experts.latent_dim or None, "n_group": experts.n_group,
            "topk_group": experts.topk_group,
            "routed_scaling_factor": experts.routed_scaling_factor,
            "norm_topk_prob": experts.normalizes_top_k}


def _symbols(config: dict, pattern_field: str, types_field: str) -> str:
    """Our layer symbols from a pattern string (legacy) or a list of layer-type words."""
    if pattern_field in config:
        return config[pattern_field]
    types = config.get(types_field) or []
    unknown = sorted({t for t in types if t not in HF_LAYER_TYPES})
    if unknown:
        raise ValueError(f"{types_field} has {unknown}: the supported layer types are "
                         f"{', '.join(sorted(HF_LAYER_TYPES))}")
    return "".join(HF_LAYER_TYPES[t] for t in types)


def model_args_from_nemotron_h_config(config: dict, base: HybridModelArgs | None = None
                                      ) -> HybridModelArgs:
    """HybridModelArgs for an HF Nemotron-H config.json (dense: Mamba2, attention, MLP)."""
    pattern = _symbols(config, "hybrid_override_pattern", "layers_block_type")
    depths = config.get("num_nextn_predict_layers") or 0
    if depths:
        if config.get("mtp_use_repeated_layer") and depths > 1:
            raise ValueError(f"mtp_use_repeated_layer=True with num_nextn_predict_layers="
                             f"{depths}: titan_hybrid's MTP depths each have their own weights")
        mtp = (_symbols(config, "mtp_hybrid_override_pattern", "mtp_layers_block_type")
               or "*E")  # transformers' default: ["full_attention", "moe"]
        pattern += f"/{mtp}" * depths
    for name, expected in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu"),
                           ("use_bias", False),
                           ("mlp_bias", False), ("attention_bias", False),
                           ("use_conv_bias", True)):
        if config.get(name, expected) != expected:
            raise ValueError(f"Nemotron-H config: {name}={config[name]!r} is not supported "
                             f"(expected {expected!r})")
    dim = config["hidden_size"]
    d_inner = config["mamba_num_heads"] * config["mamba_head_dim"]
    base = base or HybridModelArgs()
    experts = base.moe
    if moe.KIND.symbol in pattern:
        experts = MoEArgs(
            num_experts=config["n_routed_experts"], top_k=config["num_experts_per_tok"],
            hidden_dim=config["moe_intermediate_size"],
            shared_expert_hidden_dim=config["moe_shared_expert_intermediate_size"],
            activation="relu2", score_func="sigmoid", score_correction_bias=True,
            n_group=config.get("n_group", 1), topk_group=config.get("topk_group", 1),
            routed_scaling_factor=config.get("routed_scaling_factor", 1.0),
            norm_topk_prob=config.get("norm_topk_prob", True),
            latent_dim=config.get("moe_latent_size") or 0)
    return dataclasses.replace(
        base,
        hf_format=FORMAT,
        moe=experts,
        pattern=pattern,
        dim=dim,
        vocab_size=config["vocab_size"],
        norm_eps=config.get("layer_norm_epsilon", 1e-5),
        attention=AttentionArgs(n_heads=config["num_attention_heads"],
                                n_kv_heads=config["num_key_value_heads"],
                                head_dim=config.get("head_dim") or dim // config["num_attention_heads"],
                                use_rope=False),
        mlp=MLPArgs(hidden_dim=config["intermediate_size"], activation="relu2"),
        mamba=MambaArgs(d_state=config["ssm_state_size"], head_dim=config["mamba_head_dim"],
                        n_groups=config["n_groups"], expand=config.get("expand", 2),
                        # mamba_num_heads alone sets the width (Nano's is not expand * dim)
                        num_heads=0 if d_inner == config.get("expand", 2) * dim
                        else config["mamba_num_heads"],
                        conv_width=config.get("conv_kernel", 4),
                        chunk_size=config.get("chunk_size", 128),
                        dt_max=config.get("time_step_max", 0.1),
                        dt_init_floor=config.get("time_step_floor", 1e-4),
                        dt_limit=(config.get("time_step_min", 1e-3), float("inf"))),
    )


# The family, as titan_hybrid/hf/families.py lists it.
FAMILY = Family(
    name="nemotron_h", model_types=("nemotron_h",),
    format_name="Nemotron-H",
    key_map=nemotron_h_key_map,
    check=check_nemotron_h_compatible,
    config=nemotron_h_config,
    to_args=model_args_from_nemotron_h_config,
    mtp_marker=lambda args: "mtp.layers.0.eh_proj.weight",
    mtp_count_field="num_nextn_predict_layers")

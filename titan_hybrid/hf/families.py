"""The Hugging Face model families titan_hybrid reads and writes: one registry (FAMILIES), each
family declared by its own module (hf/<family>.py: its FAMILY, a family.py Family), and the
families it refuses, with the reason.

A config.json picks its family by `model_type` (`family_of`); a type we cannot express exactly
is refused by name (REFUSED), and an unknown one lists the supported types. A model's HF
checkpoints (`--checkpoint.initial_load_in_hf`, `--checkpoint.last_save_in_hf`,
`python -m titan_hybrid.hf export`) take the family its args name (`hf_format`: a model
imported from Bamba exports as Bamba), else the one its layer kinds belong to (RULE):

    DeepSeek-V3 / V3.2   models with MLA (`+`) or DSA (`D`) layers: deepseek.py
    DeepSeek-V4          models with V4 attention (`W`, `C`, `H`): deepseek_v4.py
    Nemotron-H           all others: nemotron_h.py
    the others           by hf_format only

A model the chosen format cannot hold is refused when the job is checked, before anything is
built, with the format's first unmet condition and this rule.

Options that only DeepSeek-V4's format holds (hyper-connections, sqrtsoftplus routing, the
SwiGLU clamp) are refused by name for a model of any other format: its export would drop them.

Every family but DeepSeek's and Kimi Linear's can tie the LM head to the embedding
(`tie_word_embeddings`: the model's `enable_weight_tying`). A tied model's state dict names the
weight once, as the embedding's, so its HF checkpoint has no `lm_head.weight`, as transformers
writes it.

A new family is its module plus one line in FAMILIES.
"""

from __future__ import annotations

import json
from pathlib import Path

from titan_hybrid.hf import (
    bailing_hybrid,
    bamba,
    deepseek,
    deepseek_v4,
    falcon_h1,
    granite,
    jamba,
    kimi_linear,
    lfm2,
    mamba,
    mamba2,
    nemotron_h,
    olmo_hybrid,
    qwen3_5,
    qwen3_next,
    safetensors_io,
)
from titan_hybrid.hf.deepseek import ARCHITECTURES, ATTENTION_KINDS
from titan_hybrid.hf.engine import KeyMapAdapter
from titan_hybrid.hf.family import Family
from titan_hybrid.model import attention, mlp
from titan_hybrid.model import mamba as mamba2_kind
from titan_hybrid.model.args import HybridModelArgs

CONFIG_FILE = "config.json"

FAMILIES = {family.name: family for family in (
    nemotron_h.FAMILY,
    deepseek.FAMILY,
    deepseek_v4.FAMILY,
    bamba.FAMILY,
    qwen3_5.FAMILY,
    granite.FAMILY,
    qwen3_next.FAMILY,
    olmo_hybrid.FAMILY,
    kimi_linear.FAMILY,
    lfm2.FAMILY,
    mamba2.FAMILY,
    falcon_h1.FAMILY,
    bailing_hybrid.FAMILY,
    mamba.FAMILY,
    jamba.FAMILY,
)}

RULE = ("HF checkpoints take the format of the model's layer kinds: DeepSeek-V3 / V3.2 for "
        f"models with MLA / DSA layers ({', '.join(kind.symbol for kind in ATTENTION_KINDS)}), "
        f"DeepSeek-V4 for models with its attention ({' '.join(deepseek_v4.LAYER_TYPE)}), "
        "Nemotron-H for the others")

# model_type -> why titan_hybrid's layer kinds cannot hold that family exactly.
REFUSED = {
    "zamba": "its transformer blocks are shared between positions (one set of weights "
             "applied at several depths); titan_hybrid's layers each own their weights",
    "zamba2": "its transformer blocks are shared between positions (one set of weights "
              "applied at several depths, with per-position LoRA); titan_hybrid's layers each "
              "own their weights",
}


def supported_model_types() -> list[str]:
    return sorted(t for family in FAMILIES.values() for t in family.model_types)


def family_of(config: dict, where: str = CONFIG_FILE) -> Family:
    """The family of an HF config.json; ValueError naming `model_type` and the rule."""
    model_type = config.get("model_type")
    if model_type is None and all(field in config for field in mamba2.MAMBA_SSM_FIELDS):
        raise ValueError(f"{where} is mamba_ssm's own config.json (d_model, ssm_cfg; no "
                         "model_type), which titan_hybrid does not read: it reads "
                         "transformers' (model_type 'mamba2', as transformers' "
                         "Mamba2ForCausalLM saves it)")
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family
    if model_type in REFUSED:
        raise ValueError(f"{where}: model_type '{model_type}' cannot be converted: "
                         f"{REFUSED[model_type]}")
    raise ValueError(f"{where}: model_type '{model_type}' is not a supported family; "
                     f"supported: {', '.join(supported_model_types())}")


def read_config(path: str | Path, field: str) -> tuple[dict, Path]:
    """(config.json's contents, its path) of a folder or a file; ValueError naming `field`."""
    path = Path(path)
    file = path / CONFIG_FILE if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"{field} '{path}' has no {CONFIG_FILE}" if path.is_dir()
                         else f"{field} '{path}' does not exist")
    try:
        return json.loads(file.read_text()), file
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{field} '{file}' is not readable JSON ({error})") from None


def model_args_from_hf(path: str | Path, field: str = "hybrid.model_config") -> HybridModelArgs:
    """The model args of an HF folder's (or file's) config.json, validated; ValueError names
    the field, the file and the setting we cannot hold."""
    return model_args_and_config(path, field)[0]


def model_args_and_config(path: str | Path, field: str) -> tuple[HybridModelArgs, dict]:
    """(the model args, the config.json that gives them): an HF folder whose config declares
    MTP layers its weights lack (transformers saved it) is the model without them."""
    config, file = read_config(path, field)
    family = family_of(config, str(file))
    try:
        args = family.model_args(config)
        if args.parsed_pattern.mtp_depths and family.mtp_marker is not None:
            stored = _stored_names(file.parent)
            if stored and family.mtp_marker(args) not in stored:
                args, config = family.without_mtp(args, config)
        args.validate()
    except ValueError as error:
        raise ValueError(f"{file}: {error}") from None
    return args, config


def _stored_names(folder: Path) -> set[str]:
    """The tensor names of a folder's safetensors (none when it holds no weights: a bare
    config.json)."""
    try:
        return set(safetensors_io.folder_files(folder))
    except ValueError:
        return set()


def hf_format_of(args: HybridModelArgs) -> Family:
    """The model's format (its hf_format, else RULE), whether or not it can hold the model."""
    if args.hf_format:
        if args.hf_format not in FAMILIES:
            raise ValueError(f"hf_format '{args.hf_format}' is not one of {sorted(FAMILIES)}")
        return FAMILIES[args.hf_format]
    kinds = {kind.name for kind in args.kinds()}
    if kinds & set(ARCHITECTURES):
        return FAMILIES["deepseek"]
    if kinds & {kind.name for kind in deepseek_v4.V4_KINDS.values()}:
        return FAMILIES["deepseek_v4"]
    return FAMILIES["nemotron_h"]


def _held_by_falcon_h1_only(args: HybridModelArgs) -> str | None:
    """An option of the model's that only the Falcon-H1 format holds (its µP multipliers,
    Mamba2 without the gated norm): another format's export would drop it silently."""
    kinds = {kind.name for kind in args.kinds()}
    options = [("lm_head_multiplier", args.lm_head_multiplier, 1.0)]
    if attention.KIND.name in kinds:
        options += [(f"attention.{name}", getattr(args.attention, name), 1.0)
                    for name in ("key_multiplier", "input_multiplier", "output_multiplier")]
    if mamba2_kind.KIND.name in kinds:
        options += [(f"mamba.{name}", getattr(args.mamba, name), default)
                    for name, default in (("input_multiplier", 1.0), ("output_multiplier", 1.0),
                                          ("in_proj_multipliers", (1.0,) * 5),
                                          ("gated_norm", True))]
    if mlp.KIND.name in kinds:
        options += [(f"mlp.{name}", getattr(args.mlp, name), 1.0)
                    for name in ("gate_multiplier", "down_multiplier")]
    for name, value, default in options:
        if (tuple(value) if isinstance(value, list) else value) != default:
            return f"{name}={value}"
    return None


def _held_by_deepseek_v4_only(args: HybridModelArgs) -> str | None:
    """An option of the model's that only the DeepSeek-V4 format holds: another format's
    export would drop it silently."""
    if args.hc_mult:
        return f"hc_mult={args.hc_mult}: hyper-connections"
    if any(kind.routed_experts for kind in args.kinds()):
        if args.moe.score_func == "sqrtsoftplus":
            return "moe.score_func='sqrtsoftplus'"
        if args.moe.swiglu_limit:
            return f"moe.swiglu_limit={args.moe.swiglu_limit}"
    if args.mlp.swiglu_limit:
        return f"mlp.swiglu_limit={args.mlp.swiglu_limit}"
    return None


def check_hf_compatible(args: HybridModelArgs) -> Family:
    """The model's HF format; ValueError naming its first unmet condition, and RULE."""
    hf_format = hf_format_of(args)
    variants = [kind for kind in args.kinds()
                if kind.variant is not None and kind.name not in hf_format.variants]
    if variants:
        raise ValueError(f"{variants[0].title} layers (m_layers='{args.m_layers}', g_layers="
                         f"'{args.g_layers}') are held by none of the Hugging Face families "
                         "titan_hybrid writes")
    for only, held_by_only in ((FAMILIES["deepseek_v4"], _held_by_deepseek_v4_only),
                               (FAMILIES["falcon_h1"], _held_by_falcon_h1_only)):
        unheld = None if hf_format is only else held_by_only(args)
        if unheld:
            raise ValueError(f"{unheld} is held only by the {only.format_name} format, and "
                             f"this model's HF format is {hf_format.name} ({RULE})")
    try:
        hf_format.check(args)
        if args.enable_weight_tying and not hf_format.ties_embeddings:
            raise ValueError("enable_weight_tying=True: this format's LM head has its own weight")
    except ValueError as error:
        raise ValueError(f"{error} ({RULE})") from None
    return hf_format


def hf_config(args: HybridModelArgs) -> dict:
    """The config.json that `transformers` reads with the model's HF checkpoint."""
    return {**check_hf_compatible(args).config(args),
            "tie_word_embeddings": args.enable_weight_tying}


def hybrid_state_dict_adapter(model_args: HybridModelArgs,
                              hf_assets_path: str | None) -> KeyMapAdapter:
    """The TrainSpec's `state_dict_adapter` (torchtitan calls it with these two arguments on
    every run): the adapter of the model's format. A model the format cannot hold fails only
    when the adapter is used, and the pre-flight check (training/preflight.py) refuses such a
    job before that."""
    return hf_format_of(model_args).adapter(model_args, hf_assets_path, config_json=hf_config)

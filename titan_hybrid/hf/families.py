"""Hugging Face model families: which `model_type` of a config.json titan_hybrid reads and
writes, the model args each one gives, and the families it refuses, with the reason.

A family ties three things together: the model args from its config.json (`to_args`), the
config.json from model args (`to_config`, checkpoint/hf_formats.py's), and the state-dict
adapter that names its tensors (checkpoint/hf_*.py). `family_of(config)` picks one by
`model_type`; a type we cannot express exactly is refused by name (REFUSED), and an unknown
one lists the supported types.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from titan_hybrid.checkpoint.hf_bamba import model_args_from_bamba_config
from titan_hybrid.checkpoint.hf_deepseek import model_args_from_deepseek_config
from titan_hybrid.checkpoint.hf_formats import (
    BAMBA,
    DEEPSEEK,
    GRANITE,
    KIMI_LINEAR,
    NEMOTRON_H,
    OLMO_HYBRID,
    QWEN3_5,
    QWEN3_NEXT,
    HFFormat,
)
from titan_hybrid.checkpoint.hf_granite import model_args_from_granite_config
from titan_hybrid.checkpoint.hf_kimi_linear import model_args_from_kimi_linear_config
from titan_hybrid.checkpoint.hf_nemotron_h import model_args_from_nemotron_h_config
from titan_hybrid.checkpoint.hf_olmo_hybrid import model_args_from_olmo_hybrid_config
from titan_hybrid.checkpoint.hf_qwen3_5 import model_args_from_qwen3_5_config
from titan_hybrid.checkpoint.hf_qwen3_next import model_args_from_qwen3_next_config
from titan_hybrid.hf import safetensors_io
from titan_hybrid.model.args import HybridModelArgs

CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class Family:
    model_types: tuple[str, ...]
    hf_format: HFFormat  # the adapter and the config.json of an export
    to_args: Callable[[dict], HybridModelArgs]  # ValueError naming a setting it cannot hold
    # The HF tensor that a folder holds when it has the MTP layers its config declares, and
    # the config's field of their count. transformers models no MTP layer: its save_pretrained
    # keeps the config's MTP fields but writes no MTP tensor.
    mtp_marker: Callable[[HybridModelArgs], str] | None = None
    mtp_count_field: str = ""

    def model_args(self, config: dict) -> HybridModelArgs:
        """The model args of a config.json of this family: `to_args`'s, with the LM head tied
        to the embedding where the config says so (a multimodal config may say it in its
        `text_config`)."""
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
        tied = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        if tied and not self.hf_format.ties_embeddings:
            raise ValueError("tie_word_embeddings=True is not supported: titan_hybrid's "
                             f"{'/'.join(self.model_types)} models have an LM head of its own")
        return dataclasses.replace(self.to_args(config), enable_weight_tying=tied)

    def without_mtp(self, args: HybridModelArgs, config: dict) -> tuple[HybridModelArgs, dict]:
        """The args and config.json of the model without its MTP layers."""
        config = {**config, self.mtp_count_field: 0}
        if isinstance(config.get("text_config"), dict):
            config["text_config"] = {**config["text_config"], self.mtp_count_field: 0}
        return dataclasses.replace(args, pattern=args.pattern.split("/")[0]), config


FAMILIES = (
    Family(("nemotron_h",), NEMOTRON_H, model_args_from_nemotron_h_config,
           mtp_marker=lambda args: "mtp.layers.0.eh_proj.weight",
           mtp_count_field="num_nextn_predict_layers"),
    Family(("deepseek_v3", "deepseek_v32"), DEEPSEEK, model_args_from_deepseek_config,
           mtp_marker=lambda args: "model.layers.{}.eh_proj.weight".format(
               len(args.parsed_pattern.physical_layer_symbols()) // 2),
           mtp_count_field="num_nextn_predict_layers"),
    Family(("bamba",), BAMBA, model_args_from_bamba_config),
    Family(("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"), QWEN3_5,
           model_args_from_qwen3_5_config, mtp_marker=lambda args: "mtp.fc.weight",
           mtp_count_field="mtp_num_hidden_layers"),
    Family(("granitemoehybrid",), GRANITE, model_args_from_granite_config),
    Family(("qwen3_next",), QWEN3_NEXT, model_args_from_qwen3_next_config,
           mtp_marker=lambda args: "mtp.fc.weight", mtp_count_field="num_nextn_predict_layers"),
    Family(("olmo_hybrid",), OLMO_HYBRID, model_args_from_olmo_hybrid_config),
    Family(("kimi_linear",), KIMI_LINEAR, model_args_from_kimi_linear_config),
)

# model_type -> why titan_hybrid's layer kinds cannot hold that family exactly.
REFUSED = {
    "jamba": "its SSM layers are Mamba1 (selective scan with a per-channel state), and "
             "titan_hybrid's SSM layer is Mamba2 (M)",
    "mamba": "its layers are Mamba1 (selective scan with a per-channel state), and "
             "titan_hybrid's SSM layer is Mamba2 (M)",
    "falcon_h1": "each layer runs attention and Mamba2 in parallel on the same input and adds "
                 "them; titan_hybrid's layers run one mixer each, in sequence",
    "zamba": "its transformer blocks are shared between positions (one set of weights "
             "applied at several depths); titan_hybrid's layers each own their weights",
    "zamba2": "its transformer blocks are shared between positions (one set of weights "
              "applied at several depths, with per-position LoRA); titan_hybrid's layers each "
              "own their weights",
}


def supported_model_types() -> list[str]:
    return sorted(t for family in FAMILIES for t in family.model_types)


def family_of(config: dict, where: str = CONFIG_FILE) -> Family:
    """The family of an HF config.json; ValueError naming `model_type` and the rule."""
    model_type = config.get("model_type")
    for family in FAMILIES:
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

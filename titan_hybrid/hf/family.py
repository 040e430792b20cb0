"""One Hugging Face model family: everything titan_hybrid knows of it, declared by its module
(hf/<family>.py, as its `FAMILY`) and listed once in hf/families.py.

A family ties together the model args of its config.json (`to_args`), the config.json of an
export (`config`), what its format cannot hold (`check`), and the names of its tensors
(`key_map`, and `file_key_map` where its files come in variants), which engine.py's
KeyMapAdapter turns into torchtitan's state-dict adapter (`adapter`). A family is data: no
family has an adapter class of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from titan_hybrid.hf.engine import KeyMap, KeyMapAdapter, Shapes
from titan_hybrid.model.args import HybridModelArgs


@dataclass(frozen=True)
class Family:
    name: str  # the model args' `hf_format` naming it
    model_types: tuple[str, ...]  # the config.json `model_type`s it reads
    format_name: str  # the format's name in messages
    # HF key -> what it is made of of ours (engine.py's KeyMap), as an export names the
    # tensors; ValueError naming what the format cannot hold
    key_map: Callable[[HybridModelArgs], KeyMap]
    check: Callable[[HybridModelArgs], object]  # ValueError naming what it cannot hold
    config: Callable[[HybridModelArgs], dict]  # the config.json of an export
    to_args: Callable[[dict], HybridModelArgs]  # ValueError naming a setting it cannot hold
    ties_embeddings: bool = True  # whether its models may share the embedding with the head
    # Whether a config.json ties the LM head to the embedding, where the family reads it other
    # than from `tie_word_embeddings` (default False, or a multimodal config's text_config's)
    ties: Callable[[dict], bool] | None = None
    # The variants of a symbol (layer_kinds.VARIANTS) its format holds, by kind name
    variants: tuple[str, ...] = ()
    # The HF tensor that a folder holds when it has the MTP layers its config declares, and
    # the config's field of their count. transformers models no MTP layer: its save_pretrained
    # keeps the config's MTP fields but writes no MTP tensor.
    mtp_marker: Callable[[HybridModelArgs], str] | None = None
    mtp_count_field: str = ""
    # For a format whose files come in variants (other names, other cuts of a fused tensor):
    # the key map of a file whose tensors have these shapes
    file_key_map: Callable[[HybridModelArgs, Shapes], KeyMap] | None = None

    def adapter(self, model_args: HybridModelArgs, hf_assets_path: str | None = None, *,
                config_json: Callable[[HybridModelArgs], dict] | None = None
                ) -> KeyMapAdapter:
        """The state-dict adapter of a model in this format (`config_json`: the config.json
        of its export, for the checkpoint manager's last save in HF)."""
        return KeyMapAdapter(model_args, hf_assets_path, format_name=self.format_name,
                             key_map=self.key_map, file_key_map=self.file_key_map,
                             config_json=config_json)

    def model_args(self, config: dict) -> HybridModelArgs:
        """The model args of a config.json of this family: `to_args`'s, with the LM head tied
        to the embedding where the config says so (a multimodal config may say it in its
        `text_config`)."""
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
        tied = (self.ties(config) if self.ties is not None else
                bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))))
        if tied and not self.ties_embeddings:
            raise ValueError("tie_word_embeddings=True is not supported: titan_hybrid's "
                             f"{'/'.join(self.model_types)} models have an LM head of its own")
        return dataclasses.replace(self.to_args(config), enable_weight_tying=tied)

    def without_mtp(self, args: HybridModelArgs, config: dict) -> tuple[HybridModelArgs, dict]:
        """The args and config.json of the model without its MTP layers."""
        config = {**config, self.mtp_count_field: 0}
        if isinstance(config.get("text_config"), dict):
            config["text_config"] = {**config["text_config"], self.mtp_count_field: 0}
        return dataclasses.replace(args, pattern=args.pattern.split("/")[0]), config

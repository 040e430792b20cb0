"""One Hugging Face model family: everything titan_hybrid knows of it, declared by its module
(hf/<family>.py, as its `FAMILY`) and listed once in hf/families.py.

A family ties together the model args of its config.json (`to_args`), the config.json of an
export (`config`), what its format cannot hold (`check`), and the state-dict adapter that
names its tensors (`adapter`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from titan_hybrid.hf.adapter import HFStateDictAdapter
from titan_hybrid.model.args import HybridModelArgs


@dataclass(frozen=True)
class Family:
    name: str  # the model args' `hf_format` naming it
    model_types: tuple[str, ...]  # the config.json `model_type`s it reads
    adapter: type[HFStateDictAdapter]
    check: Callable[[HybridModelArgs], object]  # ValueError naming what it cannot hold
    config: Callable[[HybridModelArgs], dict]  # the config.json of an export
    to_args: Callable[[dict], HybridModelArgs]  # ValueError naming a setting it cannot hold
    ties_embeddings: bool = True  # whether its models may share the embedding with the head
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

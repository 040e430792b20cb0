"""What the Hugging Face state-dict adapters (hf_nemotron_h.py, hf_deepseek.py) share: the file
layout of an HF export and the reader of an HF checkpoint. hf_formats.py picks the adapter."""

from __future__ import annotations

import json
import os
import re

from torch.distributed.checkpoint import HuggingFaceStorageReader
from torchtitan.protocols.state_dict_adapter import BaseStateDictAdapter

from titan_hybrid.model.args import HybridModelArgs


class HFStateDictAdapter(BaseStateDictAdapter):
    """torchtitan's adapter protocol; subclasses give `to_hf` / `from_hf` and FORMAT_NAME.

    An export splits its tensors over files as `hf_assets_path`'s model.safetensors.index.json
    does when there is one (`fqn_to_index_mapping`), else writes one file. Unlike torchtitan's
    StateDictAdapter, a missing index is not worth a warning: the adapter is built for every
    run, and `hf_assets_path` usually holds only the tokenizer."""

    FORMAT_NAME: str  # the format's name in messages

    def __init__(self, model_args: HybridModelArgs, hf_assets_path: str | None) -> None:
        self.model_args = model_args
        self.hf_assets_path = hf_assets_path
        self.fqn_to_index_mapping = None
        index_file = os.path.join(hf_assets_path or "", "model.safetensors.index.json")
        if hf_assets_path and os.path.isfile(index_file):
            with open(index_file) as f:
                weight_map = json.load(f)["weight_map"]
            self.fqn_to_index_mapping = {key: int(re.search(r"\d+", file).group(0))
                                         for key, file in weight_map.items()}

    def get_hf_storage_reader(self, path: str, from_quantized: bool = False):
        if from_quantized:
            raise ValueError(f"checkpoint.initial_load_in_hf_quantized: {self.FORMAT_NAME} "
                             "checkpoints are read unquantized only")
        return HuggingFaceStorageReader(path)

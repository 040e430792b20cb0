"""What the Hugging Face state-dict adapters share: the file layout of an HF export, the reader of
an HF checkpoint, and the entries of a key map beyond a plain rename (an expert's slice, a copy
of a shared tensor). families.py picks a model's adapter."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.tensor import DTensor, Shard
from torchtitan.protocols.state_dict_adapter import BaseStateDictAdapter

from titan_hybrid.checkpoint.split import ComponentChunks, local_placement
from titan_hybrid.model.args import HybridModelArgs


class HFStateDictAdapter(BaseStateDictAdapter):
    """torchtitan's adapter protocol; subclasses give `to_hf` / `from_hf` and FORMAT_NAME.

    An export splits its tensors over files as `hf_assets_path`'s model.safetensors.index.json
    does when there is one (`fqn_to_index_mapping`), else writes one file. Unlike torchtitan's
    StateDictAdapter, a missing index is not worth a warning: the adapter is built for every
    run, and `hf_assets_path` usually holds only the tokenizer."""

    FORMAT_NAME: str  # the format's name in messages

    def __init__(self, model_args: HybridModelArgs, hf_assets_path: str | None, *,
                 config_json: Callable[[HybridModelArgs], dict] | None = None) -> None:
        """`config_json`: the config.json of the model's export (formats.py's hf_config), for
        the checkpoint manager's last save in HF."""
        self.model_args = model_args
        self.hf_assets_path = hf_assets_path
        self.config_json = config_json
        # {logical key: the state dict's own key} of the last to_hf (a plain state dict's
        # grouped sub-layers), for from_hf to give the same keys back
        self._physical: dict[str, str] = {}
        self.fqn_to_index_mapping = None
        index_file = os.path.join(hf_assets_path or "", "model.safetensors.index.json")
        if hf_assets_path and os.path.isfile(index_file):
            with open(index_file) as f:
                weight_map = json.load(f)["weight_map"]
            self.fqn_to_index_mapping = {key: int(re.search(r"\d+", file).group(0))
                                         for key, file in weight_map.items()}

    def hf_config(self) -> dict:
        """The config.json that `transformers` reads with this model's HF checkpoint."""
        if self.config_json is None:
            raise ValueError(f"this {self.FORMAT_NAME} adapter writes no config.json (build it "
                             "with titan_hybrid.hf.families.hybrid_state_dict_adapter)")
        return self.config_json(self.model_args)

    def fit_to_file(self, stored: dict[str, tuple[int, ...]]) -> None:
        """Before reading a file whose tensors have these shapes: a format whose files come in
        variants (OLMo Hybrid's) takes the file's. Nothing for the others."""

    def get_hf_storage_reader(self, path: str, from_quantized: bool = False):
        if from_quantized:
            raise ValueError(f"checkpoint.initial_load_in_hf_quantized: {self.FORMAT_NAME} "
                             "checkpoints are read unquantized only")
        return HuggingFaceStorageReader(path)


# ------------------------------------------------------------------ the state dicts adapters see
# titan_hybrid's checkpoint manager hands an adapter its split state dict: a fused parameter
# (Mamba2's in_proj, the SwiGLU fc1, ...) as its components `<key>.<part>` in global
# coordinates. torchtitan's own checkpointer (a user's torchtitan job) hands it the model's
# plain state dict: the fused parameter itself.


def layer_prefix(key: str) -> str | None:
    """"layers.3." of "layers.3.mamba.in_proj.weight" (None for the embedding, final norm and
    head, which a pipeline stage may lack)."""
    parts = key.split(".")
    return f"{parts[0]}.{parts[1]}." if parts[0] in ("layers", "mtp") and len(parts) > 2 else None


def check_present(state_dict: dict, ours: str, hf_key: str, layers: set[str]) -> None:
    """An HF tensor of a layer the state dict holds must have its source there: a tensor is
    never dropped silently (a pipeline stage holds only its own layers)."""
    if layer_prefix(ours) in layers:
        raise ValueError(f"the state dict has no '{ours}' (or its components) for the HF "
                         f"tensor '{hf_key}'")


def held_layers(state_dict: dict) -> set[str]:
    return {prefix for key in state_dict if (prefix := layer_prefix(key))}


def whole_fused(state_dict: dict, fused_key: str, hf_key: str):
    """The fused parameter of a plain state dict, whose rows are the HF tensor's in order
    (None if the state dict lacks it). Tensor parallelism interleaves the components' rows per
    rank, so a TP-sharded one is refused: titan_hybrid's trainer splits it when it saves."""
    value = state_dict.get(fused_key)
    if isinstance(value, DTensor):
        names = value.device_mesh.mesh_dim_names or ()
        if any(name in ("tp", "etp") and isinstance(placement, Shard)
               for name, placement in zip(names, value.placements)):
            raise ValueError(
                f"HF tensor '{hf_key}': '{fused_key}' is split by tensor parallelism, which "
                "interleaves its components per rank; read or write HF checkpoints of this "
                "model without TP, or through titan_hybrid's trainer (its checkpoint manager "
                "splits the components)")
    return value


def check_all_used(keys, used: set[str], what: str, rule: str) -> None:
    """A tensor on one side with no place on the other is an error naming it (never dropped):
    `keys` not in `used` -> ValueError listing them, `what` naming their side."""
    unused = sorted(key for key in keys if key not in used)
    if unused:
        listing = ", ".join(unused[:8]) + (f" ... ({len(unused)} in all)" if len(unused) > 8
                                           else "")
        raise ValueError(f"{len(unused)} {what} with no place in the {rule}: {listing}")


# transformers writes a float JSON has no literal for (inf, nan) as {"__float__": "Infinity"}.
FLOAT_TAG = "__float__"


def json_float(value) -> float:
    """A config.json number, tagged (transformers' {"__float__": "Infinity"}) or not."""
    return float(value[FLOAT_TAG] if isinstance(value, dict) else value)


def tagged_float(value: float):
    """A float as transformers writes it into a config.json."""
    return value if math.isfinite(value) else {FLOAT_TAG: str(value).replace("inf", "Infinity")}


class SharedCopy(NamedTuple):
    """An HF tensor that copies one our model shares (DeepSeek's MTP layer keeps its own copy
    of the embedding and of the head): written from ours (`key`), and when read, checked equal
    to `original`, the HF tensor it copies, so that a copy that differs is never dropped
    silently."""
    key: str
    original: str


def check_copy(hf_state_dict: dict, hf_key: str, copy: SharedCopy) -> None:
    """ValueError when a copy read differs from its original (each rank checks its own
    piece)."""
    original = hf_state_dict.get(copy.original)
    if original is None:  # a pipeline stage without the original checks nothing
        return

    def bits(tensor):  # bitwise, so that a NaN copied is equal to itself
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return local.contiguous().view(torch.uint8)

    copied = hf_state_dict[hf_key]
    if copied.dtype != original.dtype or not torch.equal(bits(copied), bits(original)):
        raise ValueError(f"HF tensor '{hf_key}' differs from '{copy.original}', which it "
                         "copies: titan_hybrid's MTP depth shares the model's tensor")


class Reshaped(NamedTuple):
    """An HF tensor that is our flat parameter `key` in another shape (Kimi Linear's A_log,
    [1, 1, heads, 1] for our [heads])."""
    key: str
    hf_shape: tuple[int, ...]


class ExpertSlice(NamedTuple):
    """An HF tensor that is one expert's slice of our [experts, ...] parameter (or of one of
    its components: the split state dict's `experts.fc1_w` / `_v`)."""
    key: str
    expert: int


def expert_slice(value: torch.Tensor, expert: int) -> torch.Tensor | None:
    """What this rank holds of `expert` in `value` (a plain tensor, a DTensor sharded over
    whole experts by FSDP / EP, or the split state dict's component of one): a view when it
    holds the whole expert, ComponentChunks of its rows when tensor parallelism splits the
    expert (a load lands in place), None when it holds none of it."""
    if isinstance(value, ComponentChunks):
        held, shape = value.chunks, value.shape
        source, fused_key, layout = value.source, value.fused_key, value.tp_layout
    else:
        local, shape, offsets = local_placement(value, None)
        held, source, fused_key, layout = [(offsets, local)], value, "", None
    pieces = [(torch.Size(offsets[1:]), view[expert - offsets[0]]) for offsets, view in held
              if offsets[0] <= expert < offsets[0] + view.shape[0]]
    if not pieces:
        return None
    if len(pieces) == 1 and tuple(pieces[0][1].shape) == tuple(shape[1:]):
        return pieces[0][1]
    return ComponentChunks(torch.Size(shape[1:]), pieces, source, fused_key, layout)


def softmax_routed(experts, *, shared_expert_gate: bool) -> bool:
    """Whether MoE args (MoEArgs) route as Qwen's and Granite's MoE layers do: SwiGLU experts, a
    softmax renormalised over the chosen experts (no bias, groups or scaling), and a shared
    expert, behind a sigmoid gate or not."""
    return ((experts.activation, experts.score_func, experts.normalizes_top_k,
             experts.score_correction_bias, experts.n_group, experts.routed_scaling_factor,
             experts.shared_expert_gate)
            == ("swiglu", "softmax", True, False, 1, 1.0, shared_expert_gate)
            and experts.shared_expert_hidden_dim > 0)

"""The one state-dict adapter (KeyMapAdapter): a family gives its key map (HF key -> what it is
made of of ours) and its name, and this turns our state dicts into HF ones and back, for every
family, and reads and names the files of an HF checkpoint.

A key map entry is our tensor under another name, a tuple of consecutive components of one of
our fused parameters (Mamba2's in_proj, a SwiGLU fc1's halves), runs of rows taken in turn
from several components (RowPieces: Qwen3-Next's in_proj_qkvz), one expert's slice of our
experts (ExpertSlice), our flat tensor in another shape (Reshaped: Kimi Linear's A_log), or a
copy of a tensor our model shares (SharedCopy: DeepSeek's MTP embedding and head).

It sees titan_hybrid's split state dict (fused parameters as components in global
coordinates: ComponentChunks, whose pieces a load fills in place; grouped sub-layers under
their logical keys) or a plain one (torchtitan's own checkpointer, the conversions), whose
fused parameters it splits into views of their components first (a parameter FSDP shards
stays whole where an HF tensor is all of it, and is split as a DTensor where an HF tensor is a
part of it) and whose grouped sub-layers it renames to their logical keys and back. An HF
tensor made of several components is one view of them when their rows lie end to end in
memory, else GatheredRows of the pieces this rank holds, which a load (DCP's HF reader,
safetensors_io) fills in place and a write through DCP gathers where a rank may hold several
pieces (its HF writer keeps one per rank).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.tensor import DTensor, Shard
from torchtitan.protocols.state_dict_adapter import BaseStateDictAdapter

from titan_hybrid.checkpoint.split import ComponentChunks, GatheredRows, merged_chunks
from titan_hybrid.checkpoint.state import logical_keys, physical_keys
from titan_hybrid.hf.key_map_parts import (
    ExpertSlice,
    Reshaped,
    SharedCopy,
    check_all_used,
    check_copy,
    check_present,
    expert_slice,
    held_layers,
    whole_fused,
)
from titan_hybrid.model.args import HybridModelArgs
from titan_hybrid.model.common import TPLayout, tensor_parallel_layouts
from titan_hybrid.model.model import HybridModel
from titan_hybrid.parallel.tensor_parallel import tp_degree


class RowPieces(NamedTuple):
    """An HF tensor whose rows are runs of our components' rows, in this order: (our component
    key, first row, row count) each, along the components' shard dimension."""
    pieces: tuple[tuple[str, int, int], ...]


KeyMap = dict[str, str | tuple[str, ...] | RowPieces | ExpertSlice | Reshaped | SharedCopy]
SINGLE = (ExpertSlice, Reshaped, SharedCopy)  # entries of one of our tensors, under `.key`
Shapes = dict[str, tuple[int, ...]]  # the tensors of an HF file: name -> shape


def sources(ours) -> tuple[str, ...]:
    """Our keys an HF tensor is made of (each once, in order)."""
    if isinstance(ours, SINGLE):
        return (ours.key,)
    if isinstance(ours, RowPieces):
        return tuple(dict.fromkeys(key for key, _, _ in ours.pieces))
    return ours if isinstance(ours, tuple) else (ours,)


def _fused_layouts(args: HybridModelArgs) -> dict[str, TPLayout]:
    """{logical fqn: TPLayout} of the model's fused parameters (their components' names and
    sizes)."""
    with torch.device("meta"):
        model = HybridModel(args)
    return logical_keys({fqn: layout for fqn, layout in tensor_parallel_layouts(model).items()
                         if layout.partition_names})[0]


def _index_of(hf_assets_path: str | None) -> dict[str, int] | None:
    """{HF key: its file's number} of the folder's model.safetensors.index.json (None: no
    index)."""
    index_file = os.path.join(hf_assets_path or "", "model.safetensors.index.json")
    if not (hf_assets_path and os.path.isfile(index_file)):
        return None
    with open(index_file) as f:
        weight_map = json.load(f)["weight_map"]
    return {key: int(re.search(r"\d+", file).group(0)) for key, file in weight_map.items()}


def _tp_sharded(value) -> bool:
    names = value.device_mesh.mesh_dim_names or ()
    return any(name in ("tp", "etp") and isinstance(placement, Shard)
               for name, placement in zip(names, value.placements))


class KeyMapAdapter(BaseStateDictAdapter):
    """torchtitan's state-dict adapter protocol for one family's format (hf/family.py's
    `Family.adapter` builds it): `to_hf` / `from_hf` through the family's key map.

    An export splits its tensors over files as `hf_assets_path`'s model.safetensors.index.json
    does when there is one (`fqn_to_index_mapping`), else writes one file. torchtitan's
    StateDictAdapter reads that index too, but warns when it is missing: this adapter is built
    for every run, and `hf_assets_path` usually holds only the tokenizer."""

    def __init__(self, model_args: HybridModelArgs, hf_assets_path: str | None, *,
                 format_name: str, key_map: Callable[[HybridModelArgs], KeyMap],
                 file_key_map: Callable[[HybridModelArgs, Shapes], KeyMap] | None = None,
                 config_json: Callable[[HybridModelArgs], dict] | None = None) -> None:
        """`format_name`: the format's name in messages; `key_map`: the model's key map as an
        export names the tensors; `file_key_map`: for a format whose files come in variants,
        the key map of a file whose tensors have these shapes (fit_to_file); `config_json`:
        the config.json of the model's export (families.py's hf_config), for the checkpoint
        manager's last save in HF."""
        self.model_args = model_args
        self.hf_assets_path = hf_assets_path
        self.format_name = format_name
        self._key_map, self._file_key_map = key_map, file_key_map
        self._stored: Shapes | None = None  # the file fit_to_file was given
        self.config_json = config_json
        self.fqn_to_index_mapping = _index_of(hf_assets_path)
        # {logical key: the state dict's own key} of the last to_hf (a plain state dict's
        # grouped sub-layers), for from_hf to give the same keys back
        self._physical: dict[str, str] = {}
        # HF key -> (the value handed out, {our key: what a load through it fills})
        self._handed_out: dict[str, tuple[torch.Tensor, dict]] = {}
        self._plain_fused: list[str] = []  # the fused parameters a plain state dict held whole
        self._plain_values: dict[str, torch.Tensor] = {}  # and their values
        self._layouts: dict | None = None

    def key_map(self) -> KeyMap:
        """HF key -> our key (a fused parameter's component: `<fqn><part>`), the tuple of
        consecutive components an HF tensor is made of, its RowPieces, one expert's slice,
        our tensor reshaped, or a copy of a tensor our model shares: the names of the file
        fit_to_file was given, else those an export writes."""
        if self._stored is not None and self._file_key_map is not None:
            return self._file_key_map(self.model_args, self._stored)
        return self._key_map(self.model_args)

    def fit_to_file(self, stored: Shapes) -> None:
        """Before reading a file whose tensors have these shapes: a format whose files come in
        variants (OLMo Hybrid's, DeepSeek-V4's, Kimi Linear's) takes the file's."""
        self._stored = stored

    def hf_config(self) -> dict:
        """The config.json that `transformers` reads with this model's HF checkpoint."""
        if self.config_json is None:
            raise ValueError(f"this {self.format_name} adapter writes no config.json (build it "
                             "with titan_hybrid.hf.families.hybrid_state_dict_adapter)")
        return self.config_json(self.model_args)

    def get_hf_storage_reader(self, path: str, from_quantized: bool = False):
        if from_quantized:
            raise ValueError(f"checkpoint.initial_load_in_hf_quantized: {self.format_name} "
                             "checkpoints are read unquantized only")
        return HuggingFaceStorageReader(path)

    @property
    def fused_layouts(self) -> dict[str, TPLayout]:
        """The model's fused parameters' layouts (built once, from a model on the meta device)."""
        if self._layouts is None:
            self._layouts = _fused_layouts(self.model_args)
        return self._layouts

    def _plain_fused_parameters(self, state_dict: dict) -> None:
        """Note the fused parameters a plain state dict holds whole (the split state dict holds
        their components instead)."""
        self._plain_fused = [fqn for fqn in self.fused_layouts if fqn in state_dict]
        self._plain_values = {fqn: state_dict[fqn] for fqn in self._plain_fused}

    def _whole_fused(self, hf_key: str, keys: tuple[str, ...],
                     state_dict: dict) -> tuple[str, torch.Tensor] | None:
        """For components `keys` of a fused parameter that a plain state dict holds whole:
        (its fqn, it) when they are all of it in order (the HF tensor is the parameter itself:
        a load lands in it); else the parameter is split into its components, which replace
        it in `state_dict` (views: without TP its rows are the components end to end; a DTensor
        that FSDP shards splits as a DTensor, and from_hf joins the loaded pieces), and None,
        as when `keys` are not such components. ValueError when tensor parallelism splits the
        parameter (its rows are interleaved per rank), naming the HF tensor."""
        component = (self._component(keys[0], missing=None) if keys[0] not in state_dict
                     else None)
        if component is None or component[0] not in state_dict:
            return None
        fqn, layout, _ = component
        value = state_dict[fqn]
        if isinstance(value, DTensor) and _tp_sharded(value):
            whole_fused({fqn: value}, fqn, hf_key)  # raises, naming the HF tensor
        names = tuple(fqn + name for name in layout.partition_names)
        if keys == names:
            return fqn, value
        del state_dict[fqn]
        state_dict.update(zip(names, value.split(list(layout.partition_sizes),
                                                 dim=layout.shard_dim)))
        return None

    def to_hf(self, state_dict: dict) -> dict:
        """Our state dict as HF tensors; ValueError names an HF tensor of a held layer with no
        source, and a tensor of ours with no place in the format."""
        state_dict, self._physical = logical_keys(state_dict)  # a plain one's grouped layers
        self._plain_fused_parameters(state_dict)
        layers, used = held_layers(state_dict), set()
        hf_state_dict, self._handed_out = {}, {}
        for hf_key, ours in self.key_map().items():
            keys = sources(ours)
            whole = self._whole_fused(hf_key, keys, state_dict)
            if whole is not None:  # the parameter itself is the HF tensor
                parts, value = dict([whole]), whole[1]
            elif all(key in state_dict for key in keys):
                parts = {key: state_dict[key] for key in keys}
                value = self._value(ours, parts)
            else:
                check_present(state_dict, self._missing(keys, state_dict), hf_key, layers)
                continue
            used.update(parts)
            if value is None:
                continue
            hf_state_dict[hf_key] = value
            if not isinstance(ours, SharedCopy):
                self._handed_out[hf_key] = (value, parts)
        check_all_used(state_dict, used, "model tensor(s)", f"HF {self.format_name} format")
        return hf_state_dict

    def _missing(self, keys: tuple[str, ...], state_dict: dict) -> str:
        """The name of what a state dict lacks for an HF tensor: the fused parameter when it
        holds none of the parameter's components, else the first component missing."""
        component = self._component(keys[0], missing=None)
        if component is not None and not any(
                component[0] + name in state_dict for name in component[1].partition_names):
            return component[0]
        return next(key for key in keys if key not in state_dict)

    def _value(self, ours, parts: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The HF tensor of one key-map entry from our `parts` (None: this rank holds none of
        the expert)."""
        if isinstance(ours, ExpertSlice):
            return expert_slice(parts[ours.key], ours.expert)
        if isinstance(ours, SharedCopy):  # its own memory: a read of it is checked
            return parts[ours.key].detach().clone()
        if isinstance(ours, Reshaped):  # a view: a load lands in place
            return parts[ours.key].view(ours.hf_shape)
        if isinstance(ours, (tuple, RowPieces)):
            return self._rows(ours, parts)
        return parts[ours]

    def _pieces(self, ours: tuple[str, ...] | RowPieces) -> tuple[tuple[str, int, int], ...]:
        """(component, first row, row count) of each run of an HF tensor's rows, in order."""
        if isinstance(ours, RowPieces):
            return ours.pieces
        return tuple((key, 0, self._size(key)) for key in ours)

    def _size(self, key: str) -> int:
        _, layout, part = self._component(key)
        return layout.partition_sizes[layout.partition_names.index(part)]

    def _rows(self, ours: tuple[str, ...] | RowPieces,
              parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """The HF tensor made of `ours`'s rows of `parts` (whole components in a single
        process, or the ComponentChunks this rank holds): one view when the rows lie end to
        end in memory, else GatheredRows of the pieces this rank holds (views: a load lands in
        place; a write gathers the tensor when a rank may hold several pieces)."""
        pieces = self._pieces(ours)
        fqn, layout, _ = self._component(pieces[0][0])
        dim = layout.shard_dim
        chunks, rows, row = [], [], 0
        for key, first, count in pieces:
            part = parts[key]
            held = (part.chunks if isinstance(part, ComponentChunks)
                    else [(torch.Size([0] * part.dim()), part)])
            for offsets, view in held:
                lo = max(first, offsets[dim])
                hi = min(first + count, offsets[dim] + view.shape[dim])
                if lo < hi:
                    at = list(offsets)
                    at[dim] = row + lo - first
                    chunks.append((torch.Size(at), view.narrow(dim, lo - offsets[dim], hi - lo)))
            rows.append((self._offset(key) + first, count))
            row += count
        chunks = merged_chunks(chunks, dim)
        first_part = parts[pieces[0][0]]
        shape = list(first_part.shape)
        shape[dim] = row
        if isinstance(first_part, ComponentChunks):
            source, fused_key, tp_layout = (first_part.source, first_part.fused_key,
                                            first_part.tp_layout)
        elif len(chunks) == 1:
            return chunks[0][1]  # a view of the plain fused parameter
        else:
            source, fused_key, tp_layout = self._plain_values[fqn], fqn, None
        value = ComponentChunks(torch.Size(shape), chunks, source, fused_key, tp_layout)
        return GatheredRows(value, source, tuple(rows),
                            gather=isinstance(ours, RowPieces) or tp_degree(source) > 1)

    def _offset(self, key: str) -> int:
        """The first row of a component in its fused parameter."""
        _, layout, part = self._component(key)
        return sum(layout.partition_sizes[:layout.partition_names.index(part)])

    def from_hf(self, hf_state_dict: dict) -> dict:
        """Our state dict of HF tensors: the very entries to_hf handed out where a load
        filled them in place, else ours built from the HF tensors (stacked experts, joined
        components, our grouped sub-layers' own keys)."""
        key_map = self.key_map()
        check_all_used(hf_state_dict, set(key_map), "HF tensor(s)", "model")
        state_dict, experts = {}, {}
        runs: dict[str, list[tuple[int, torch.Tensor]]] = {}  # component -> (first row, rows)
        for hf_key, ours in key_map.items():
            if hf_key not in hf_state_dict:
                continue
            value = hf_state_dict[hf_key]
            handed_out = self._handed_out.get(hf_key)
            if isinstance(ours, SharedCopy):
                check_copy(hf_state_dict, hf_key, ours)
            elif handed_out is not None and handed_out[0] is value:
                state_dict.update(handed_out[1])  # loaded in place, through the views
            elif isinstance(ours, Reshaped):
                state_dict[ours.key] = value.reshape(-1)
            elif isinstance(ours, ExpertSlice):
                experts.setdefault(ours.key, {})[ours.expert] = value
            elif isinstance(ours, (tuple, RowPieces)):
                self._add_runs(runs, self._pieces(ours), value)
            else:
                state_dict[ours] = value
        for key, got in runs.items():  # the components of another state dict's tensors
            dim = self._component(key)[1].shard_dim
            got.sort(key=lambda run: run[0])
            state_dict[key] = got[0][1] if len(got) == 1 else torch.cat(
                [rows for _, rows in got], dim)
        for key, slices in experts.items():  # an HF state dict of its own: stacked
            state_dict[key] = torch.stack([slices[expert] for expert in sorted(slices)])
        for fqn in self._plain_fused:  # a plain state dict's fused parameters again
            layout = self.fused_layouts[fqn]
            names = [fqn + name for name in layout.partition_names]
            if all(name in state_dict for name in names):
                state_dict[fqn] = torch.cat([state_dict.pop(name) for name in names],
                                            dim=layout.shard_dim)
        return physical_keys(state_dict, self._physical)

    def _add_runs(self, runs: dict, pieces, value: torch.Tensor) -> None:
        """Each piece of an HF tensor of another state dict, as (first row, rows) of its
        component (a component may take rows from several HF tensors)."""
        dim = self._component(pieces[0][0])[1].shard_dim
        row = 0
        for key, first, count in pieces:
            runs.setdefault(key, []).append((first, value.narrow(dim, row, count)))
            row += count

    _NO_DEFAULT = object()

    def _component(self, key: str, missing=_NO_DEFAULT) -> tuple[str, TPLayout, str] | None:
        """(fused parameter, its layout, part name) of a component key; `missing` (else
        KeyError) for a key that is no component."""
        for fqn, layout in self.fused_layouts.items():
            part = key[len(fqn):]
            if key.startswith(fqn) and part in layout.partition_names:
                return fqn, layout, part
        if missing is self._NO_DEFAULT:
            raise KeyError(key)
        return missing

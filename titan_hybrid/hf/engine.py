"""The state-dict adapter of formats whose HF tensors are our tensors, our fused parameters'
components, runs of consecutive components, rows taken in turn from several components
(RowPieces: Qwen3-Next's in_proj_qkvz), or one expert's slice of our experts (Qwen3.5,
Qwen3-Next, Granite 4.0-H): a subclass gives the key map and its name.

It sees titan_hybrid's split state dict (fused parameters as components in global
coordinates: ComponentChunks, whose pieces a load fills in place) or a plain one (torchtitan's
own checkpointer, the conversions), whose fused parameters it splits into views of their
components first. An HF tensor made of several components is one view of them when their rows
lie end to end in memory, else GatheredRows of the pieces this rank holds, which a load (DCP's
HF reader, safetensors_io) fills in place and a write through DCP gathers where a rank may
hold several pieces (its HF writer keeps one per rank).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor

from titan_hybrid.checkpoint.split import ComponentChunks, GatheredRows, merged_chunks
from titan_hybrid.hf.adapter import (
    ExpertSlice,
    HFStateDictAdapter,
    check_all_used,
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


KeyMap = dict[str, str | tuple[str, ...] | RowPieces | ExpertSlice]


def sources(ours) -> tuple[str, ...]:
    """Our keys an HF tensor is made of (each once, in order)."""
    if isinstance(ours, ExpertSlice):
        return (ours.key,)
    if isinstance(ours, RowPieces):
        return tuple(dict.fromkeys(key for key, _, _ in ours.pieces))
    return ours if isinstance(ours, tuple) else (ours,)


def _fused_layouts(args: HybridModelArgs) -> dict[str, TPLayout]:
    """{fqn: TPLayout} of the model's fused parameters (their components' names and sizes)."""
    with torch.device("meta"):
        model = HybridModel(args)
    return {fqn: layout for fqn, layout in tensor_parallel_layouts(model).items()
            if layout.partition_names}


class ComponentsStateDictAdapter(HFStateDictAdapter):
    FORMAT_NAME: str

    @abstractmethod
    def key_map(self) -> KeyMap:
        """HF key -> our key (a fused parameter's component: `<fqn><part>`), the tuple of
        consecutive components an HF tensor is made of, its RowPieces, or one expert's
        slice."""

    def __init__(self, model_args: HybridModelArgs, hf_assets_path: str | None,
                 **options) -> None:
        super().__init__(model_args, hf_assets_path, **options)
        # HF key -> (the value handed out, {our key: what a load through it fills})
        self._handed_out: dict[str, tuple[torch.Tensor, dict]] = {}
        self._plain_fused: list[str] = []  # a plain state dict's fused keys, split by to_hf
        self._plain_values: dict[str, torch.Tensor] = {}  # and their values
        self._layouts: dict | None = None

    @property
    def fused_layouts(self) -> dict[str, TPLayout]:
        """The model's fused parameters' layouts (built once, from a model on the meta device)."""
        if self._layouts is None:
            self._layouts = _fused_layouts(self.model_args)
        return self._layouts

    def _components(self, state_dict: dict) -> dict:
        """A plain state dict's fused parameters as their components (views: without TP the
        rows are the components end to end); the split state dict as it is."""
        out, self._plain_fused, self._plain_values = dict(state_dict), [], {}
        for fqn, layout in self.fused_layouts.items():
            if fqn not in out:
                continue
            value = whole_fused(out, fqn, fqn)
            if isinstance(value, DTensor):
                raise ValueError(f"'{fqn}' is a sharded parameter of a plain state dict; read "
                                 "or write HF checkpoints of this model through titan_hybrid's "
                                 "trainer or `python -m titan_hybrid.hf`")
            del out[fqn]
            pieces = value.split(list(layout.partition_sizes), dim=layout.shard_dim)
            out.update({fqn + name: piece
                        for name, piece in zip(layout.partition_names, pieces)})
            self._plain_fused.append(fqn)
            self._plain_values[fqn] = value
        return out

    def to_hf(self, state_dict: dict) -> dict:
        state_dict = self._components(state_dict)
        layers, used = held_layers(state_dict), set()
        hf_state_dict, self._handed_out = {}, {}
        for hf_key, ours in self.key_map().items():
            keys = sources(ours)
            if not all(key in state_dict for key in keys):
                check_present(state_dict, keys[0], hf_key, layers)
                continue
            used.update(keys)
            parts = {key: state_dict[key] for key in keys}
            if isinstance(ours, ExpertSlice):
                value = expert_slice(parts[ours.key], ours.expert)
                if value is None:
                    continue
            elif isinstance(ours, (tuple, RowPieces)):
                value = self._rows(ours, parts)
            else:
                value = parts[ours]
            hf_state_dict[hf_key] = value
            self._handed_out[hf_key] = (value, parts)
        check_all_used(state_dict, used, "model tensor(s)", f"HF {self.FORMAT_NAME} format")
        return hf_state_dict

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
        key_map = self.key_map()
        check_all_used(hf_state_dict, set(key_map), "HF tensor(s)", "model")
        state_dict, experts = {}, {}
        runs: dict[str, list[tuple[int, torch.Tensor]]] = {}  # component -> (first row, rows)
        for hf_key, ours in key_map.items():
            if hf_key not in hf_state_dict:
                continue
            value = hf_state_dict[hf_key]
            handed_out = self._handed_out.get(hf_key)
            if handed_out is not None and handed_out[0] is value:
                state_dict.update(handed_out[1])  # loaded in place, through the views
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
        return state_dict

    def _add_runs(self, runs: dict, pieces, value: torch.Tensor) -> None:
        """Each piece of an HF tensor of another state dict, as (first row, rows) of its
        component (a component may take rows from several HF tensors)."""
        dim = self._component(pieces[0][0])[1].shard_dim
        row = 0
        for key, first, count in pieces:
            runs.setdefault(key, []).append((first, value.narrow(dim, row, count)))
            row += count

    def _component(self, key: str) -> tuple[str, TPLayout, str]:
        """(fused parameter, its layout, part name) of a component key."""
        for fqn, layout in self.fused_layouts.items():
            part = key[len(fqn):]
            if key.startswith(fqn) and part in layout.partition_names:
                return fqn, layout, part
        raise KeyError(key)

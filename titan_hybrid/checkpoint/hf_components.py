"""The state-dict adapter of formats whose HF tensors are our tensors, our fused parameters'
components, runs of consecutive components, or one expert's slice of our experts (Qwen3.5,
Granite 4.0-H): a subclass gives the key map and its name.

It sees titan_hybrid's split state dict (fused parameters as components in global
coordinates: ComponentChunks, whose pieces a load fills in place) or a plain one (torchtitan's
own checkpointer, the conversions), whose fused parameters it splits into views of their
components first. An HF tensor made of several components is one view of them (concatenated
pieces for ComponentChunks): under tensor parallelism such a tensor would be pieces of several
components per rank, which DCP's HF writer cannot hold, so it is refused by name.
"""

from __future__ import annotations

from abc import abstractmethod

import torch
from torch.distributed.tensor import DTensor

from titan_hybrid.checkpoint.hf_adapter import (
    ExpertSlice,
    HFStateDictAdapter,
    check_all_used,
    check_present,
    expert_slice,
    held_layers,
    whole_fused,
)
from titan_hybrid.checkpoint.split import ComponentChunks, concat_components
from titan_hybrid.model.args import HybridModelArgs
from titan_hybrid.model.common import TPLayout, tensor_parallel_layouts
from titan_hybrid.model.model import HybridModel
from titan_hybrid.parallel.tensor_parallel import tp_degree


def _fused_layouts(args: HybridModelArgs) -> dict[str, TPLayout]:
    """{fqn: TPLayout} of the model's fused parameters (their components' names and sizes)."""
    with torch.device("meta"):
        model = HybridModel(args)
    return {fqn: layout for fqn, layout in tensor_parallel_layouts(model).items()
            if layout.partition_names}


class ComponentsStateDictAdapter(HFStateDictAdapter):
    FORMAT_NAME: str

    @abstractmethod
    def key_map(self) -> dict[str, str | tuple[str, ...] | ExpertSlice]:
        """HF key -> our key (a fused parameter's component: `<fqn><part>`), the tuple of
        consecutive components an HF tensor is made of, or one expert's slice."""

    def __init__(self, model_args: HybridModelArgs, hf_assets_path: str | None) -> None:
        super().__init__(model_args, hf_assets_path)
        # HF key -> (the value handed out, {our key: what a load through it fills})
        self._handed_out: dict[str, tuple[torch.Tensor, dict]] = {}
        self._plain_fused: list[str] = []  # a plain state dict's fused keys, split by to_hf
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
        out, self._plain_fused = dict(state_dict), []
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
        return out

    def to_hf(self, state_dict: dict) -> dict:
        state_dict = self._components(state_dict)
        layers, used = held_layers(state_dict), set()
        hf_state_dict, self._handed_out = {}, {}
        for hf_key, ours in self.key_map().items():
            keys = (ours.key,) if isinstance(ours, ExpertSlice) else (
                ours if isinstance(ours, tuple) else (ours,))
            if not all(key in state_dict for key in keys):
                check_present(state_dict, keys[0], hf_key, layers)
                continue
            used.update(keys)
            parts = [state_dict[key] for key in keys]
            if isinstance(ours, ExpertSlice):
                value = expert_slice(parts[0], ours.expert, hf_key)
                if value is None:
                    continue
            elif isinstance(ours, tuple):
                value = self._joined(parts, self._component(keys[0])[1].shard_dim, hf_key)
            else:
                value = parts[0]
            hf_state_dict[hf_key] = value
            self._handed_out[hf_key] = (value, dict(zip(keys, parts)))
        check_all_used(state_dict, used, "model tensor(s)", f"HF {self.FORMAT_NAME} format")
        return hf_state_dict

    @staticmethod
    def _joined(parts: list[torch.Tensor], dim: int, hf_key: str) -> torch.Tensor:
        """An HF tensor made of consecutive components along `dim`, as one view (a load
        lands in place)."""
        if all(isinstance(part, ComponentChunks) for part in parts):
            if tp_degree(parts[0].source) > 1:
                raise ValueError(f"HF tensor '{hf_key}' is split by tensor parallelism into "
                                 "pieces of several components; read or write HF checkpoints "
                                 "of this model without TP")
            return concat_components(parts, dim=dim)
        first = parts[0]
        shape = list(first.shape)
        shape[dim] = sum(part.shape[dim] for part in parts)
        return first.as_strided(shape, first.stride(), first.storage_offset())

    def from_hf(self, hf_state_dict: dict) -> dict:
        key_map = self.key_map()
        check_all_used(hf_state_dict, set(key_map), "HF tensor(s)", "model")
        state_dict, experts = {}, {}
        for hf_key, ours in key_map.items():
            if hf_key not in hf_state_dict:
                continue
            value = hf_state_dict[hf_key]
            handed_out = self._handed_out.get(hf_key)
            if handed_out is not None and handed_out[0] is value:
                state_dict.update(handed_out[1])  # loaded in place, through the views
            elif isinstance(ours, ExpertSlice):
                experts.setdefault(ours.key, {})[ours.expert] = value
            elif isinstance(ours, tuple):
                components = [self._component(key) for key in ours]
                sizes = [layout.partition_sizes[layout.partition_names.index(part)]
                         for _, layout, part in components]
                state_dict.update(zip(ours, value.split(sizes, dim=components[0][1].shard_dim)))
            else:
                state_dict[ours] = value
        for key, slices in experts.items():  # an HF state dict of its own: stacked
            state_dict[key] = torch.stack([slices[expert] for expert in sorted(slices)])
        for fqn in self._plain_fused:  # a plain state dict's fused parameters again
            layout = self.fused_layouts[fqn]
            names = [fqn + name for name in layout.partition_names]
            if all(name in state_dict for name in names):
                state_dict[fqn] = torch.cat([state_dict.pop(name) for name in names],
                                            dim=layout.shard_dim)
        return state_dict

    def _component(self, key: str) -> tuple[str, TPLayout, str]:
        """(fused parameter, its layout, part name) of a component key."""
        for fqn, layout in self.fused_layouts.items():
            part = key[len(fqn):]
            if key.startswith(fqn) and part in layout.partition_names:
                return fqn, layout, part
        raise KeyError(key)

"""Fused tensors checkpointed as their logical components, in global coordinates.

Under tensor parallelism a fused tensor's global (DTensor) view is the per-rank concatenation
[W_0; V_0; W_1; V_1]; saving that would tie the checkpoint to the TP size. Instead every fused
parameter (and each optimizer state of it) is saved as one DCP entry per component, e.g.
`layers.1.mlp.fc1.weight_w` / `_v`, `layers.0.mamba.in_proj.weight.z` / `.x` / `.B` / `.C` /
`.dt`, each in the component's own global coordinates, whatever the TP / FSDP layout.

No rank gathers anything: each rank describes the pieces of its local tensor as chunks of the
components (offsets computed from the parameter's GLOBAL shape and this rank's global offsets,
never from the local tensor's size), and DCP writes or reads exactly those chunks. The chunks
are views of the local tensor, so a load lands in place. An optimizer state may also arrive as
a plain tensor holding this rank's shard of a DTensor parameter's state; it is placed by its
parameter's global shape and placements (`local_placement`), never by its own size, which
describes only the shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from titan_hybrid.compat.dcp import Chunk, ChunkedTensor, shard_shape_and_offsets
from titan_hybrid.parallel.tensor_parallel import TPLayout, deinterleave_from_tp, tp_degree


class ComponentChunks(ChunkedTensor):
    """The pieces of one component's global tensor that this rank holds, which DCP writes and
    reads in place (compat.dcp.ChunkedTensor). `source` is the fused value (DTensor or tensor)
    whose local tensor the pieces (offsets in the component's global coordinates, views) come
    from."""

    source: torch.Tensor
    fused_key: str  # the state-dict key of `source`
    tp_layout: TPLayout | None  # of `source`, when it is a fused parameter-shaped value

    @staticmethod
    def __new__(cls, global_shape: torch.Size, chunks, source: torch.Tensor, fused_key: str = "",
                tp_layout: TPLayout | None = None):
        local = source.to_local() if isinstance(source, DTensor) else source
        wrapper = cls.make(global_shape, like=local)
        wrapper.chunks, wrapper.source, wrapper.fused_key = chunks, source, fused_key
        wrapper.tp_layout = tp_layout
        return wrapper

    def cast(self, **to_kwargs) -> ComponentChunks:
        """torchtitan casts a model-only export (checkpoint.export_dtype): cast each piece."""
        chunks = [(offsets, view.to(**to_kwargs)) for offsets, view in self.chunks]
        return type(self)(self.shape, chunks, self.source, self.fused_key, self.tp_layout)

    def __repr__(self) -> str:
        return f"ComponentChunks(shape={tuple(self.shape)}, chunks={len(self.chunks)})"


def local_placement(value: torch.Tensor, reference: torch.Tensor | None):
    """(local tensor, global shape, this rank's global offsets) of a parameter-shaped value.

    A DTensor knows its own placement. A plain tensor is either the whole global tensor (single
    process) or, when its parameter is a DTensor, this rank's shard of it: its place comes from
    the PARAMETER's global shape and placements, not from its own size.
    """
    if isinstance(value, DTensor):
        reference, value = value, value.to_local()
    if isinstance(reference, DTensor):
        sizes, offsets = shard_shape_and_offsets(reference)
        if tuple(sizes) != tuple(value.shape):
            raise ValueError(f"local tensor of shape {tuple(value.shape)} does not match its "
                             f"parameter's shard {tuple(sizes)} of {tuple(reference.shape)}")
        return value, torch.Size(reference.shape), torch.Size(offsets)
    return value, value.shape, torch.Size([0] * value.dim())


def split_components(key: str, value: torch.Tensor, layout: TPLayout,
                     reference: torch.Tensor | None) -> dict[str, ComponentChunks]:
    """Component entries (key + suffix -> chunks) for a fused parameter-shaped value."""
    local, global_shape, offsets = local_placement(value, reference)
    tp = tp_degree(reference if reference is not None else value)
    dim = layout.shard_dim
    local_sizes = [size // tp for size in layout.partition_sizes]
    block = sum(local_sizes)
    start, length = offsets[dim], local.shape[dim]
    entries = {}
    for index, (name, size) in enumerate(zip(layout.partition_names, layout.partition_sizes)):
        chunks = []
        for rank in range(tp):
            # Component `index` of TP rank `rank` sits here in the interleaved global view.
            lo = rank * block + sum(local_sizes[:index])
            hi = lo + local_sizes[index]
            overlap_lo, overlap_hi = max(lo, start), min(hi, start + length)
            if overlap_lo >= overlap_hi:
                continue
            view = local.narrow(dim, overlap_lo - start, overlap_hi - overlap_lo)
            component_offsets = list(offsets)
            component_offsets[dim] = rank * local_sizes[index] + overlap_lo - lo
            chunks.append((torch.Size(component_offsets), view))
        shape = list(global_shape)
        shape[dim] = size
        entries[key + name] = ComponentChunks(torch.Size(shape), chunks, value, tp_layout=layout)
    return entries


def split_state_dict(state_dict: dict, fused: dict[str, tuple[TPLayout, torch.Tensor]],
                     key_of=lambda key: ("", key, "")) -> dict:
    """Replace every fused entry by its components. `key_of(key)` -> (head, parameter fqn,
    tail), e.g. ("state.", "layers.1.mlp.fc1.weight", ".exp_avg") for an optimizer state; a
    component's key is head + fqn + component suffix + tail."""
    out = {}
    for key, value in state_dict.items():
        head, fqn, tail = key_of(key)
        if fqn in fused and isinstance(value, torch.Tensor) and value.dim() > 0:
            layout, param = fused[fqn]
            for name, chunks in split_components(fqn, value, layout, param).items():
                chunks.fused_key = key
                out[head + name + tail] = chunks
        else:
            out[key] = value
    return out


def merge_state_dict(state_dict: dict) -> dict:
    """Undo split_state_dict after an in-place load: each group of components becomes its
    fused value again (the pieces were views of it, so it holds the loaded data)."""
    return {(value.fused_key if isinstance(value, ComponentChunks) else key):
            (value.source if isinstance(value, ComponentChunks) else value)
            for key, value in state_dict.items()}


def _adjacent(first: tuple[torch.Size, torch.Tensor], second: tuple[torch.Size, torch.Tensor],
              dim: int) -> bool:
    """Whether `second` continues `first` along `dim`, globally and in memory."""
    (offsets_a, a), (offsets_b, b) = first, second
    expected = list(offsets_a)
    expected[dim] += a.shape[dim]
    return (list(offsets_b) == expected and a.stride() == b.stride()
            and a.shape[:dim] + a.shape[dim + 1:] == b.shape[:dim] + b.shape[dim + 1:]
            and b.data_ptr() == a.data_ptr() + a.shape[dim] * a.stride(dim) * a.element_size())


def merged_chunks(chunks: list[Chunk], dim: int) -> list[Chunk]:
    """`chunks` (global offsets, views) with each run that continues itself along `dim`,
    globally and in memory, made one view."""
    merged: list[Chunk] = []
    for piece in chunks:
        if merged and _adjacent(merged[-1], piece, dim):
            previous_offsets, previous = merged.pop()
            view = piece[1]
            piece = (previous_offsets, previous.as_strided(
                previous.shape[:dim] + (previous.shape[dim] + view.shape[dim],)
                + previous.shape[dim + 1:], previous.stride(), previous.storage_offset()))
        merged.append(piece)
    return merged


class GatheredRows(ComponentChunks):
    """An HF tensor made of runs of one fused parameter's rows (Mamba2's in_proj, Qwen3.5's
    in_proj_qkv, Qwen3-Next's in_proj_qkvz). Reading lands in place through the pieces. DCP's
    HF writer keeps one piece of a tensor per rank and drops the others, so when a rank's pieces
    can be several (`gather`: under TP, whose ranks hold slices of every component, or when the
    rows come in turn from several components) the HF tensor is gathered for writing, one at a
    time, and each rank writes an even block of its rows. Whether to gather depends on the
    layout and the format alone, never on a rank's own pieces, so that every rank takes part in
    the same collectives."""

    rows: tuple[tuple[int, int], ...]  # (first row in the fused [A; B; ...] order, count)
    gather: bool

    @staticmethod
    def __new__(cls, value: ComponentChunks, source: torch.Tensor,
                rows: tuple[tuple[int, int], ...], gather: bool):
        """`value`'s pieces, with `source` (the fused parameter) and the HF tensor's rows."""
        self = ComponentChunks.__new__(cls, value.shape, value.chunks, source, value.fused_key,
                                       value.tp_layout)
        self.rows, self.gather = rows, gather
        return self

    def cast(self, **to_kwargs) -> GatheredRows:
        pieces = ComponentChunks(self.shape, self.chunks, self.source, self.fused_key,
                                 self.tp_layout).cast(**to_kwargs)
        return GatheredRows(pieces, self.source, self.rows, self.gather)

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        if not self.gather:
            return super().__create_write_items__(fqn, obj)
        full = self.source.full_tensor() if isinstance(self.source, DTensor) else self.source
        if self.tp_layout is not None:
            full = deinterleave_from_tp(full, self.tp_layout, tp_degree(self.source))
        whole = torch.cat([full.narrow(0, first, count) for first, count in self.rows])
        rank, world = ((dist.get_rank(), dist.get_world_size()) if dist.is_initialized()
                       else (0, 1))
        block = -(-whole.shape[0] // world)
        rows = whole[rank * block:(rank + 1) * block].to(self.dtype).clone()
        if rows.shape[0] == 0:
            return []
        offsets = torch.Size([rank * block] + [0] * (whole.dim() - 1))
        self._write_piece = (offsets, rows)
        return [WriteItem(
            index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=offsets, sizes=rows.shape),
                properties=TensorProperties.create_from_tensor(rows), size=self.shape))]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        piece = getattr(self, "_write_piece", None)
        if piece is not None and piece[0] == index.offset:
            return piece[1]
        return super().__get_tensor_shard__(index)


def check_writable(hf_state_dict: dict) -> None:
    """DCP's HF writer keeps one piece of each tensor per rank and drops the others: an HF
    tensor this rank holds as several pieces, and would not gather, is an error naming it,
    before anything is written."""
    for hf_key, value in hf_state_dict.items():
        if (isinstance(value, ComponentChunks) and len(value.chunks) > 1
                and not (isinstance(value, GatheredRows) and value.gather)):
            raise ValueError(f"HF tensor '{hf_key}' is {len(value.chunks)} pieces on this "
                             "rank, and DCP's HF writer keeps one")

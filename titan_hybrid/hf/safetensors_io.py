"""Reading and writing safetensors files one tensor at a time, straight between the file and
the model's own tensors.

The format (huggingface/safetensors): an 8-byte little-endian header length, a JSON header
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the
tensors' bytes (offsets relative to the end of the header). The library's loaders read through
a memory map, whose pages count as the process's memory once touched, and copy each tensor
once more; its writer builds each file's bytes in memory. Here a tensor is read into its
place in the model (`readinto`) and written from it, so a conversion holds the model and at
most one tensor besides. An HF tensor whose rows come in turn from several of the model's
tensors (ChunkedTensor: Qwen3-Next's in_proj_qkvz) is read and written run by run.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from titan_hybrid.compat.dcp import ChunkedTensor

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
          "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
METADATA = "__metadata__"
WEIGHTS_INDEX = "model.safetensors.index.json"


def _bytes_of(tensor: torch.Tensor):
    """A writable byte view of a contiguous tensor's memory (numpy, which file I/O takes)."""
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


def folder_files(folder: Path) -> dict[str, Path]:
    """{tensor name: its safetensors file} of a folder (with or without an index)."""
    index = folder / WEIGHTS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {key: folder / file for key, file in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"'{folder}' holds no *.safetensors files")
    return {key: file for file in files for key in tensor_entries(file)}


def read_header(file: Path) -> tuple[dict, int]:
    """({name: entry} without the metadata, the offset where the data starts)."""
    with open(file, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(length))
    header.pop(METADATA, None)
    return header, 8 + length


def tensor_entries(file: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """{name: (dtype, shape)} of a file's tensors."""
    header, _ = read_header(file)
    entries = {}
    for name, entry in header.items():
        if entry["dtype"] not in DTYPES:
            raise ValueError(f"'{file}': tensor '{name}' has dtype {entry['dtype']}, which "
                             f"titan_hybrid does not read ({', '.join(DTYPES)})")
        entries[name] = (DTYPES[entry["dtype"]], tuple(entry["shape"]))
    return entries


def row_runs(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensor as runs of whole rows in order: itself, or a ChunkedTensor's chunks, which
    must tile it along dim 0."""
    if not isinstance(tensor, ChunkedTensor):
        return [tensor]
    runs, row = [], 0
    for offsets, view in sorted(tensor.chunks, key=lambda chunk: chunk[0][0]):
        if (offsets[0] != row or any(offsets[1:])
                or tuple(view.shape[1:]) != tuple(tensor.shape[1:])):
            raise ValueError(f"pieces of shape {tuple(view.shape)} at {tuple(offsets)} do not "
                             f"tile a tensor of shape {tuple(tensor.shape)} by rows")
        runs.append(view)
        row += view.shape[0]
    if row != tensor.shape[0]:
        raise ValueError(f"pieces cover {row} of the {tensor.shape[0]} rows of a tensor")
    return runs


def _read_exactly(handle, view, what: str) -> None:
    read = 0
    while read < view.nbytes:  # readinto may return less than asked
        count = handle.readinto(view[read:])
        if not count:
            raise ValueError(f"{what} ends early")
        read += count


def read_into(file: Path, targets: dict[str, torch.Tensor],
              done: Callable[[torch.Tensor], None] = lambda tensor: None) -> None:
    """Fill targets[name] (any dtype: the stored values are cast) with each tensor of the
    file, in file order, run of rows by run; `done(target)` after each."""
    header, start = read_header(file)
    with open(file, "rb", buffering=0) as handle, torch.no_grad():
        for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            target = targets[name]
            begin, end = entry["data_offsets"]
            stored = DTYPES[entry["dtype"]]
            expected = target.numel() * stored.itemsize
            if expected != end - begin:
                raise ValueError(f"'{file}': tensor '{name}' holds {end - begin} bytes, "
                                 f"{expected} expected for {tuple(entry['shape'])} "
                                 f"{entry['dtype']}")
            handle.seek(start + begin)
            for run in row_runs(target):
                place = (run if run.dtype == stored and run.is_contiguous()
                         else torch.empty(tuple(run.shape), dtype=stored))
                _read_exactly(handle, _bytes_of(place), f"'{file}' inside tensor '{name}'")
                if place is not run:
                    run.copy_(place)
            done(target)


def write(file: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None,
          done: Callable[[torch.Tensor], None] = lambda tensor: None) -> None:
    """One safetensors file from `tensors`, each written from its own memory (a
    non-contiguous one through a contiguous copy, one at a time)."""
    header, offset = {}, 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header[METADATA] = metadata
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(file, "wb") as handle:
        handle.write(len(encoded).to_bytes(8, "little"))
        handle.write(encoded)
        for tensor in tensors.values():
            for run in row_runs(tensor):
                handle.write(_bytes_of(run.detach().contiguous()))
            done(tensor)


def shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> Iterator[dict]:
    """Consecutive groups of `tensors` of at most `max_bytes` each (one larger tensor alone)."""
    shard, size = {}, 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > max_bytes:
            yield shard
            shard, size = {}, 0
        shard[name] = tensor
        size += nbytes
    if shard:
        yield shard

"""Reading and writing safetensors files one tensor at a time, straight between the file and
the model's own tensors.

The format (huggingface/safetensors): an 8-byte little-endian header length, a JSON header
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the
tensors' bytes (offsets relative to the end of the header). The library's loaders read through
a memory map, whose pages count as the process's memory once touched, and copy each tensor
once more; its writer builds each file's bytes in memory. Here a tensor is read into its
place in the model (`readinto`) and written from it, so a conversion holds the model and at
most one tensor besides.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
          "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
METADATA = "__metadata__"


def _bytes_of(tensor: torch.Tensor):
    """A writable byte view of a contiguous tensor's memory (numpy, which file I/O takes)."""
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


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


def read_into(file: Path, targets: dict[str, torch.Tensor],
              done: Callable[[torch.Tensor], None] = lambda tensor: None) -> None:
    """Fill targets[name] (any dtype: the stored values are cast) with each tensor of the
    file, in file order; `done(target)` after each."""
    header, start = read_header(file)
    with open(file, "rb", buffering=0) as handle, torch.no_grad():
        for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            target = targets[name]
            begin, end = entry["data_offsets"]
            handle.seek(start + begin)
            stored = DTYPES[entry["dtype"]]
            place = (target if target.dtype == stored and target.is_contiguous()
                     else torch.empty(tuple(entry["shape"]), dtype=stored))
            view = _bytes_of(place)
            if view.nbytes != end - begin:
                raise ValueError(f"'{file}': tensor '{name}' holds {end - begin} bytes, "
                                 f"{view.nbytes} expected for {tuple(entry['shape'])} "
                                 f"{entry['dtype']}")
            read = 0
            while read < view.nbytes:  # readinto may return less than asked
                count = handle.readinto(view[read:])
                if not count:
                    raise ValueError(f"'{file}' ends inside tensor '{name}'")
                read += count
            if place is not target:
                target.copy_(place.view(target.shape))
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
            handle.write(_bytes_of(tensor.detach().contiguous()))
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

"""Distributed checkpoint internals: tensors that DCP saves and loads chunk by chunk.

Checked on torch 2.11, 2.13, 2.14 and 2.15 (the same DCP protocol, write-item types and
shard-offset function in all of them); `background_stager` takes a path of its own on 2.11.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor

# Private module: where a DTensor's local shard sits in the global tensor. DTensor exposes its
# global shape and placements publicly but not its shard's global offsets; this is the function
# DTensor's own checkpointing uses, so the offsets match what DCP writes for DTensors.
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from titan_hybrid.compat import TORCH_RELEASE

# `Tensor.to(dtype)` reaches __torch_dispatch__ as this Core ATen IR operator (the leading
# underscore is its ATen name, not a sign of a private Python API).
_TO_COPY = torch.ops.aten._to_copy.default

Chunk = tuple[torch.Size, torch.Tensor]  # (global offsets, a view holding the chunk's values)


def shard_shape_and_offsets(dtensor: DTensor) -> tuple[torch.Size, torch.Size]:
    """(shape, global offsets) of this rank's shard of `dtensor`."""
    shape, offsets = compute_local_shape_and_global_offset(
        dtensor.shape, dtensor.device_mesh, dtensor.placements)
    return torch.Size(shape), torch.Size(offsets)


class ChunkedTensor(torch.Tensor):
    """A data-less tensor of a global shape whose values this rank holds as `chunks`, which DCP
    writes and reads in place, chunk by chunk, as it does a DTensor's shard.

    Private protocol: DCP checks a tensor for `__create_write_items__`, `__create_chunk_list__`
    and `__get_tensor_shard__` (torch.distributed.checkpoint.planner_helpers / utils), the
    checkpointing protocol DTensor implements; it is not documented as public, and it is the
    only way to give DCP pieces that are not a DTensor's one shard. The wrapper itself is made
    with the private `torch.Tensor._make_wrapper_subclass`, which is how every tensor subclass
    without storage is made (there is no public constructor for one).

    Subclasses set `chunks` and implement `cast(**to_kwargs)` (the result of `.to(dtype)`).
    """

    chunks: list[Chunk]

    @classmethod
    def make(cls, global_shape: torch.Size, like: torch.Tensor) -> ChunkedTensor:
        """An empty instance with `like`'s dtype and device (for the subclass's __new__)."""
        return torch.Tensor._make_wrapper_subclass(cls, global_shape, dtype=like.dtype,
                                                   device=like.device)

    def cast(self, **to_kwargs) -> ChunkedTensor:
        raise NotImplementedError

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return args[0]
        if func is _TO_COPY:  # torchtitan casts a model-only export (checkpoint.export_dtype)
            return args[0].cast(**(kwargs or {}))
        if func is torch.ops.aten.new_empty.default:
            # DCP's async stager (torch.distributed.checkpoint._state_dict_stager) copies a
            # tensor subclass as `new_empty(size, device="cpu")` and then copies its __dict__
            # (here: the chunks' views, staged to host memory, and their source).
            self, size = args[0], args[1]
            kwargs = kwargs or {}
            return torch.Tensor._make_wrapper_subclass(
                type(self), size, dtype=kwargs.get("dtype") or self.dtype,
                device=kwargs.get("device") or self.device)
        raise NotImplementedError(f"{func} on {cls.__name__}: it only carries chunks")

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=view.shape),
                    properties=TensorProperties.create_from_tensor(view),
                    size=self.shape,
                ),
            )
            for offsets, view in self.chunks
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=o, sizes=v.shape) for o, v in self.chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, view in self.chunks:
            if offsets == index.offset:
                return view
        raise ValueError(f"no chunk at offset {index.offset} for {index.fqn}")


def files_written_by(folder: Path, rank: int) -> list[str]:
    """The data files that DCP's FileSystemWriter wrote for `rank` (the rank in the save's
    process group) in `folder`: it names them `__{rank}_{n}.distcp` (private naming,
    torch.distributed.checkpoint.filesystem, the same in torch 2.11 and 2.13-2.15)."""
    return sorted(path.name for path in folder.glob(f"__{rank}_*.distcp"))


class _StagerKeepingItsBuffers(DefaultStager):
    """torch 2.11's (and 2.12's) DefaultStager: the same copy, without the `close()` of its
    StateDictStager after every save. That close (a fix for a reference cycle, gone in 2.13)
    drops the host buffers kept for the next save and clears the stager's deepcopy dispatch
    table, so the second save fails with `KeyError: <class 'type'>`. Private: `_stage` is the
    method DefaultStager runs on its thread, and `_state_dict_stager` its StateDictStager; this
    stager keeps both for its whole life (the cycle is harmless: they live as long as it does).
    """

    def _stage(self, state_dict, **kwargs):
        assert not self._config.use_non_blocking_copy, "only blocking copies are kept here"
        return self._state_dict_stager.stage(state_dict, non_blocking=False)


class _CudaStreamStager(DefaultStager):
    """CUDA: the copies to host memory are issued from the training thread, non-blocking, on a
    stream of their own, into pinned buffers kept from one save to the next. The copy stream
    first waits for the compute stream (the weights of the step just taken). `copies_done` is an
    event recorded after the copies: the optimizer step waits on it on the GPU (`gpu_wait`),
    the writer thread on the CPU (the future `stage` returns). Private: `_state_dict_stager`,
    DefaultStager's StateDictStager, which copies any state dict (DTensors, the chunked tensors
    above) and keeps its buffers; DefaultStager itself waits for the copies on a thread."""

    def __init__(self) -> None:
        super().__init__(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                        use_async_staging=False, use_non_blocking_copy=True))
        self.copy_stream = torch.cuda.Stream()
        self.copies_done: torch.cuda.Event | None = None

    def stage(self, state_dict, **kwargs) -> Future:
        self.copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.copy_stream):
            staged = self._state_dict_stager.stage(state_dict, non_blocking=True)
        done = self.copies_done = torch.cuda.Event()
        done.record(self.copy_stream)
        future: Future = Future()
        threading.Thread(target=lambda: (done.synchronize(), future.set_result(staged)),
                         name="titan_hybrid_staging_done", daemon=True).start()
        return future


class _GpuOrderedWait:
    """torchtitan's train step calls `result()` on the staging future before the optimizer
    step; on CUDA that makes the compute stream wait for the copies, and the training thread
    goes on at once."""

    def __init__(self, copies_done) -> None:
        self.copies_done = copies_done

    def result(self) -> None:
        torch.cuda.current_stream().wait_event(self.copies_done)


def background_stager() -> DefaultStager:
    """DCP's stager for `async_save`. On CUDA: `_CudaStreamStager`. Otherwise a copy to host
    memory on a thread of its own, into pageable buffers it keeps from one save to the next
    (blocking copies)."""
    if torch.cuda.is_available():
        return _CudaStreamStager()
    options = StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                             use_async_staging=True, use_non_blocking_copy=False)
    return (_StagerKeepingItsBuffers if TORCH_RELEASE < (2, 13) else DefaultStager)(options)


def wait_before_the_optimizer(stager: DefaultStager, staging: Future):
    """What the train step waits on before the optimizer changes the weights: the GPU-side wait
    for a CUDA stager's copies, else the staging future itself."""
    if isinstance(stager, _CudaStreamStager):
        return _GpuOrderedWait(stager.copies_done)
    return staging

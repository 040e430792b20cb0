"""Worker for test_checkpoint_split.py (torchrun): splits a TP(+FSDP)-sharded fused tensor into
components, from a DTensor and from the plain local tensor, and checks every component against
the logical tensor. Prints `RESULT ok` on rank 0."""

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from titan_hybrid.checkpoint.split import split_components
from titan_hybrid.parallel.tensor_parallel import TPLayout, interleave_for_tp


def assemble(chunks_per_rank, shape):
    full = torch.full(shape, float("nan"))
    for chunks in chunks_per_rank:
        for offsets, data in chunks:
            index = tuple(slice(o, o + s) for o, s in zip(offsets, data.shape))
            full[index] = data
    return full


def main():
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    dp = world // 2
    layout = TPLayout(0, (8, 8, 4), partition_names=(".a", ".b", ".c"))
    logical = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    global_view = interleave_for_tp(logical, layout, 2)
    if dp > 1:
        mesh = init_device_mesh("cpu", (dp, 2), mesh_dim_names=("dp", "tp"))
        placements = [_StridedShard(0, split_factor=2), Shard(0)]
    else:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        placements = [Shard(0)]
    param = distribute_tensor(global_view, mesh, placements, src_data_rank=None)
    as_dtensor = split_components("w", param, layout, param)
    # An optimizer state that arrives as a plain local tensor (no DTensor wrapper).
    as_plain = split_components("w", param.to_local().clone(), layout, param)
    for name, size in zip(layout.partition_names, layout.partition_sizes):
        for entries in (as_dtensor, as_plain):
            component = entries["w" + name]
            assert tuple(component.shape) == (size, 3)
            gathered = [None] * world
            dist.all_gather_object(gathered, [(tuple(o), v) for o, v in component.chunks])
            start = sum(layout.partition_sizes[:layout.partition_names.index(name)])
            torch.testing.assert_close(assemble(gathered, (size, 3)), logical[start:start + size],
                                       rtol=0, atol=0)
    if dist.get_rank() == 0:
        print("RESULT ok", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()

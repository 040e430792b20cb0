"""Worker for test_compile.py and test_collectives.py, run under torchrun: the differentiable
collectives of context and expert parallelism (parallel/collectives.py).

Default: each inside a function compiled with `fullgraph=True` (aot_eager), against the same
function run eagerly: outputs and the gradients of both inputs, bitwise. Even blocks, uneven
splits and the gather. Per case, whether output and gradients are equal, and the largest
gradient magnitude (a backward that lost the exchange returns zeros).

`--gather`: the gather's output and input gradient against every rank's blocks and weights
(each rank can make them all), the bytes `record_traffic` counts in the forward and the
backward, and how many fresh tensors of the output's size the gather's forward allocates.

Prints one line `RESULT {json}` on rank 0.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from titan_hybrid.parallel.collectives import all_gather, all_to_all, record_traffic


class FreshAllocations(TorchDispatchMode):
    """Counts the op results of `numel` elements that own new storage (not a view of an
    input, not an input written in place)."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)]
        storages = {a.untyped_storage().data_ptr() for a in inputs}
        for result in torch.utils._pytree.tree_leaves(out):
            if (isinstance(result, torch.Tensor) and result.numel() == self.numel
                    and result.untyped_storage().data_ptr() not in storages):
                self.count += 1
        return out


def block_of(rank: int) -> torch.Tensor:
    return torch.randn(3, 5, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(100 + rank))


def weights_of(rank: int, world: int) -> torch.Tensor:
    return torch.randn(world, 3, 5, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(200 + rank))


def check_gather(rank: int, world: int, group) -> dict:
    x = block_of(rank).requires_grad_()
    with record_traffic() as forward, FreshAllocations(world * x.numel()) as allocations:
        gathered = all_gather(x, group=group)
    with record_traffic() as backward:
        (gathered * weights_of(rank, world)).sum().backward()
    # Rank r's gradient: the weights every rank put on block r, summed.
    expected_grad = sum(weights_of(other, world)[rank] for other in range(world))
    return {"world": world, "block_bytes": x.nbytes,
            "output_equal": torch.equal(gathered, torch.stack([block_of(r)
                                                               for r in range(world)])),
            "grad_close": torch.allclose(x.grad, expected_grad, rtol=0, atol=1e-12),
            "forward": {"sent": forward.sent, "received": forward.received},
            "backward": {"sent": backward.sent, "received": backward.received},
            "fresh_output_sized_tensors": allocations.count}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if "--gather" in sys.argv:
        report = check_gather(rank, dist.get_world_size(), dist.group.WORLD)
        if rank == 0:
            print("RESULT " + json.dumps(report), flush=True)
        dist.barrier()
        dist.destroy_process_group()
        os._exit(0)
    group = dist.group.WORLD
    # Rank 0 sends 1 row to itself and 3 to rank 1; rank 1 sends 2 and 2.
    send = [[1, 3], [2, 2]]
    uneven = {"send_splits": send[rank], "recv_splits": [send[0][rank], send[1][rank]]}
    cases = {
        "all_to_all": lambda y: all_to_all(y, group=group),
        "all_to_all_uneven": lambda y: all_to_all(y, group=group, **uneven),
        "all_gather": lambda y: all_gather(y, group=group),
    }
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(4, 3, generator=generator, requires_grad=True)
    w = torch.randn(3, generator=generator, requires_grad=True)
    report = {}
    for name, exchange in cases.items():
        def step(x, w, exchange=exchange):
            y = exchange(x * w)
            # Weights that differ by position, so a gradient routed to the wrong row shows.
            return y * torch.arange(1, y.numel() + 1, dtype=y.dtype).view_as(y).sin()

        eager_out = step(x, w)
        eager_grads = torch.autograd.grad(eager_out.sum(), (x, w))
        compiled_out = torch.compile(step, backend="aot_eager", fullgraph=True)(x, w)
        compiled_grads = torch.autograd.grad(compiled_out.sum(), (x, w))
        report[name] = {
            "output_equal": torch.equal(eager_out, compiled_out),
            "grads_equal": all(map(torch.equal, eager_grads, compiled_grads)),
            "grad_magnitude": min(g.abs().max().item() for g in eager_grads),
        }
    if rank == 0:
        print("RESULT " + json.dumps(report), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()

"""Worker for test_compile.py, run under torchrun with 2 ranks: the differentiable collectives
of context and expert parallelism (parallel/collectives.py) inside a function compiled with
`fullgraph=True` (aot_eager), against the same function run eagerly: outputs and the gradients
of both inputs, bitwise. Even blocks, uneven splits and the gather.

Prints one line `RESULT {json}` on rank 0: per case, whether output and gradients are equal, and
the largest gradient magnitude (a backward that lost the exchange returns zeros).
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from titan_hybrid.parallel.collectives import all_gather, all_to_all


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
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

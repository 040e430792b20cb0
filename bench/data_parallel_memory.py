"""Per-rank bytes of parameters, gradients and optimizer state under each sharding strategy.

    .venv/bin/python bench/data_parallel_memory.py [--flavor debug] [--nproc 2]

Baseline: the same model and optimizer in one process. Each strategy runs one real training
step (forward, backward, AdamW step) in NPROC gloo processes; the table shows what each rank
holds (gradients after backward; parameters at rest and optimizer state after the step) and
the ratio to one process. ZeRO-1 shards optimizer state, ZeRO-2 also gradients, ZeRO-3 also parameters.
Note: FSDP2 keeps parameters sharded at rest under ZeRO-2 too; what ZeRO-2 changes is that they
stay gathered between forward and backward (peak, not at-rest, memory).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
ZERO = {"no_shard": "DDP", "optim": "ZeRO-1", "optim_grads": "ZeRO-2",
        "optim_grads_params": "ZeRO-3"}


def _local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def measure(flavor: str, strategy: str | None) -> dict[str, int]:
    """One training step; the bytes this rank holds afterwards."""
    import torch
    import torch.distributed as dist

    import titan_hybrid  # noqa: F401
    from titan_hybrid.model.args import hybrid_flavors
    from titan_hybrid.model.model import HybridModel
    from titan_hybrid.optimizer import build_hybrid_optimizers
    from titan_hybrid.parallel.data_parallel import apply_data_parallel
    from titan_hybrid.parallel.init import full_tensor_materializer
    from torchtitan.config import Optimizer as OptimizerConfig

    torch.manual_seed(0)
    args = hybrid_flavors[flavor]
    with torch.device("meta"):
        model = HybridModel(args)
    if strategy is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
        apply_data_parallel(model, mesh, strategy=strategy, param_dtype=torch.float32,
                            reduce_dtype=torch.float32)
        model.zero1_mesh = mesh if strategy == "optim" else None
        model.init_materializer = full_tensor_materializer
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    optimizers = build_hybrid_optimizers([model], OptimizerConfig(), None)
    tokens = torch.randint(0, args.vocab_size, (2, 128))
    out = model(tokens)
    logits = out[0] if isinstance(out, tuple) else out
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    params = list(model.parameters())
    # Gradients as backward leaves them (ZeRO-1 drops other ranks' gradients only at the step).
    grads = sum(_local_bytes(p.grad) for p in params if p.grad is not None)
    optimizers.step()
    state = [t for opt in optimizers.optimizers for s in opt.state.values()
             for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
    return {
        "params": sum(_local_bytes(p) for p in params),
        "grads": grads,
        "optimizer": sum(_local_bytes(t) for t in state),
    }


def _worker(flavor: str, strategy: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    result = measure(flavor, strategy)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(gathered), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _run_strategy(flavor: str, strategy: str, nproc: int) -> list[dict[str, int]]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", __file__, "--worker", "--flavor", flavor,
               "--strategy", strategy]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{strategy} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def table(flavor: str, nproc: int) -> list[dict]:
    single = measure(flavor, None)
    rows = [{"strategy": "one process", **single}]
    for strategy in STRATEGIES:
        per_rank = _run_strategy(flavor, strategy, nproc)
        rows.append({"strategy": f"{strategy} ({ZERO[strategy]})",
                     **{k: max(r[k] for r in per_rank) for k in single}})
    for row in rows:
        row.update({f"{k}_ratio": row[k] / single[k] for k in single})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debug")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.flavor, args.strategy)
        return
    rows = table(args.flavor, args.nproc)
    print(f"flavor {args.flavor}, {args.nproc} data-parallel ranks; largest rank's bytes after "
          "one step; ratio vs one process")
    print(f"{'strategy':28} {'params':>16} {'grads':>16} {'optimizer':>16}")
    for row in rows:
        cells = [f"{row[k] / 2**20:7.2f} MiB {row[k + '_ratio']:4.2f}x"
                 for k in ("params", "grads", "optimizer")]
        print(f"{row['strategy']:28} " + " ".join(f"{c:>16}" for c in cells))


if __name__ == "__main__":
    main()

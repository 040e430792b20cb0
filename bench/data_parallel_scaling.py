"""Per-rank memory and throughput of each data-parallel sharding strategy, 1 vs N processes.

    .venv/bin/python bench/data_parallel_scaling.py [--flavor debug] [--nproc 2]
        [--batch 8] [--seq-len 256] [--steps 6]

Baseline: the same model and optimizer in one process that has all N cores (N threads).
Each strategy runs real training steps (forward, backward, AdamW step) in N gloo processes of
one thread each, every rank with the baseline's batch (weak scaling: N times the tokens per step).
Memory: what each rank holds after the first step (gradients after backward; parameters at rest
and optimizer state after the step), and its peak RSS; ratios to one process. ZeRO-1 shards
optimizer state, ZeRO-2 also gradients, ZeRO-3 also parameters. FSDP2 keeps parameters
sharded at rest under ZeRO-2 too; what ZeRO-2 changes is that they stay gathered between
forward and backward (peak, not at-rest, memory).
Throughput: tokens/s of all ranks together, from the median over `--steps` timed steps (after
the first) of the slowest rank; the ratio to one process is the scaling efficiency on the same
cores (1.00x: data parallelism costs nothing over threads inside one process).
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


def measure(flavor: str, strategy: str | None, *, batch: int = 2, seq_len: int = 128,
            timed_steps: int = 0) -> dict[str, float]:
    """One training step, the bytes this rank holds afterwards, then `timed_steps` timed steps."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    import titan_hybrid.torchtitan_plugin  # noqa: F401  (TrainSpec, dataset; CPU runtime)
    from titan_hybrid.config.sections import OptimizerSection as OptimizerConfig
    from titan_hybrid.model.args import hybrid_flavors
    from titan_hybrid.model.model import HybridModel
    from titan_hybrid.parallel.data_parallel import apply_data_parallel
    from titan_hybrid.parallel.init import full_tensor_materializer
    from titan_hybrid.parallel.plan import ParallelPlan
    from titan_hybrid.runtime.cpu import peak_rss_bytes
    from titan_hybrid.training.optimizer import build_hybrid_optimizers

    torch.manual_seed(0)
    args = hybrid_flavors[flavor]
    with torch.device("meta"):
        model = HybridModel(args, init_materializer=full_tensor_materializer)
    plan = ParallelPlan.unparallelized([model])
    if strategy is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
        apply_data_parallel(model, mesh, strategy=strategy, param_dtype=torch.float32,
                            reduce_dtype=torch.float32)
        plan.zero1_mesh = mesh if strategy == "optim" else None
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    optimizers = build_hybrid_optimizers([model], OptimizerConfig(), plan)
    tokens = torch.randint(0, args.vocab_size, (batch, seq_len))

    def forward_backward():
        out = model(tokens)
        logits = out[0] if isinstance(out, tuple) else out
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()

    forward_backward()
    params = list(model.parameters())
    # Gradients as backward leaves them (ZeRO-1 drops other ranks' gradients only at the step).
    grads = sum(_local_bytes(p.grad) for p in params if p.grad is not None)
    optimizers.step()
    optimizers.zero_grad()
    state = [t for opt in optimizers.optimizers for s in opt.state.values()
             for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
    result = {
        "params": sum(_local_bytes(p) for p in params),
        "grads": grads,
        "optimizer": sum(_local_bytes(t) for t in state),
    }
    times = []
    for _ in range(timed_steps):
        start = time.perf_counter()
        forward_backward()
        optimizers.step()
        optimizers.zero_grad()
        times.append(time.perf_counter() - start)
    if times:
        result["step_s"] = statistics.median(times)
        result["peak_rss"] = peak_rss_bytes()
    return result


def _worker(flavor: str, strategy: str, **sizes) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    result = measure(flavor, None if strategy == "none" else strategy, **sizes)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(gathered), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _run_strategy(flavor: str, strategy: str, nproc: int, threads: int = 1,
                  sizes: dict | None = None) -> list[dict[str, float]]:
    """`strategy` in NPROC gloo processes of THREADS threads each ("none": no data parallel)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", __file__, "--worker", "--flavor", flavor,
               "--strategy", strategy]
    sizes = sizes or {"batch": 2, "seq_len": 128, "timed_steps": 0}
    command += ["--batch", str(sizes["batch"]), "--seq-len", str(sizes["seq_len"]),
                "--steps", str(sizes["timed_steps"])]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{strategy} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def table(flavor: str, nproc: int, sizes: dict) -> list[dict]:
    def largest_rank(per_rank: list[dict]) -> dict:
        row = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
        row["tokens_per_s"] = len(per_rank) * sizes["batch"] * sizes["seq_len"] / row["step_s"]
        return row

    single = largest_rank(_run_strategy(flavor, "none", 1, threads=nproc, sizes=sizes))
    rows = [{"strategy": f"one process ({nproc} threads)", **single}]
    for strategy in STRATEGIES:
        per_rank = _run_strategy(flavor, strategy, nproc, sizes=sizes)
        rows.append({"strategy": f"{strategy} ({ZERO[strategy]})", **largest_rank(per_rank)})
    for row in rows:
        row.update({f"{k}_ratio": row[k] / single[k] for k in single})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debug")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6, help="timed steps after the first")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = {"batch": args.batch, "seq_len": args.seq_len, "timed_steps": args.steps}
    if args.worker:
        _worker(args.flavor, args.strategy, **sizes)
        return
    rows = table(args.flavor, args.nproc, sizes)
    print(f"flavor {args.flavor}, {args.nproc} data-parallel ranks x 1 thread vs one process x "
          f"{args.nproc} threads; {args.batch} x {args.seq_len} tokens per rank and step; largest "
          "rank's figures; ratio vs one process")
    columns = ("params", "grads", "optimizer", "peak_rss")
    print(f"{'strategy':28} " + " ".join(f"{c:>16}" for c in columns) + f" {'tokens/s (all)':>16}")
    for row in rows:
        cells = [f"{row[k] / 2**20:7.2f} MiB {row[k + '_ratio']:4.2f}x" for k in columns]
        cells.append(f"{row['tokens_per_s']:7.0f} {row['tokens_per_s_ratio']:4.2f}x")
        print(f"{row['strategy']:28} " + " ".join(f"{c:>16}" for c in cells))


if __name__ == "__main__":
    main()

"""EP-overlap schedule vs the plain microbatch loop, at EP=2 x FSDP (ZeRO-3), 2 gloo processes.

    .venv/bin/python bench/ep_overlap.py [--microbatches 4] [--repeats 6]

Baseline: the same model, layout and microbatches run forward then backward one microbatch
after the other (torchtitan's gradient-accumulation loop). Both variants live in the same
processes and their steps alternate, so machine noise hits both alike. A step is the forward
and backward of every microbatch (no optimizer: it is the same for both).

Also reported: the share of the baseline's step spent in the expert-parallel all-to-alls (from
issue to completion, count exchange included), the quantity the overlap can hide. gloo runs
collectives on its own threads, so on CPU the overlap is real but competes with compute for
the same cores.

Configs: `debug_moe` (the CPU MoE job's model) and `comm_heavy`, four MoE layers of 16 tiny
experts and top-8 routing, where the all-to-alls are a large part of the step.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def model_args(config: str):
    from titan_hybrid.model.args import hybrid_flavors

    args = copy.deepcopy(hybrid_flavors["debug_moe"])
    if config == "comm_heavy":
        args = dataclasses.replace(args, pattern="EEEE",
                                   moe=dataclasses.replace(args.moe, num_experts=16, top_k=8,
                                                           hidden_dim=8,
                                                           shared_expert_hidden_dim=0))
    return args


def time_config(config: str, *, microbatches: int, repeats: int, rows: int, seq: int) -> dict:
    import torch
    import torch.distributed as dist

    from tests.distributed.ep_worker import build_parallel
    from titan_hybrid.parallel import collectives, expert_parallel
    from titan_hybrid.parallel.ep_overlap import CombinedOneFOneB

    args = model_args(config)
    args.max_seq_len = seq
    built = {overlap: build_parallel(args, strategy="optim_grads_params",
                                     activation_checkpoint=False, overlap=overlap)
             for overlap in (False, True)}
    models = {overlap: model for overlap, (model, _) in built.items()}
    coordinators = {overlap: coordinator for overlap, (_, coordinator) in built.items()}
    generator = torch.Generator().manual_seed(dist.get_rank())
    batches = [torch.randint(0, args.vocab_size, (rows, seq), generator=generator)
               for _ in range(microbatches)]

    def loss_of(model, tokens):
        logits, aux_loss, *mtp_logits = model(tokens)
        return sum(l.float().square().mean() for l in (logits, *mtp_logits)) + aux_loss

    comm_seconds = [0.0]

    def timed(function):
        def wrapper(*a, **k):
            start = time.perf_counter()
            result = function(*a, **k)
            comm_seconds[0] += time.perf_counter() - start
            return result
        return wrapper

    def step(overlap: bool) -> float:
        model = models[overlap]
        dist.barrier()
        start = time.perf_counter()
        if overlap:
            schedule = CombinedOneFOneB(model, coordinators[overlap], microbatches)
            for tokens in batches:
                schedule(lambda tokens=tokens: loss_of(model, tokens))
        else:
            for tokens in batches:
                loss_of(model, tokens).backward()
        elapsed = time.perf_counter() - start
        model.zero_grad()
        return elapsed

    step(False), step(True)  # warm-up
    times = {False: [], True: []}
    comm = []
    originals = (collectives._exchange, expert_parallel._exchange_counts)
    for _ in range(repeats):
        for overlap in (False, True):
            timing_comm = not overlap
            if timing_comm:
                comm_seconds[0] = 0.0
                collectives._exchange = timed(originals[0])
                expert_parallel._exchange_counts = timed(originals[1])
            times[overlap].append(step(overlap))
            collectives._exchange, expert_parallel._exchange_counts = originals
            if timing_comm:
                comm.append(comm_seconds[0] / times[overlap][-1])
    off, on = statistics.median(times[False]), statistics.median(times[True])
    return {"config": config, "off_s": off, "on_s": on, "ratio": on / off,
            "a2a_share": statistics.median(comm)}


def worker(options) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    results = [time_config(config, microbatches=options.microbatches, repeats=options.repeats,
                           rows=options.rows, seq=options.seq)
               for config in ("debug_moe", "comm_heavy")]
    if dist.get_rank() == 0:
        print(f"EP=2 x ZeRO-3, 2 gloo processes, {options.microbatches} microbatches of "
              f"{options.rows}x{options.seq} tokens per rank; median of {options.repeats} steps")
        print("| config | a2a share of plain step | plain step (s) | overlap step (s) "
              "| overlap / plain |")
        print("| --- | --- | --- | --- | --- |")
        for r in results:
            print(f"| {r['config']} | {r['a2a_share']:.0%} | {r['off_s']:.3f} | {r['on_s']:.3f} "
                  f"| {r['ratio']:.2f}x |")
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--worker", action="store_true")
    options = parser.parse_args()
    if options.worker:
        sys.path.insert(0, str(REPO_ROOT))
        worker(options)
        return
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", __file__, "--worker", *sys.argv[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    print(proc.stdout, end="")
    if proc.returncode:
        print(proc.stderr[-4000:], file=sys.stderr)
        sys.exit(proc.returncode)


if __name__ == "__main__":
    main()

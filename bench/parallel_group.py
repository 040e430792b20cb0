"""A parallel group `(M*)` (Falcon-H1's layer) against the same layers in sequence (`M*`).

    .venv/bin/python bench/parallel_group.py [--seq-lens 512 2048] [--repeats 5]
        [--threads N] [--no-memory]

Both compute Mamba2 and attention of the `debug` flavor's shapes (hidden 256, Mamba2 with
8 heads of 32, state 32; attention with 4 heads of 64, RoPE) on a batch of 2, forward +
backward in fp32 on CPU, with the same mixer weights. Ours: one HybridLayer "M*" (one input
norm, both mixers on it, their outputs summed into the residual); the baseline: two
HybridLayers "M" then "*", each with its own norm and residual add, the second reading the
first's output. A parallel group is a different model (what Falcon-H1 trains), not a faster
form of the sequence; the comparison says what the shared norm and the lack of a dependency
between the members cost or save where both do the same mixer work.

Method: one warm-up step each, then `--repeats` rounds, each timing one fwd+bwd of both back to
back (order alternating); tokens/s from the best time, the ratio as the median of the per-round
ratios (the paired figure: a burst of load from other tenants hits both of a pair). Peak
memory: each (impl, T) in a fresh process (bench/peak_rss.py), the growth of peak RSS over one
step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(REPO_ROOT))

import torch

from bench.peak_rss import fmt_mib, in_fresh_process, rss_growth
from titan_hybrid.model.args import resolve_model_args
from titan_hybrid.model.layout import TokenLayout
from titan_hybrid.model.model import HybridLayer, HybridStack
from titan_hybrid.model.rotary import rotary_tables

BATCH = 2
IMPLS = {"parallel": "(M*): one norm, both mixers on it, summed",
         "sequence": "M then *: two layers, each with its norm and residual"}


def make_case(impl: str, T: int, seed: int = 0):
    """(forward function, leaves) of one implementation at length T."""
    args = resolve_model_args("debug", pattern="(M*)", seq_len=T)
    torch.manual_seed(seed)
    parallel = HybridLayer("M*", args)
    with torch.no_grad():
        parallel.init_weights(init_std=0.02, out_std=0.02)
    if impl == "parallel":
        module = parallel
    else:
        module = HybridStack(["M", "*"], args)
        module.layers["0"].mamba.load_state_dict(parallel.mamba.state_dict())
        module.layers["1"].attention.load_state_dict(parallel.attention.state_dict())
        with torch.no_grad():
            for layer in module.layers.values():
                layer.norm.init_weights()
    layout = TokenLayout(positions=None, seq_idx=None,
                         rope_table=rotary_tables(head_dim=args.attention.rotary_dim,
                                                  max_seq_len=T,
                                                  theta=args.attention.rope_theta))
    h = torch.randn(BATCH, T, args.dim, generator=torch.Generator().manual_seed(1),
                    requires_grad=True)
    zero = torch.zeros(())

    def forward():
        return module(h, zero, layout)[0]
    return forward, [h, *module.parameters()]


def fwd_bwd(forward, leaves) -> None:
    out = forward()
    torch.autograd.grad(out, leaves, torch.ones_like(out))


def compare(T: int, repeats: int) -> dict:
    cases = {impl: make_case(impl, T) for impl in IMPLS}
    for case in cases.values():
        fwd_bwd(*case)
    times = {impl: [] for impl in IMPLS}
    for round_ in range(repeats):
        for impl in (IMPLS if round_ % 2 == 0 else reversed(list(IMPLS))):
            start = time.perf_counter()
            fwd_bwd(*cases[impl])
            times[impl].append(time.perf_counter() - start)
    return {**{f"{impl}_tok_s": BATCH * T / min(ts) for impl, ts in times.items()},
            "paired": statistics.median(s / p for p, s in zip(times["parallel"],
                                                              times["sequence"]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--probe", nargs=2, metavar=("IMPL", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.probe:
        impl, T = args.probe
        fwd_bwd(*make_case(impl, 128))  # one-time allocations
        print(json.dumps(rss_growth(lambda: fwd_bwd(*make_case(impl, int(T))))))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} "
          "CPUs; fp32, forward + backward, batch 2; baseline: the same layers in sequence")
    print("\n| T | parallel tok/s | sequence tok/s | speed parallel/sequence (paired) | "
          "parallel peak MiB | sequence peak MiB |\n" + "| --- " * 6 + "|")
    for T in args.seq_lens:
        result = compare(T, args.repeats)
        memory = {} if args.no_memory else {
            impl: in_fresh_process(__file__, ["--probe", impl, str(T), "--threads",
                                              str(torch.get_num_threads())])
            for impl in IMPLS}
        print(f"| {T} | {result['parallel_tok_s']:,.0f} | {result['sequence_tok_s']:,.0f} | "
              f"{result['paired']:.2f}x | {fmt_mib(memory.get('parallel'))} | "
              f"{fmt_mib(memory.get('sequence'))} |", flush=True)


if __name__ == "__main__":
    main()

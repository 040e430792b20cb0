"""Training step of the hybrid debug model, torch.compile'd (inductor, per layer) vs eager.

    .venv/bin/python bench/compile.py [--flavor debug] [--batch 8] [--seq-len 256]
        [--repeats 8] [--threads N]

Baseline: the same model in eager mode. Both copies start from the same weights; the compiled
one is `titan_hybrid.parallel.compile.apply_compile` with inductor, as `--compile.enable` does
in the trainer. A step is forward, cross-entropy, backward, AdamW (foreach) step, zero_grad,
fp32 on CPU. Compile time is the wall time of the compiled copy's first step minus an eager
step (dynamo capture, AOTAutograd, inductor's C++ code generation and compiler, forward and
backward; with an empty inductor cache of its own, as on a fresh machine). Then
the two run back to back in each round (order alternating); the median of `--repeats` rounds.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from torchtitan.config.job_config import Compile

import titan_hybrid.torchtitan_plugin  # noqa: F401  (TrainSpec, dataset; CPU runtime)
from titan_hybrid.model.args import hybrid_flavors
from titan_hybrid.model.model import HybridModel
from titan_hybrid.parallel.compile import apply_compile


def make_step(model: torch.nn.Module, tokens: torch.Tensor):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def step() -> float:
        start = time.perf_counter()
        out = model(tokens)
        logits = out[0] if isinstance(out, tuple) else out
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - start

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flavor", default="debug")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    options = parser.parse_args()
    # Compiled code from earlier runs would hide the compile time.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_compile_")
    torch.set_num_threads(options.threads)
    args = copy.deepcopy(hybrid_flavors[options.flavor])
    args.max_seq_len = options.seq_len
    torch.manual_seed(0)
    eager = HybridModel(args)
    eager.init_weights()
    compiled = copy.deepcopy(eager)
    apply_compile(compiled, Compile(enable=True, backend="inductor"))
    tokens = torch.randint(0, args.vocab_size, (options.batch, options.seq_len))
    steps = {"eager": make_step(eager, tokens), "compiled": make_step(compiled, tokens)}

    eager_first = steps["eager"]()
    compile_seconds = steps["compiled"]() - steps["eager"]()
    times = {name: [] for name in steps}
    for round_index in range(options.repeats):
        order = list(steps) if round_index % 2 == 0 else list(reversed(steps))
        for name in order:
            times[name].append(steps[name]())
    median = {name: statistics.median(values) for name, values in times.items()}
    tokens_per_step = options.batch * options.seq_len
    print(f"flavor {options.flavor} ({args.pattern}), batch {options.batch} x seq "
          f"{options.seq_len}, {options.threads} threads, torch {torch.__version__}")
    print(f"first eager step {eager_first:.2f} s; compile time (first compiled step minus an "
          f"eager step) {compile_seconds:.1f} s")
    for name in steps:
        print(f"{name:>9}: {median[name] * 1e3:8.1f} ms/step  "
              f"{tokens_per_step / median[name]:8.0f} tokens/s")
    print(f"compiled / eager step time: {median['compiled'] / median['eager']:.3f} "
          f"(speed-up {median['eager'] / median['compiled']:.2f}x)")


if __name__ == "__main__":
    main()

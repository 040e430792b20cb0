"""What hyper-connections cost (issue 49): the training step of a model with N = 4 residual
streams against the same model without them (baseline), in one process invocation:

    python bench/hyper_connections.py [--flavor debug] [--streams 4] [--batch 4] [--seq-len 256]

Each row is a whole forward + backward + optimizer step (AdamW) of HybridModel in float32,
timed over `--steps` steps after `--warmup`, alternating the two models so that a noisy
machine slows both alike; the ratio is the median step time with streams / without. Also
printed: the parameters the hyper-connections add and the FLOPs per token MFU counts
(model/flops.py) with and without them.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from titan_hybrid.model.args import hybrid_flavors  # noqa: E402
from titan_hybrid.model.model import HybridModel  # noqa: E402


def _model(args) -> tuple[HybridModel, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = HybridModel(args)
    model.init_weights()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _step(model: HybridModel, optimizer, tokens: torch.Tensor) -> float:
    start = time.perf_counter()
    out = model(tokens)
    logits = out[0] if isinstance(out, tuple) else out
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return time.perf_counter() - start


def compare(flavor: str = "debug", streams: int = 4, batch: int = 4, seq_len: int = 256,
            steps: int = 6, warmup: int = 2) -> dict:
    base = dataclasses.replace(hybrid_flavors[flavor], max_seq_len=seq_len)
    models = {0: _model(base), streams: _model(dataclasses.replace(base, hc_mult=streams))}
    tokens = torch.randint(0, base.vocab_size, (batch, seq_len),
                           generator=torch.Generator().manual_seed(1))
    times: dict[int, list[float]] = {n: [] for n in models}
    for index in range(warmup + steps):
        for n, (model, optimizer) in models.items():
            elapsed = _step(model, optimizer, tokens)
            if index >= warmup:
                times[n].append(elapsed)
    params = {n: sum(p.numel() for p in model.parameters()) for n, (model, _) in models.items()}
    flops = {n: model.model_args.get_nparams_and_flops(model, seq_len)[1]
             for n, (model, _) in models.items()}
    median = {n: statistics.median(values) for n, values in times.items()}
    return {"flavor": flavor, "streams": streams, "step_s": median,
            "ratio": median[streams] / median[0], "added_params": params[streams] - params[0],
            "flops_per_token": flops}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debug")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    options = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    result = compare(options.flavor, options.streams, options.batch, options.seq_len,
                     options.steps)
    n = result["streams"]
    print(f"flavor {result['flavor']}, batch {options.batch} x {options.seq_len}, float32, "
          f"{torch.get_num_threads()} CPU threads")
    print("| model | step (ms, median) | FLOPs / token (MFU's count) |")
    print("| --- | --- | --- |")
    for streams, label in ((0, "baseline: one residual stream"), (n, f"{n} streams (mHC)")):
        print(f"| {label} | {1000 * result['step_s'][streams]:.1f} | "
              f"{result['flops_per_token'][streams]:,} |")
    print(f"step time x{result['ratio']:.2f} with {n} streams; the hyper-connections add "
          f"{result['added_params']:,} parameters")


if __name__ == "__main__":
    main()

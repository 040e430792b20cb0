"""Gated DeltaProduct and gated DeltaNet-2 (issue 50) against our gated DeltaNet layer
(baseline), in one process invocation:

    python bench/gdp_vs_gdn.py [--seq-lens 512 2048] [--householder 2 3] [--repeats 5]

Each row is one forward + backward of a mixer layer on CPU in fp32, batch 2, hidden 512: GDN
(`model/gdn.py`: 8 value heads of 64 over 4 key heads of 64), GDP (`model/gdp.py` with the
same heads, `num_householder` n) and GDN2 (`model/gdn2.py`, the same heads). Timings alternate the two layers within each round, and the
ratio is the median over rounds of GDN's time / GDP's (< 1: GDP slower); tokens/s are from the
best times. Peak memory: each (mixer, T) runs once in a fresh subprocess, which records how far
one forward + backward raises the peak RSS above the RSS before it (bench/peak_rss.py); the
ratio is GDP's / GDN's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from bench.peak_rss import fmt_mib, in_fresh_process, rss_growth  # noqa: E402
from titan_hybrid.model.gdn import GatedDeltaNet, GDNArgs  # noqa: E402
from titan_hybrid.model.gdn2 import GatedDeltaNet2  # noqa: E402
from titan_hybrid.model.gdp import GatedDeltaProductMixer, GDPArgs  # noqa: E402

DIM, BATCH, HEADS, GROUPS, HEAD_DIM = 512, 2, 8, 4, 64


def mixer(name: str) -> torch.nn.Module:
    """"gdn", "gdn2", or "gdp<n>"."""
    torch.manual_seed(0)
    if name in ("gdn", "gdn2"):
        layer = (GatedDeltaNet if name == "gdn" else GatedDeltaNet2)(
            dim=DIM, args=GDNArgs(key_head_dim=HEAD_DIM, value_head_dim=HEAD_DIM,
                                  n_key_heads=GROUPS, n_value_heads=HEADS))
    else:
        layer = GatedDeltaProductMixer(dim=DIM, args=GDPArgs(
            num_householder=int(name[3:]), d_state=HEAD_DIM, head_dim=HEAD_DIM, n_groups=GROUPS,
            num_heads=HEADS))
    with torch.no_grad():
        layer.init_weights(init_std=0.02, out_std=0.02)
    return layer


def step(layer: torch.nn.Module, x: torch.Tensor) -> None:
    layer(x).square().mean().backward()


def timings(names: list[str], T: int, repeats: int) -> dict[str, list[float]]:
    x = torch.randn(BATCH, T, DIM, generator=torch.Generator().manual_seed(1))
    layers = {name: mixer(name) for name in names}
    for layer in layers.values():
        step(layer, x)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            start = time.perf_counter()
            step(layers[name], x)
            times[name].append(time.perf_counter() - start)
    return times


def probe(name: str, T: int) -> dict:
    """In a fresh process: the peak-RSS growth (bytes) of one forward + backward."""
    step(mixer(name), torch.randn(BATCH, 128, DIM))  # one-time allocations
    layer, x = mixer(name), torch.randn(BATCH, T, DIM)
    return rss_growth(lambda: step(layer, x))


def peak_memory(name: str, T: int) -> dict:
    return in_fresh_process(__file__, ["--probe", name, str(T),
                                       "--threads", str(torch.get_num_threads())])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--householder", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--probe", nargs=2, metavar=("MIXER", "T"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.probe:
        print(json.dumps(probe(args.probe[0], int(args.probe[1]))))
        return
    names = ["gdn", *(f"gdp{n}" for n in args.householder), "gdn2"]
    print(f"GDP and GDN2 vs GDN (baseline: our gated DeltaNet layer), fwd+bwd, fp32 CPU, batch {BATCH}, "
          f"hidden {DIM}, {HEADS} value heads over {GROUPS} key heads of {HEAD_DIM}, "
          f"{torch.get_num_threads()} threads")
    print("| mixer | T | tokens/s | x GDN (paired) | peak MiB | x GDN |")
    print("|---|---|---|---|---|---|")
    for T in args.seq_lens:
        times = timings(names, T, args.repeats)
        memory = {name: peak_memory(name, T) for name in names}
        for name in names:
            paired = statistics.median(gdn / mine for gdn, mine in
                                       zip(times["gdn"], times[name], strict=True))
            print(f"| {name} | {T} | {BATCH * T / min(times[name]):,.0f} | {paired:.2f} | "
                  f"{fmt_mib(memory[name])} | "
                  f"{memory[name]['bytes'] / memory['gdn']['bytes']:.2f} |", flush=True)


if __name__ == "__main__":
    main()

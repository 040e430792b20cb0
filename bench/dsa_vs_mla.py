"""DSA layer vs MLA layer (the baseline), forward + backward, in one process:

    .venv/bin/python bench/dsa_vs_mla.py [--seq-lens 1024 2048] [--repeats 5] [--threads 1]

Issue 23's target is DSA at >= 0.85x MLA's tokens/s on an H100 (dsa_hybrid_1b vs
mla_hybrid_1b), i.e. a DSA / MLA time ratio <= 1.18; this prints that ratio for the layers
alone (bench/mixers_vs_transformers.py's MLA shapes; DSA adds 8 indexer heads of 64 and keeps
the top 256 keys), with the indexer untrained (coefficient 0) and trained (0.01). fp32 on CPU;
bf16 autocast on CUDA. Rounds alternate between the layers; the figure is the median over
rounds of DSA time / MLA time in the same round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mixers_vs_transformers import DIM, MLA_SHAPES  # noqa: E402

from titan_hybrid.model.dsa import DeepSeekSparseAttention, DSAArgs  # noqa: E402
from titan_hybrid.model.layout import TokenLayout  # noqa: E402
from titan_hybrid.model.mla import MLAArgs, MultiLatentAttention  # noqa: E402


def step_seconds(layer, x, cotangent) -> float:
    device = x.device.type
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        out = layer(x, TokenLayout(positions=None, seq_idx=None))
    out, aux = out if isinstance(out, tuple) else (out, out.new_zeros(()))
    ((out.float() * cotangent).sum() + aux).backward()
    if device == "cuda":
        torch.cuda.synchronize()
    for param in layer.parameters():
        param.grad = None
    return time.perf_counter() - start


def compare(seq_len: int, coeff: float, *, batch: int, repeats: int, device: str) -> dict:
    torch.manual_seed(0)
    mla = MultiLatentAttention(dim=DIM, args=MLAArgs(**MLA_SHAPES)).to(device)
    dsa = DeepSeekSparseAttention(dim=DIM, args=DSAArgs(
        **MLA_SHAPES, index_n_heads=8, index_head_dim=64, index_topk=256,
        indexer_loss_coeff=coeff)).to(device)
    with torch.no_grad():
        for layer in (mla, dsa):
            layer.init_weights(init_std=0.02, out_std=0.02)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, seq_len, DIM, generator=gen).to(device).requires_grad_()
    cotangent = torch.randn(batch, seq_len, DIM, generator=gen).to(device)
    layers = {"mla": mla, "dsa": dsa}
    for layer in layers.values():  # warm-up
        step_seconds(layer, x, cotangent)
    times = {name: [] for name in layers}
    for round_ in range(repeats):
        for name in (list(layers) if round_ % 2 == 0 else list(layers)[::-1]):
            times[name].append(step_seconds(layers[name], x, cotangent))
    return {"mla_ms": min(times["mla"]) * 1e3, "dsa_ms": min(times["dsa"]) * 1e3,
            "ratio": statistics.median(d / m for d, m in zip(times["dsa"], times["mla"]))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"{device}, torch {torch.__version__}, batch {args.batch}; DSA / MLA time "
          "(target <= 1.18, i.e. >= 0.85x MLA's tokens/s)")
    for seq_len in args.seq_lens:
        for coeff in (0.0, 0.01):
            result = compare(seq_len, coeff, batch=args.batch, repeats=args.repeats,
                             device=device)
            print(f"T={seq_len} indexer {'trained' if coeff else 'untrained'}: MLA "
                  f"{result['mla_ms']:.0f} ms, DSA {result['dsa_ms']:.0f} ms, DSA / MLA "
                  f"{result['ratio']:.2f}", flush=True)


if __name__ == "__main__":
    main()

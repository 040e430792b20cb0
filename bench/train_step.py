"""One training step of the hybrid debug model vs torchtitan's llama3 at equal size.

    .venv/bin/python bench/train_step.py [--flavor debug] [--batch 8] [--seq-len 256]
        [--repeats 8] [--threads N]

Baseline: torchtitan's own `Transformer` (llama3), same width, heads, vocabulary and sequence
length as the hybrid flavor, with the layer count that brings its non-embedding parameter
count closest to the hybrid's (both counts are printed).

A step is what the trainer does: forward, cross-entropy, backward, gradient-norm clipping,
AdamW (foreach) step, zero_grad; fp32 on CPU. The two models run back to back in each round
(order alternating), after one warm-up step each; the median of `--repeats` rounds is kept.

MFU = FLOPs per token * tokens/s / peak, where FLOPs per token follow Megatron's and
torchtitan's convention (6 x non-embedding matmul parameters, plus the attention / SSD /
gated-delta cores over the full sequence, backward = 2x forward; llama3 through torchtitan's
own `get_nparams_and_flops`, the hybrid through ours), and the peak is the best fp32 matmul
rate measured in this process at the same thread count (`matmul_flops`).
Target (issue 7): the hybrid step at >= 35% of that peak.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torchtitan.models.llama3 import Transformer, TransformerModelArgs

import titan_hybrid.torchtitan_plugin  # noqa: F401  (TrainSpec, dataset; CPU runtime)
from titan_hybrid.model.args import hybrid_flavors
from titan_hybrid.model.model import HybridModel
from titan_hybrid.runtime.cpu import matmul_flops


def _non_embedding_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters()) - model.tok_embeddings.weight.numel()


def matched_llama(hybrid_args, hybrid: torch.nn.Module, seq_len: int):
    """llama3 args (and model) of the hybrid's width whose size is closest to the hybrid's."""
    a = hybrid_args.attention
    if hybrid_args.dim // a.n_heads != a.head_dim:
        raise ValueError(f"attention.head_dim={a.head_dim} != dim / n_heads: llama3 cannot "
                         "match the hybrid's attention shape")
    target = _non_embedding_params(hybrid)

    def build(n_layers: int) -> tuple[TransformerModelArgs, Transformer]:
        args = TransformerModelArgs(dim=hybrid_args.dim, n_layers=n_layers, n_heads=a.n_heads,
                                    n_kv_heads=a.n_kv_heads, vocab_size=hybrid_args.vocab_size,
                                    max_seq_len=seq_len)
        with torch.device("meta"):
            return args, Transformer(args)

    fixed = _non_embedding_params(build(0)[1])  # final norm and output head
    per_layer = _non_embedding_params(build(1)[1]) - fixed
    n_layers = max(1, round((target - fixed) / per_layer))
    args, model = build(n_layers)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return args, model


class Stepper:
    """The trainer's step for one model, timed."""

    def __init__(self, name: str, model: torch.nn.Module, flops_per_token: int, n_params: int):
        self.name, self.model = name, model
        self.flops_per_token, self.n_params = flops_per_token, n_params
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1,
                                           foreach=True)
        self.times: list[float] = []

    def step(self, tokens: torch.Tensor, labels: torch.Tensor) -> float:
        start = time.perf_counter()
        out = self.model(tokens)
        logits = out[0] if isinstance(out, tuple) else out
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        self.times.append(elapsed)
        return loss.item()


def compare(flavor: str = "debug", batch: int = 8, seq_len: int = 256,
            repeats: int = 8) -> dict:
    """Times both models' steps side by side; returns the peak and one row per model."""
    torch.manual_seed(0)
    hybrid_args = hybrid_flavors[flavor]
    with torch.device("meta"):
        hybrid = HybridModel(hybrid_args)
    hybrid.to_empty(device="cpu")
    with torch.no_grad():
        hybrid.init_weights()
    llama_args, llama = matched_llama(hybrid_args, hybrid, seq_len)

    steppers = []
    for name, model, model_args in ((f"hybrid {flavor}", hybrid, hybrid_args),
                                    (f"llama3 ({llama_args.n_layers} layers)", llama, llama_args)):
        _, flops = model_args.get_nparams_and_flops(model, seq_len)
        steppers.append(Stepper(name, model, flops, _non_embedding_params(model)))

    tokens = torch.randint(0, hybrid_args.vocab_size, (batch, seq_len + 1))
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    losses = {}
    for stepper in steppers:  # warm-up: allocator, thread pool, optimizer state
        losses[stepper.name] = stepper.step(inputs, labels)
        stepper.times.clear()
    peak_before = matmul_flops()
    for round_index in range(repeats):
        order = steppers if round_index % 2 == 0 else steppers[::-1]
        for stepper in order:
            stepper.step(inputs, labels)
    # The peak is measured before and after the timed rounds; the higher one is the denominator
    # (a busy moment understates the peak and would overstate MFU).
    peak = max(peak_before, matmul_flops())

    rows = []
    for s in steppers:
        seconds = statistics.median(s.times)
        tokens_per_s = batch * seq_len / seconds
        rows.append({"model": s.name, "non_embedding_params": s.n_params,
                     "flops_per_token": s.flops_per_token, "step_s": seconds,
                     "tokens_per_s": tokens_per_s, "first_loss": losses[s.name],
                     "mfu": s.flops_per_token * tokens_per_s / peak})
    return {"peak_flops": peak, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debug")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = compare(args.flavor, args.batch, args.seq_len, args.repeats)
    print(f"{args.batch} x {args.seq_len} tokens per step, fp32, {torch.get_num_threads()} "
          f"threads; measured fp32 matmul peak {result['peak_flops']:.3e} FLOP/s; median of "
          f"{args.repeats}")
    print(f"{'model':22} {'non-emb params':>15} {'GFLOP/token':>12} {'step (s)':>9} "
          f"{'tokens/s':>9} {'MFU':>6}")
    for row in result["rows"]:
        print(f"{row['model']:22} {row['non_embedding_params'] / 1e6:14.2f}M "
              f"{row['flops_per_token'] / 1e9:12.4f} {row['step_s']:9.3f} "
              f"{row['tokens_per_s']:9.0f} {100 * row['mfu']:5.1f}%")
    hybrid, llama = result["rows"]
    print(f"hybrid / llama3 tokens/s: {hybrid['tokens_per_s'] / llama['tokens_per_s']:.2f}x")
    print(f"target: hybrid MFU >= 35% of the measured peak: "
          f"{'met' if hybrid['mfu'] >= 0.35 else 'NOT met'}")


if __name__ == "__main__":
    main()

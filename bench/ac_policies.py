"""Activation checkpointing chosen per layer kind (issue 46, item 4): one forward + backward of a
hybrid model under each policy, against no checkpointing (the baseline), in one process
invocation:

    python bench/ac_policies.py [--flavor nemotron_h_1b] [--vocab 8192] [--batch 1]
        [--seq-len 512] [--repeats 3]

The model is the flavor's (its pattern and every layer's dims) with a smaller vocabulary, so
that the embedding and head, which no policy touches, do not drown the layers; fp32 on CPU,
where the scans take their torch paths (they keep more for the backward than the GPU kernels
do, so the Mamba2 layers' share of the memory is larger here than on a GPU).

Policies: none; full (every layer); full on the layers of some kinds only
(`activation_checkpoint.layer_kinds`: "*-" recomputes attention and MLP and keeps the Mamba2
layers' activations, "M" the reverse); per-op selective. Memory: each policy runs in a fresh
subprocess that records how far one forward + backward raises the peak RSS above the RSS
before it, the parameters' gradients already allocated (bench/peak_rss.py). Time: the
policies take turns on one model in this process (the checkpoint wrappers are put on and
taken off), and a policy's figure is the median over rounds of its time / no checkpointing's.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from titan_hybrid.config.sections import ActivationCheckpointSection  # noqa: E402
from titan_hybrid.model.args import hybrid_flavors  # noqa: E402
from titan_hybrid.model.model import HybridModel  # noqa: E402
from titan_hybrid.parallel.activation_checkpoint import apply_activation_checkpointing  # noqa: E402

POLICIES = {
    "none": ActivationCheckpointSection(mode="none"),
    "full": ActivationCheckpointSection(mode="full"),
    "full, layer_kinds *-": ActivationCheckpointSection(mode="full", layer_kinds="*-"),
    "full, layer_kinds M": ActivationCheckpointSection(mode="full", layer_kinds="M"),
    "selective op": ActivationCheckpointSection(mode="selective", selective_ac_option="op"),
}


def build(flavor: str, vocab: int, seq_len: int) -> HybridModel:
    args = dataclasses.replace(hybrid_flavors[flavor], vocab_size=vocab, max_seq_len=seq_len)
    torch.manual_seed(0)
    model = HybridModel(args)
    model.init_weights()
    return model


def set_policy(model: HybridModel, policy: str) -> None:
    """Take any checkpoint wrappers off `model`'s layers, then put `policy`'s on."""
    for name, layer in list(model.layers.named_children()):
        model.layers.register_module(name, getattr(layer, "_checkpoint_wrapped_module", layer))
    apply_activation_checkpointing(model, POLICIES[policy], model_compile_enabled=False,
                                   base_folder="")


def step(model: HybridModel, tokens: torch.Tensor) -> None:
    logits = model(tokens)
    logits = logits[0] if isinstance(logits, tuple) else logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()


def tokens_for(model: HybridModel, batch: int, seq_len: int) -> torch.Tensor:
    return torch.randint(0, model.model_args.vocab_size, (batch, seq_len),
                         generator=torch.Generator().manual_seed(1))


def timings(model: HybridModel, batch: int, seq_len: int, repeats: int) -> dict[str, list]:
    tokens = tokens_for(model, batch, seq_len)
    step(model, tokens)  # warm-up; the gradients stay allocated from here on
    times: dict[str, list[float]] = {policy: [] for policy in POLICIES}
    order = list(POLICIES)
    for r in range(repeats):
        for policy in (order if r % 2 == 0 else order[::-1]):
            set_policy(model, policy)
            start = time.perf_counter()
            step(model, tokens)
            times[policy].append(time.perf_counter() - start)
    set_policy(model, "none")
    return times


def probe(flavor: str, vocab: int, batch: int, seq_len: int, policy: str) -> dict:
    """In a fresh process: the peak-RSS growth (bytes) of one forward + backward under
    `policy`, after a short step has allocated the gradients."""
    model = build(flavor, vocab, seq_len)
    set_policy(model, policy)
    step(model, tokens_for(model, 1, min(128, seq_len)))
    tokens = tokens_for(model, batch, seq_len)
    return rss_growth(lambda: step(model, tokens))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="nemotron_h_1b")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--probe", choices=list(POLICIES))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.probe:
        print(json.dumps(probe(args.flavor, args.vocab, args.batch, args.seq_len, args.probe)))
        return
    memory = {policy: in_fresh_process(__file__, [
        "--probe", policy, "--flavor", args.flavor, "--vocab", str(args.vocab),
        "--batch", str(args.batch), "--seq-len", str(args.seq_len),
        "--threads", str(torch.get_num_threads())]) for policy in POLICIES}
    model = build(args.flavor, args.vocab, args.seq_len)
    times = timings(model, args.batch, args.seq_len, args.repeats)
    print(f"AC policies vs none (baseline), {args.flavor} ({model.model_args.pattern}) with a "
          f"{args.vocab}-token vocabulary, fwd+bwd, fp32 CPU, {args.batch} x {args.seq_len}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    print("| policy | peak MiB | x none | step s | x none (paired) |")
    print("|---|---|---|---|---|")
    for policy in POLICIES:
        paired = statistics.median(mine / none for mine, none in
                                   zip(times[policy], times["none"], strict=True))
        print(f"| {policy} | {fmt_mib(memory[policy])} | "
              f"{memory[policy]['bytes'] / memory['none']['bytes']:.2f} | "
              f"{statistics.median(times[policy]):.2f} | {paired:.2f} |", flush=True)


if __name__ == "__main__":
    main()

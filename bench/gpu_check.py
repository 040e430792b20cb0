"""The GPU path in one command, on a CUDA machine with the gpu extra (README, "GPU path"):

    .venv/bin/python bench/gpu_check.py [--flavors nemotron_h_1b hybrid_moe_2b] [--batch 2]
        [--seq-len 4096] [--steps 10]

1. The `triton_interpreter` tests, which on a machine with CUDA run mamba_ssm's and fla's
   kernels for real, through our ops, in float32 and bfloat16, against our torch paths (forward
   and every input gradient; plus torch.compile fullgraph over the kernel path).
2. One line per flavor: a bf16 training step as torchtitan runs one device without FSDP (fp32
   master weights, autocast bf16, AdamW fused, grad clipping at 1.0, random tokens), median
   of `--steps` after 3 warm-up steps: tokens/s, peak allocated memory, and MFU = FLOPs per
   token (titan_hybrid.model.flops: 6 x matmul parameters + the attention / SSD / gated-delta
   cores, backward = 2 x forward) x tokens/s / the bf16 matmul rate measured here (8192^3).

Without CUDA it says so and exits 0 (the kernels are checked on CPU by the same tests, in
Triton's interpreter: `./run_tests.sh -m triton_interpreter`).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from titan_hybrid.loss import hybrid_loss
from titan_hybrid.model.args import hybrid_flavors
from titan_hybrid.model.flops import nparams_and_flops_per_token
from titan_hybrid.model.model import HybridModel
from titan_hybrid.optimizer import param_groups

REPO_ROOT = Path(__file__).resolve().parents[1]
KERNEL_TESTS = ["tests/unit/test_ssd.py", "tests/unit/test_gated_delta.py",
                "tests/unit/test_gated_norm.py"]


def matmul_flops(device: torch.device, n: int = 8192, reps: int = 10) -> float:
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize(device)
    return 2 * n**3 * reps / (time.perf_counter() - start)


def train_line(flavor: str, *, batch: int, seq_len: int, steps: int,
               device: torch.device) -> dict:
    """Median bf16 training step of `flavor` on `device` (see the module docstring)."""
    args = dataclasses.replace(hybrid_flavors[flavor], max_seq_len=seq_len)
    torch.manual_seed(0)
    with torch.device(device):
        model = HybridModel(args)
    model.init_weights(buffer_device=device)
    n_params, flops_per_token = nparams_and_flops_per_token(args, model, seq_len)
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=3e-4, betas=(0.9, 0.95),
                                  fused=device.type == "cuda")
    tokens = torch.randint(0, args.vocab_size, (batch, seq_len + 1), device=device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times, losses = [], []
    for step in range(3 + steps):
        if step == 3 and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = hybrid_loss(model(inputs), labels,
                               mtp_loss_coeff=args.mtp_loss_coeff) / labels.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    step_s = statistics.median(times[3:])
    peak_gib = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return {"flavor": flavor, "params": n_params, "flops_per_token": flops_per_token,
            "tokens_per_s": batch * seq_len / step_s, "step_s": step_s,
            "peak_gib": peak_gib, "losses": losses}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavors", nargs="+", default=["nemotron_h_1b", "hybrid_moe_2b"])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to check here. On CPU the kernels run in "
              "Triton's interpreter: ./run_tests.sh -m triton_interpreter")
        return 0
    device = torch.device("cuda")
    print(f"gpu_check: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    # -s: each kernel test prints its largest relative error against the torch path
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                            "-m", "triton_interpreter", *KERNEL_TESTS], cwd=REPO_ROOT)
    peak = matmul_flops(device)
    print(f"measured bf16 matmul peak: {peak / 1e12:.0f} TFLOP/s")
    for flavor in args.flavors:
        try:
            r = train_line(flavor, batch=args.batch, seq_len=args.seq_len, steps=args.steps,
                           device=device)
        except torch.OutOfMemoryError:
            print(f"{flavor}: out of memory at batch {args.batch} x {args.seq_len}")
            continue
        finally:
            torch.cuda.empty_cache()
        mfu = r["flops_per_token"] * r["tokens_per_s"] / peak
        print(f"{flavor}: {r['params'] / 1e9:.2f}B params, batch {args.batch} x "
              f"{args.seq_len}, bf16: {r['tokens_per_s']:,.0f} tokens/s, step "
              f"{r['step_s'] * 1e3:.0f} ms, peak {r['peak_gib']:.1f} GiB, MFU {mfu:.1%}, "
              f"loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}")
    return tests.returncode


if __name__ == "__main__":
    sys.exit(main())

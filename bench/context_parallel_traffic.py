"""Context parallel for Mamba2: bytes each rank receives per `M` layer and step, head_a2a vs
chunkwise (`--parallelism.context_parallel_linear_mode`), and the CPU time per training step.

    .venv/bin/python bench/context_parallel_traffic.py [--skip-runs]

1. Traffic, analytic at nemotron_h_1b's Mamba shapes (64 heads of 64, 8 groups, state 128,
   conv width 4; bf16 activations, fp32 states; one row per microbatch; packed documents), for
   T = 4k / 16k / 64k and CP = 2 / 4 / 8. `mamba_layer_bytes` follows the collectives' sizes in
   parallel/context_parallel.py and parallel/context_parallel_chunkwise.py one by one;
   tests/distributed/test_context_parallel.py checks it, byte for byte, against the bytes
   received that parallel/collectives.record_traffic counts in real CP runs.
2. Time per step of the real trainer on this CPU (`M-G-` layers at width 256, packed
   documents), CP 2 and CP 4, both modes, at the largest T that runs here in reasonable time.
   Baseline: the same job on one process.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from titan_hybrid.model.args import hybrid_flavors  # noqa: E402
from titan_hybrid.parallel.context_parallel import heads_of_rank  # noqa: E402

INT32, INT64 = 4, 8


def mamba_layer_bytes(mode: str, cp: int, seq_len: int, args, dim: int, *, batch: int = 1,
                      documents: bool = True, act_bytes: int = 2, state_bytes: int = 4,
                      tp: int = 1) -> dict[str, int]:
    """{"forward": bytes, "backward": bytes} one CP rank receives from the others for one Mamba2
    layer (its heads per TP rank) and one microbatch of `batch` rows of `seq_len` tokens."""
    heads, groups = args.n_heads(dim) // tp, args.n_groups // tp
    head_dim, state = args.head_dim, args.d_state
    conv_channels = heads * head_dim + 2 * groups * state
    others = cp - 1
    if mode == "head_a2a":
        local = batch * seq_len // cp
        # Every layer all-gathers the shard's positions and document ids (int32 from the
        # document packer; positions alone are int64 0..T-1 without documents).
        layout = others * local * (INT32 + INT32 if documents else INT64)
        taken_heads, taken_groups = heads_of_rank(heads, groups, cp, 0)
        channels_per_rank = (len(taken_heads) * (head_dim + 1) + 2 * len(taken_groups) * state)
        to_heads = others * local * channels_per_rank * act_bytes
        to_sequence = others * local * len(taken_heads) * head_dim * act_bytes
        return {"forward": layout + to_heads + to_sequence, "backward": to_heads + to_sequence}
    if mode != "chunkwise":
        raise ValueError(f"mode '{mode}'")
    halo_rows = 2 * batch * (args.conv_width - 1)  # both pieces' last width-1 conv inputs
    halo = others * halo_rows * conv_channels * act_bytes
    halo_documents = others * halo_rows * INT32 if documents else 0
    # Per piece and row: total decay per head, exit state per head, continues.
    summary = others * 2 * batch * (heads + heads * head_dim * state + 1) * state_bytes
    return {"forward": halo + halo_documents + summary, "backward": halo + summary}


def traffic_table() -> list[str]:
    model = hybrid_flavors["nemotron_h_1b"]
    lines = ["| T | CP | head_a2a (fwd + bwd) | chunkwise (fwd + bwd) | head_a2a / chunkwise |",
             "| --- | --- | --- | --- | --- |"]
    for seq_len in (4096, 16384, 65536):
        for cp in (2, 4, 8):
            a2a, chunkwise = (sum(mamba_layer_bytes(mode, cp, seq_len, model.mamba,
                                                    model.dim).values())
                              for mode in ("head_a2a", "chunkwise"))
            lines.append(f"| {seq_len // 1024}k | {cp} | {a2a / 2**20:.1f} MiB | "
                         f"{chunkwise / 2**20:.1f} MiB | {a2a / chunkwise:.2f} |")
    return lines


STEP_LINE = re.compile(r"step:\s*(\d+).*?tps: ([\d,]+)")


def step_seconds(nproc: int, seq_len: int, extra: tuple[str, ...], steps: int) -> float:
    """Median wall seconds per step (steps 3..), from torchtitan's tokens/s of one rank."""
    with tempfile.TemporaryDirectory(prefix="bench_cp_") as dump:
        command = [sys.executable, "-m", "titan_hybrid.launch",
                   "--job.config_file", str(REPO / "train_configs" / "hybrid.toml"),
                   "--job.dump_folder", dump, "--hybrid.pattern", "M-G-",
                   "--training.seq_len", str(seq_len), "--training.local_batch_size", "1",
                   "--training.steps", str(steps), "--hybrid.document_masking",
                   "--metrics.log_freq", "1", *extra]
        env_prefix = {"NGPU": str(nproc)}
        proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                              env={**__import__("os").environ, **env_prefix,
                                   "OMP_NUM_THREADS": "1"})
        if proc.returncode != 0:
            raise SystemExit(proc.stdout[-2000:] + proc.stderr[-4000:])
        rates = [int(tps.replace(",", "")) for step, tps in STEP_LINE.findall(proc.stdout +
                                                                              proc.stderr)
                 if int(step) >= 3]
        # torchtitan's tps is tokens per second of one rank; each CP rank holds T / cp tokens.
        return statistics.median((seq_len / nproc) / rate for rate in rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-runs", action="store_true", help="the analytic table only")
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=6)
    options = parser.parse_args()
    print("Bytes one rank sends per Mamba2 layer and step (nemotron_h_1b shapes, 1 row):")
    print("\n".join(traffic_table()))
    if options.skip_runs:
        return
    print(f"\nCPU seconds per step, M-G- at T={options.seq_len} (median of steps 3..):")
    single = step_seconds(1, options.seq_len, (), options.steps)
    print(f"1 process: {single:.2f} s")
    for cp in (2, 4):
        for mode in ("head_a2a", "chunkwise"):
            seconds = step_seconds(cp, options.seq_len, (
                "--parallelism.context_parallel_degree", str(cp),
                "--parallelism.context_parallel_linear_mode", mode), options.steps)
            print(f"CP{cp} {mode}: {seconds:.2f} s ({single / seconds:.2f}x one process)")


if __name__ == "__main__":
    main()

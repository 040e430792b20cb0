"""The GPU path in one command, on a CUDA machine (README, "GPU path"):

    python bench/gpu_check.py [--flavors nemotron_h_1b ...] [--batch 2] [--seq-len 4096]
        [--steps 20] [--skip-kernels] [--compile | --no-compile] [--fp8]
        [--out outputs/gpu_check]

1. Kernel check (bench/kernel_check.py): the SSD scan, gated RMS norm, gated delta rule, KDA and
   causal conv1d kernels through our ops, float32 and bfloat16, one shape each, forward and
   input gradients against the torch paths, plus one torch.compile(fullgraph=True) case; a
   line per case with its time, and the total. A kernel package that is not usable here is
   reported as skipped, with the reason. Then the Mamba2 layer at nemotron_h_1b's dims on
   mamba_ssm's fused path (what Megatron runs, with causal-conv1d) beside ours, eager and
   compiled (bench/mamba_layer.py).
2. One row per flavor through the trainer as users run it (`python -m titan_hybrid.launch`,
   one process, the TOML's data, no checkpoint): tokens/s, TFLOP/s and MFU as torchtitan
   logs them (its last log line: the second half of the steps for an even --steps), peak
   reserved memory, and the time from launch to the end of step 1 (Triton autotuning included
   when TRITON_CACHE_DIR is cold). Then the baseline: the first flavor with every sequence
   mixer replaced by attention (`--hybrid.pattern`, same layer count and MLP / MoE positions),
   and the ratios against it.
3. With --fp8: the FP8 flavors among them (nemotron_h_1b, hybrid_moe_2b; debug on CPU) again
   in float8 (`model.converters = ["quantize.linear.float8"]`, with
   "quantize.grouped_mm.float8" where it has routed experts), rowwise and tensorwise, each
   with its tokens/s ratio to the flavor's BF16 row (emulated float8 on CPU: a smoke run, not
   a speed).
   Each run's full log is written to --out.

Exits 1 when a kernel check or a training run fails. Without CUDA it says so and exits 0;
`--cpu-smoke` runs part 2 on CPU with the debug flavor (the kernels are checked on CPU by
`./run_tests.sh -m triton_interpreter`, in Triton's interpreter).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(REPO_ROOT))

import torch

from titan_hybrid.model.args import hybrid_flavors
from titan_hybrid.model.layer_kinds import LAYER_KINDS

GPU_FLAVORS = ["nemotron_h_1b", "hybrid_moe_2b", "mla_hybrid_1b", "dsa_hybrid_1b",
               "kda_hybrid_1b", "gdn_hybrid_1b", "gdp_hybrid_1b", "jamba_hybrid_2b",
               "mamba3_hybrid_1b"]
FP8_FLAVORS = ["nemotron_h_1b", "hybrid_moe_2b"]
FP8_RECIPES = ["rowwise", "tensorwise"]
# torchtitan 0.2.2's MetricsProcessor.log line (components/metrics.py), colours off:
# "step:  1  loss:  8.06786  grad_norm:  4.8878  memory:  0.61GiB(2.61%)  tps: 30  tflops: 0.00
# mfu: 0.76%"; memory is the peak reserved since the previous line, tps is tokens/s per device.
STEP_LINE = re.compile(
    r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>\S+)\s+grad_norm:\s*(?P<grad_norm>\S+)\s+"
    r"memory:\s*(?P<memory_gib>[\d.]+)GiB\((?P<memory_pct>[\d.]+)%\)\s+tps:\s*(?P<tps>[\d,]+)\s+"
    r"tflops:\s*(?P<tflops>[\d,.]+)\s+mfu:\s*(?P<mfu>[\d.]+)%")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def parse_step_line(line: str) -> dict | None:
    """The numbers of one torchtitan step log line, None for any other line."""
    match = STEP_LINE.search(ANSI.sub("", line))
    if match is None:
        return None
    return {key: int(value) if key == "step" else float(value.replace(",", ""))
            for key, value in match.groupdict().items()}


def transformer_pattern(pattern: str) -> str:
    """`pattern` with every sequence mixer (Mamba2, gated DeltaNet, MLA, DSA) replaced by
    self-attention: same layers, MLP / MoE positions and MTP depths. Bracket groups are
    dropped: `[**]` would put two layers in one checkpoint namespace, which the grammar
    refuses (a group computes what its layers compute ungrouped)."""
    return "".join("*" if symbol in LAYER_KINDS and LAYER_KINDS[symbol].mixes_sequence
                   else symbol for symbol in pattern if symbol not in "[]")


def trainer_command(flavor: str, *, batch: int, seq_len: int, steps: int, dump_folder: Path,
                    pattern: str | None = None, compile_: bool | None = None,
                    float8: str | None = None, emulate: bool = False) -> list[str]:
    """The user's command: the flavor's TOML (train_configs/<flavor>.toml, else the one of its
    size class) with the flavor, shape and step count on the command line; `float8`: that
    recipe's FP8 training (`emulate`: its emulated GEMMs, on CPU)."""
    # lines at step 1 and every log_freq steps, the last at the last step
    log_freq = max(d for d in range(1, steps // 2 + 1) if steps % d == 0)
    toml = Path("train_configs", f"{flavor}.toml")
    if not (REPO_ROOT / toml).exists():
        toml = Path("train_configs", "hybrid.toml" if flavor.startswith("debug")
                    else "nemotron_h_1b.toml")
    command = [sys.executable, "-m", "titan_hybrid.launch", "--nproc", "1",
               "--job.config_file", str(toml), "--model.flavor", flavor,
               "--training.steps", str(steps), "--training.local_batch_size", str(batch),
               "--training.seq_len", str(seq_len), "--metrics.log_freq", str(log_freq),
               "--checkpoint.no-enable", "--metrics.no-enable-tensorboard",
               "--metrics.disable_color_printing", "--job.dump_folder", str(dump_folder)]
    if pattern is not None:
        command += ["--hybrid.pattern", pattern]
    if compile_ is not None:
        command.append("--compile.enable" if compile_ else "--compile.no-enable")
    if float8 is not None:
        # the routed experts' grouped GEMMs in float8 too, where the flavor has them
        converters = "quantize.linear.float8" + (
            ",quantize.grouped_mm.float8" if "E" in hybrid_flavors[flavor].pattern else "")
        command += ["--model.converters", converters,
                    "--quantize.linear.float8.recipe_name", float8]
        if emulate:
            command.append("--quantize.linear.float8.emulate")
    return command


def run_trainer(command: list[str], log_path: Path, timeout_s: float = 900) -> dict:
    """Runs `command` in the repository root, its output (stdout and stderr) into `log_path`:
    exit status, seconds to step 1's log line, and every step line parsed."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    steps, first_step_s, start = [], None, time.perf_counter()
    with open(log_path, "w") as log, subprocess.Popen(
            command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True) as proc:
        log.write(f"$ {shlex.join(command)}\n")
        timer = threading.Timer(timeout_s, os.killpg, (proc.pid, signal.SIGKILL))
        timer.start()
        try:
            for line in proc.stdout:
                log.write(line)
                parsed = parse_step_line(line)
                if parsed is not None:
                    first_step_s = first_step_s or time.perf_counter() - start
                    steps.append(parsed)
        finally:
            timer.cancel()
        returncode = proc.wait()
    return {"returncode": returncode, "first_step_s": first_step_s, "steps": steps,
            "wall_s": time.perf_counter() - start, "log": str(log_path)}


def row(name: str, run: dict) -> str:
    if run["returncode"] != 0 or not run["steps"]:
        return f"{name:<34} FAILED (exit {run['returncode']}), see {run['log']}"
    last = run["steps"][-1]
    return (f"{name:<34} {last['tps']:>9,.0f} {last['tflops']:>8.1f} {last['mfu']:>6.1f}% "
            f"{last['memory_gib']:>9.1f} {run['first_step_s']:>11.0f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavors", nargs="+", help=f"default: {' '.join(GPU_FLAVORS)}")
    parser.add_argument("--batch", type=int, help="local batch size (default 2)")
    parser.add_argument("--seq-len", type=int, help="default 4096")
    parser.add_argument("--steps", type=int, help="default 20; rows report the last half")
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction,
                        help="--compile.enable / --compile.no-enable (default: the TOML's)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "outputs" / "gpu_check",
                        help="one log per training run, and summary.json")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per training run")
    parser.add_argument("--fp8", action="store_true",
                        help=f"also {' and '.join(FP8_FLAVORS)} in float8, rowwise and tensorwise")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="without CUDA: the training rows on CPU (debug flavor, tiny shapes)")
    args = parser.parse_args(argv)
    args.out = args.out.resolve()  # the runs' dump folders are relative to the repository
    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_smoke:
        print("gpu_check: no CUDA device; nothing to check here. On CPU the kernels run in "
              "Triton's interpreter: ./run_tests.sh -m triton_interpreter")
        return 0
    small = not cuda  # --cpu-smoke on a machine without CUDA
    flavors = args.flavors or (["debug"] if small else GPU_FLAVORS)
    batch, seq_len = args.batch or (1 if small else 2), args.seq_len or (64 if small else 4096)
    steps = args.steps or (2 if small else 20)
    if steps < 2:
        parser.error("--steps must be at least 2: the rows report the steps after step 1")
    device = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"gpu_check: {device}, torch {torch.__version__}, TRITON_CACHE_DIR="
          f"{os.environ.get('TRITON_CACHE_DIR', '~/.triton/cache (default)')}", flush=True)

    ok = True
    if args.skip_kernels:
        print("kernels: skipped (--skip-kernels)")
    elif not cuda:
        print("kernels: skipped: no CUDA device (./run_tests.sh -m triton_interpreter checks "
              "them on CPU)")
    else:
        from bench.kernel_check import run_kernel_checks
        ok = run_kernel_checks()
        # Megatron's Mamba2 layer (mamba_ssm's fused path) beside ours, nemotron_h_1b's dims
        from bench.mamba_layer import compare, report
        layer = compare("nemotron_h_1b", batch=2, seq_len=4096, repeats=10)
        print("\n" + "\n".join(report(layer, "nemotron_h_1b", 2, 4096, 10)), flush=True)
        del layer
        torch.cuda.empty_cache()  # the training runs are other processes on the same GPU

    base = flavors[0]
    runs = [(flavor, flavor, None, None) for flavor in flavors]
    runs.append((f"transformer ({base} dims)", base,
                 transformer_pattern(hybrid_flavors[base].pattern), None))
    if args.fp8:
        runs += [(f"{flavor} fp8 {recipe}", flavor, None, recipe)
                 for flavor in flavors if flavor in FP8_FLAVORS or small
                 for recipe in FP8_RECIPES]
    print(f"\ntrainer: python -m titan_hybrid.launch, 1 process, batch {batch} x {seq_len}, "
          f"{steps} steps; logs in {args.out}\nbaseline pattern: {runs[-1][2]} "
          f"({base}: {hybrid_flavors[base].pattern})")
    print(f"{'flavor':<34} {'tokens/s':>9} {'TFLOP/s':>8} {'MFU':>7} {'peak GiB':>9} "
          f"{'1st step s':>11}", flush=True)
    results = {}
    for name, flavor, pattern, recipe in runs:
        slug = re.sub(r"\W+", "_", name).strip("_")
        command = trainer_command(flavor, batch=batch, seq_len=seq_len, steps=steps,
                                  dump_folder=args.out / slug, pattern=pattern,
                                  compile_=args.compile, float8=recipe, emulate=not cuda)
        results[name] = run_trainer(command, args.out / f"{slug}.log", args.timeout)
        ok &= results[name]["returncode"] == 0 and bool(results[name]["steps"])
        print(row(name, results[name]), flush=True)
    hybrid, baseline = results[base], results[runs[-1][0]]
    if hybrid["steps"] and baseline["steps"]:
        ratios = [f"{label} x{hybrid['steps'][-1][key] / baseline['steps'][-1][key]:.2f}"
                  for key, label in (("tps", "tokens/s"), ("tflops", "TFLOP/s"))
                  if baseline["steps"][-1][key] > 0]
        print(f"{base} / transformer: {', '.join(ratios)}")
    for name, flavor, _, recipe in runs:
        fp8, bf16 = results[name], results[flavor]
        if recipe is not None and fp8["steps"] and bf16["steps"]:
            print(f"{name} / {flavor} bf16: tokens/s "
                  f"x{fp8['steps'][-1]['tps'] / bf16['steps'][-1]['tps']:.2f}")
    print("peak GiB: torchtitan's peak reserved memory; 1st step s: launch to step 1's log line "
          "(issue 23's target on a first run: < 60 s)")
    (args.out / "summary.json").write_text(json.dumps(results, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Where a training step's GPU time goes, by layer kind and by kernel (issue 46, item 1):

    python bench/gpu_profile.py [--jobs nemotron_h_1b nemotron_h_1b:transformer ...]
        [--batch 2] [--seq-len 4096] [--steps 12] [--deadline 420] [--out outputs/gpu_profile]

Each job is the real trainer as gpu_check runs it (`python -m titan_hybrid.launch`'s job:
the flavor's TOML, one process, no checkpoint), in a process of its own, with its step
instrumented:
- every top-level layer (and MTP depth) gets CUDA events at the start and end of its forward
  and of its backward (the backward's events are gradient hooks on the layer's output and
  input, so a checkpointed layer's recompute counts in its backward); the per-kind table sums
  them over the steps after the first log window, and the rest of the step (embedding, head,
  loss, clipping, optimizer) is the step's own events minus the layers';
- one step runs under torch.profiler: the top kernels by GPU time, and the kernels grouped by
  what they do; forward / backward ranges per layer kind attribute each kernel to its kind.
The trainer's own log line (tokens/s, TFLOP/s, MFU, peak memory) is the job's gpu_check row.

A job is `FLAVOR[:VARIANT[+VARIANT...]]`: `transformer` (every sequence mixer attention:
gpu_check's baseline), `ac_none` (no activation checkpointing), `ac_op` (per-op selective
checkpointing), `ac_kinds` (full checkpointing of the attention, MLP and MoE layers only),
`bN` (local batch N). Jobs run in order until --deadline
seconds have passed; the markdown tables go to stdout and to OUT/tables.md, and the Triton and
inductor caches into OUT/compile_caches.tar.gz (to skip a cold autotune next time: unpack it
into TRITON_CACHE_DIR / TORCHINDUCTOR_CACHE_DIR's parent, docs/gpu_and_performance.md,
"Autotune cost"), and the
autotune picks table those caches hold into OUT/autotune_picks.json (bench/autotune_picks.py:
the refreshed titan_hybrid/assets/autotune_picks/smXY.json). The workers install the shipped
picks first, as the trainer does; --no-autotune-picks tunes every kernel afresh (a cold start
without them, and timings for every picked kernel in the refreshed table).
"""

from __future__ import annotations

import argparse
import collections
import getpass
import importlib.metadata
import json
import os
import re
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(REPO_ROOT))

import torch

from bench import autotune_picks as autotune_picks_table
from bench.gpu_check import parse_step_line, row, run_trainer, trainer_command, transformer_pattern
from titan_hybrid.compat.kernel_packages import installed_version
from titan_hybrid.model.args import hybrid_flavors
from titan_hybrid.ops import autotune_picks

DEFAULT_JOBS = ["nemotron_h_1b", "nemotron_h_1b:transformer", "nemotron_h_1b:ac_none",
                "hybrid_moe_2b", "hybrid_moe_2b:transformer"]
# Kernel name -> what it does (first match wins). Inductor's kernels start with triton_.
KERNEL_GROUPS = [
    ("optimizer / clipping (multi_tensor_apply)", r"multi_tensor|foreach"),
    ("inductor fused (triton_)", r"^triton_"),
    ("attention (flash / cudnn sdpa)", r"flash|fmha|sdpa|attention"),
    ("GEMM (cuBLAS / CUTLASS)", r"gemm|nvjet|cutlass|xmma|sm90_|wgmma|cublas|splitK"),
    ("mamba_ssm SSD / gated norm (Triton)",
     r"^_chunk|^_state_passing|^_bmm_chunk|^_layer_norm|^_chunk_cumsum"),
    ("fla (Triton)", r"chunk_.*kernel|recompute_w_u|l2norm|solve_tril|wy_fast|kda"),
    ("conv (cuDNN / ATen)", r"conv|cudnn|implicit_gemm|dgrad|wgrad"),
    ("copies / fills", r"Memcpy|Memset|copy|fill|cat"),
    ("ATen elementwise / reductions", r"elementwise|reduce|vectorized|unrolled|at::native"),
]
# Names of profiler ranges, which the trace also draws on the GPU's timeline.
ANNOTATION = re.compile(r"^(fwd|bwd) |^Optimizer\.|#")


def kernel_group(name: str) -> str:
    for group, pattern in KERNEL_GROUPS:
        if re.search(pattern, name, re.IGNORECASE):
            return group
    return "other"


# ----------------------------------------------------------------------------- the worker


class Stamp:
    """A point in the GPU's stream (a CUDA event), or in time on CPU (where ops are
    synchronous); read `a.ms_until(b)` after a synchronize."""

    def __init__(self) -> None:
        if torch.cuda.is_available():
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()
        else:
            self.event = time.perf_counter()

    def ms_until(self, later: Stamp) -> float:
        if isinstance(self.event, float):
            return (later.event - self.event) * 1e3
        return self.event.elapsed_time(later.event)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def layer_label(module: torch.nn.Module) -> str:
    inner = getattr(module, "_checkpoint_wrapped_module", module)
    if hasattr(inner, "symbol"):
        return inner.symbol
    if hasattr(inner, "layers"):  # a bracket group
        return "[" + "".join(layer_label(child) for child in inner.layers.values()) + "]"
    return "mtp depth" if hasattr(inner, "eh_proj") else type(inner).__name__


class LayerTimer:
    """Forward / backward stamps of each top-level unit, for the steps it is `active` in;
    `ranges`: also open profiler ranges named `fwd LABEL` / `bwd LABEL` around them."""

    def __init__(self, model: torch.nn.Module) -> None:
        units = [*model.layers.values(), *model.mtp]
        self.labels = [layer_label(unit) for unit in units]
        self.active, self.ranges = False, False
        self.steps: list[list[dict]] = []
        self._open: dict[int, object] = {}
        for index, unit in enumerate(units):
            unit.register_forward_pre_hook(self._pre_hook(index))
            unit.register_forward_hook(self._post_hook(index))

    def _mark(self, index: int, what: str) -> None:
        self.steps[-1][index][what] = Stamp()
        direction, edge = what.split("_")
        key = (index, direction)
        if self.ranges and edge == "start":
            self._open[key] = torch.profiler.record_function(f"{direction} {self.labels[index]}")
            self._open[key].__enter__()
        elif self.ranges and key in self._open:
            self._open.pop(key).__exit__(None, None, None)

    def _pre_hook(self, index: int):
        def hook(module, args):
            if not self.active:
                return
            self._mark(index, "fwd_start")
            h = args[0]
            if isinstance(h, torch.Tensor) and h.requires_grad:
                h.register_hook(lambda grad: self._mark(index, "bwd_end"))
        return hook

    def _post_hook(self, index: int):
        def hook(module, args, output):
            if not self.active:
                return
            self._mark(index, "fwd_end")
            out = output[0] if isinstance(output, tuple) else output
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda grad: self._mark(index, "bwd_start"))
        return hook

    def new_step(self) -> None:
        self.steps.append([{} for _ in self.labels])

    def per_kind_ms(self) -> dict[str, dict[str, float]]:
        """{label: {count, fwd, bwd}} in ms per step, averaged over the recorded steps."""
        table = collections.defaultdict(lambda: {"count": 0, "fwd": 0.0, "bwd": 0.0})
        for step in self.steps:
            for label, marks in zip(self.labels, step):
                entry = table[label]
                entry["count"] += 1 / len(self.steps)
                for direction in ("fwd", "bwd"):
                    start, end = marks.get(f"{direction}_start"), marks.get(f"{direction}_end")
                    if start is not None and end is not None:
                        entry[direction] += start.ms_until(end) / len(self.steps)
        return dict(table)


def kernel_tables(prof) -> dict:
    """Per kernel name: calls and GPU ms (the profiler's device events); and GPU ms by the
    layer range (`fwd M`, `bwd M`, ...) whose CPU ops launched each kernel."""
    by_name = collections.defaultdict(lambda: [0, 0.0])
    by_range = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            # the GPU's copies of the ranges (ours, and the optimizer's) are not kernels
            if getattr(event, "is_user_annotation", False) or ANNOTATION.search(event.name):
                continue
            by_name[event.name][0] += 1
            by_name[event.name][1] += event.time_range.elapsed_us() / 1e3
            continue
        kernels = getattr(event, "kernels", None) or []
        if not kernels:
            continue
        label, parent = "outside layers", event
        while parent is not None:
            if re.match(r"^(fwd|bwd) ", parent.name):
                label = parent.name
                break
            parent = parent.cpu_parent
        by_range[label] += sum(kernel.duration for kernel in kernels) / 1e3
    return {"by_name": {name: {"calls": calls, "ms": ms} for name, (calls, ms) in by_name.items()},
            "by_range": dict(by_range)}


def worker(out: Path, job_args: list[str], profile_step: int, timed_from: int,
           trace: bool) -> None:
    """One job in this process: titan_hybrid.train's run, with the step instrumented."""
    from titan_hybrid.adapters.installed import front_end
    from titan_hybrid.launch import set_one_process_environment
    from titan_hybrid.ops.kernels import kernel_fallbacks
    from titan_hybrid.training.preflight import check_run

    set_one_process_environment()  # as `python -m titan_hybrid.launch` with one process
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    from torchtitan.tools.logging import init_logger
    init_logger()
    front_end.activate()
    job = front_end.parse_job(job_args)
    config = front_end.run_config(job)
    check_run(config, 1)
    for line in kernel_fallbacks():
        print(f"kernel fallback: {line}", flush=True)
    print(autotune_picks.install_picks_at_start_up() or "autotune picks: none (no CUDA or no mamba_ssm)",
          flush=True)
    trainer = front_end.build_trainer(job, config)
    timer = LayerTimer(trainer.model_parts[0])
    step_marks, profiles = [], {}
    original_step = trainer.train_step

    def instrumented_step(data_iterator):
        timer.active = trainer.step >= timed_from
        if trainer.step == profile_step:
            timer.new_step()
            timer.active, timer.ranges = True, True
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities) as prof:
                original_step(data_iterator)
                synchronize()
            timer.ranges, timer.active = False, False
            timer.steps.pop()  # the profiled step's stamps carry the profiler's overhead
            profiles["kernels"] = kernel_tables(prof)
            if trace:
                prof.export_chrome_trace(str(out / "trace.json"))
            return
        if timer.active:
            timer.new_step()
            start = Stamp()
            original_step(data_iterator)
            step_marks.append((start, Stamp()))
        else:
            original_step(data_iterator)

    trainer.train_step = instrumented_step
    # torchtitan resets the peak memory counters at each log line: read them first
    peaks = {"allocated": 0, "reserved": 0}
    original_log = trainer.metrics_processor.log

    def log_after_reading_peaks(*args, **kwargs):
        if torch.cuda.is_available():
            peaks["allocated"] = max(peaks["allocated"], torch.cuda.max_memory_allocated())
            peaks["reserved"] = max(peaks["reserved"], torch.cuda.max_memory_reserved())
        return original_log(*args, **kwargs)

    trainer.metrics_processor.log = log_after_reading_peaks
    try:
        trainer.train()
    finally:
        trainer.close()
    synchronize()
    result = {
        "per_kind_ms": timer.per_kind_ms(),
        "step_ms": sum(a.ms_until(b) for a, b in step_marks) / max(1, len(step_marks)),
        "timed_steps": len(step_marks),
        "max_memory_allocated_gib": peaks["allocated"] / 2**30,
        "max_memory_reserved_gib": peaks["reserved"] / 2**30,
        **profiles,
    }
    (out / "result.json").write_text(json.dumps(result, indent=1))


# ----------------------------------------------------------------------------- the report


# A job's variants (`FLAVOR:VARIANT+VARIANT`): the trainer's options each adds.
VARIANTS = {
    "transformer": [],  # the pattern, below
    "ac_none": ["--activation_checkpoint.mode", "none"],
    "ac_op": ["--activation_checkpoint.mode", "selective",
              "--activation_checkpoint.selective_ac_option", "op"],
    # full AC on the attention, MLP and MoE layers; the recurrent layers keep their activations
    "ac_kinds": ["--activation_checkpoint.mode", "full",
                 "--activation_checkpoint.layer_kinds", "*-E"],
}


def job_command(job: str, args, out: Path) -> tuple[list[str], str]:
    """The worker's command for `FLAVOR[:VARIANT[+VARIANT...]]`; a variant is one of VARIANTS
    or bN (local batch N)."""
    flavor, _, variants = job.partition(":")
    variants = [v for v in variants.split("+") if v]
    batch = args.batch
    for variant in variants:
        if re.fullmatch(r"b\d+", variant):
            batch = int(variant[1:])
        elif variant not in VARIANTS:
            raise SystemExit(f"--jobs: variant '{variant}' of '{job}' is not one of "
                             f"{', '.join(VARIANTS)} or bN")
    pattern = (transformer_pattern(hybrid_flavors[flavor].pattern)
               if "transformer" in variants else None)
    command = trainer_command(flavor, batch=batch, seq_len=args.seq_len, steps=args.steps,
                              dump_folder=out / "dump", pattern=pattern)
    for variant in variants:
        command += VARIANTS.get(variant, [])
    job_args = command[command.index("--job.config_file"):]
    worker_args = ["--worker", str(out), "--profile-step", str(args.steps // 2 - 1),
                   "--timed-from", str(args.steps // 2 + 1)]
    if args.trace and job == args.jobs[0]:
        worker_args.append("--trace")
    return [sys.executable, str(Path(__file__).resolve()), *worker_args, "--", *job_args], flavor


def markdown(job: str, run: dict, result: dict | None) -> str:
    lines = [f"### {job}", "", "| trainer row | tokens/s | TFLOP/s | MFU | peak GiB | 1st step s |",
             "| --- | --- | --- | --- | --- | --- |"]
    cells = row(job, run).split()
    lines.append("| " + " | ".join([job, *cells[-5:]]) + " |" if run["steps"] else
                 f"| {job} | FAILED (exit {run['returncode']}) | | | | |")
    if result is None:
        return "\n".join(lines) + "\n"
    step = result["step_ms"]
    lines += ["", f"GPU ms per step (CUDA events, mean of {result['timed_steps']} steps): "
              f"**{step:.1f}**; peak allocated {result['max_memory_allocated_gib']:.1f} GiB, "
              f"reserved {result['max_memory_reserved_gib']:.1f} GiB", "",
              "| layer kind | layers | forward ms | backward ms (with recompute) | total ms | "
              "share |", "| --- | --- | --- | --- | --- | --- |"]
    layers_ms = 0.0
    for label, entry in sorted(result["per_kind_ms"].items(),
                               key=lambda item: -(item[1]["fwd"] + item[1]["bwd"])):
        total = entry["fwd"] + entry["bwd"]
        layers_ms += total
        lines.append(f"| {label} | {entry['count']:.0f} | {entry['fwd']:.1f} | "
                     f"{entry['bwd']:.1f} | {total:.1f} | {100 * total / step:.1f}% |")
    lines.append(f"| rest (embedding, head, loss, clip, optimizer) | | | | "
                 f"{step - layers_ms:.1f} | {100 * (step - layers_ms) / step:.1f}% |")
    kernels = result.get("kernels")
    if kernels:
        by_name = {name: entry for name, entry in kernels["by_name"].items()
                   if not ANNOTATION.search(name)}
        by_group = collections.defaultdict(float)
        for name, entry in by_name.items():
            by_group[kernel_group(name)] += entry["ms"]
        total = sum(by_group.values())
        lines += ["", f"Profiled step: {total:.1f} ms of kernels, so the GPU idles about "
                  f"{step - total:.1f} ms of a {step:.1f} ms step (waiting for the CPU's "
                  "launches).", "",
                  "| kernel group | ms | share |", "| --- | --- | --- |"]
        for group, ms in sorted(by_group.items(), key=lambda item: -item[1]):
            lines.append(f"| {group} | {ms:.1f} | {100 * ms / total:.1f}% |")
        lines += ["", "| range | kernel ms |", "| --- | --- |"]
        for label, ms in sorted(kernels["by_range"].items(), key=lambda item: -item[1]):
            lines.append(f"| {label} | {ms:.1f} |")
        lines += ["", "| top kernel | calls | ms | share |", "| --- | --- | --- | --- |"]
        top = sorted(by_name.items(), key=lambda item: -item[1]["ms"])[:25]
        for name, entry in top:
            lines.append(f"| `{name[:90]}` | {entry['calls']} | {entry['ms']:.2f} | "
                         f"{100 * entry['ms'] / total:.1f}% |")
    return "\n".join(lines) + "\n"


def save_caches(out: Path) -> None:
    """The compile caches, for the next machine (at most 16 MiB come back from a GPU host)."""
    inductor_default = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"
    folders = [Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache")),
               Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR", inductor_default))]
    with tarfile.open(out / "compile_caches.tar.gz", "w:gz") as tar:
        for folder in folders:
            if folder.is_dir():
                tar.add(folder, arcname=folder.name)
    print(f"caches: {(out / 'compile_caches.tar.gz').stat().st_size / 2**20:.1f} MiB "
          f"({', '.join(str(f) for f in folders if f.is_dir())})", flush=True)


def write_picks(args) -> None:
    """The autotune picks of this host's Triton cache, as bench/autotune_picks.py writes them
    (kernels whose shipped pick was installed were not timed: --no-autotune-picks times all)."""
    cache = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    if not cache.is_dir() or not torch.cuda.is_available():
        return
    major, minor = torch.cuda.get_device_capability()
    measured = {"device": torch.cuda.get_device_name(), "capability": f"{major}.{minor}",
                "triton": importlib.metadata.version("triton"),
                "mamba_ssm": installed_version("mamba_ssm"), "date": time.strftime("%Y-%m-%d"),
                "jobs": f"{', '.join(args.jobs)} (batch {args.batch} x {args.seq_len})"}
    table = autotune_picks_table.write_table(cache, args.out / "autotune_picks.json", measured)
    untimed = "" if args.no_autotune_picks else "; kernels given a pick were not timed"
    print(f"autotune picks: {len(table['picks'])} -> {args.out / 'autotune_picks.json'} (for "
          f"titan_hybrid/assets/autotune_picks/sm{major}{minor}.json{untimed})", flush=True)


def logged_run(log: Path) -> dict:
    """run_trainer's record of a run, read back from its log."""
    lines = log.read_text().splitlines() if log.exists() else []
    steps = [parsed for parsed in map(parse_step_line, lines) if parsed is not None]
    return {"returncode": 0 if steps else 1, "first_step_s": float("nan"), "steps": steps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", nargs="+", default=DEFAULT_JOBS)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--deadline", type=float, default=420,
                        help="seconds: no job starts after this (each runs up to --timeout)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per job")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "outputs" / "gpu_profile")
    parser.add_argument("--no-caches", action="store_true")
    parser.add_argument("--no-autotune-picks", action="store_true",
                        help="the workers autotune every kernel (TITAN_HYBRID_AUTOTUNE_PICKS=0)")
    parser.add_argument("--trace", action="store_true",
                        help="also the first job's chrome trace (OUT/JOB/trace.json)")
    parser.add_argument("--report-only", action="store_true",
                        help="print the tables of the jobs already in --out, run nothing")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--profile-step", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--timed-from", type=int, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args(argv)
    if args.worker is not None:
        worker(args.worker, rest[1:] if rest[:1] == ["--"] else rest, args.profile_step,
               args.timed_from, args.trace)
        return 0
    if args.steps < 6 or args.steps % 2:
        parser.error("--steps must be even and at least 6")
    start, report, ok = time.perf_counter(), [], True
    if args.no_autotune_picks:
        os.environ[autotune_picks.OPT_OUT] = "0"  # the workers inherit it
    args.out = args.out.resolve()
    print(f"gpu_profile: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}"
          f", torch {torch.__version__}, batch {args.batch} x {args.seq_len}, {args.steps} steps",
          flush=True)
    for job in args.jobs:
        if time.perf_counter() - start > args.deadline:
            print(f"{job}: skipped (deadline)", flush=True)
            continue
        out = args.out / re.sub(r"\W+", "_", job)
        out.mkdir(parents=True, exist_ok=True)
        command, _ = job_command(job, args, out)
        if args.report_only:
            run = logged_run(out / "trainer.log")
        else:
            run = run_trainer(command, out / "trainer.log", args.timeout)
        result_file = out / "result.json"
        result = json.loads(result_file.read_text()) if result_file.exists() else None
        ok &= run["returncode"] == 0 and result is not None
        report.append(markdown(job, run, result))
        print(report[-1], flush=True)
        (args.out / "tables.md").write_text("\n".join(report))
    if not (args.no_caches or args.report_only):
        save_caches(args.out)
        write_picks(args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

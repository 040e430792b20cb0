"""Make torchtitan 0.2.2's trainer run on CPU (gloo), without editing torchtitan.

torchtitan assumes CUDA. Each patch below removes one obstacle found by running its trainer on a
CPU-only machine; all are applied by `apply()`, which does nothing when an accelerator exists.
The two that touch private names live in titan_hybrid.compat and are only called from here.

- device: `torchtitan.tools.utils` computes `device_type = ... or "cuda"` at import time and
  several modules copy it with `from ... import device_type`. Those module globals become "cpu"
  (functions read globals at call time), with a CPU device module that has the memory-API
  methods torchtitan's DeviceMemoryMonitor calls (compat.torchtitan.point_device_globals_at_cpu).
  Works whether or not torchtitan was imported first, so `python -m torchtitan.train
  --experimental.custom_import titan_hybrid.torchtitan_plugin` runs.
- fsdp_sum: torchtitan asks FSDP2 for `gradient_divide_factor=1.0`, which FSDP2 implements with
  ReduceOp.PREMUL_SUM; gloo rejects that op. Force plain SUM on CPU (torch already does so for
  MTIA); the divide then happens locally, which is the same arithmetic
  (compat.fsdp.force_sum_reduction_on_cpu).
- peak flops: MFU on CPU divides by the best fp32 matmul rate measured on this machine, cached
  per machine (see `measured_peak_flops`). The trainer and the metrics processor both call
  `torchtitan.tools.utils.get_peak_flops` through that module, so it is set there once.

torchtitan's own MoE needs two more patches on CPU (int64 `torch.histc`, its Triton token
permute); titan_hybrid's MoE uses neither, so they are not applied.

- gloo at exit: a gloo worker thread drops its finished collective (and the tensors it holds)
  just after the caller's wait returns. If that falls into the interpreter's finalization, the
  thread cannot take the GIL to release the tensors' Python objects, and the process aborts
  ("terminate called without an active exception"; seen in CI, from a core dump:
  ~AsyncAllreduceWork on a gloo thread during finalization). `titan_hybrid.train` leaves with
  `os._exit` once the process group is gone; for `python -m torchtitan.train` an exit hook of a
  distributed worker sleeps a moment with the GIL released, so the threads finish first.
  This is the one sleep left standing for a condition, because the condition cannot be
  observed or brought about from outside gloo (issue 34, item 4):
  - the condition, "every gloo worker thread has released its last work", is internal to
    ProcessGroupGloo (its work-in-progress slots); no torch API reports it;
  - the threads (named `pt_gloo_runloop`) are joined only by ProcessGroupGloo's destructor, not
    by `destroy_process_group` (it calls `shutdown`, which leaves them running), and after
    torchtitan's `main` returns every group of the run is still referenced from outside
    Python's collector (refcount 1 more than its locals, no referrer `gc` can see), so
    `gc.collect()` at exit destroys none and the threads live into finalization (torch 2.13);
  - one more collective cannot settle it either: the thread that runs it has released its
    previous work, but the group's other thread may still be releasing one;
  - without the hook, 40 two-rank `torchrun -m torchtitan.train` runs here (20 FSDP, 20 PP2,
    torch 2.13) ended cleanly, so the abort is rare and a loop here cannot show a replacement
    works: the hook stays.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import platform
import resource
import time
import types
from pathlib import Path

import torch

from titan_hybrid.compat.fsdp import force_sum_reduction_on_cpu
from titan_hybrid.compat.torchtitan import point_device_globals_at_cpu

_applied = False
# How long a worker's exit waits for gloo's threads (see "gloo at exit" above: the only sleep
# standing in for a condition, which gloo does not expose).
GLOO_SETTLE_SECONDS = 0.25


def accelerator_available() -> bool:
    return torch.cuda.is_available() or (
        hasattr(torch, "xpu") and torch.xpu.is_available()
    )


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _cpu_device_module() -> types.ModuleType:
    """torch.cpu plus the CUDA-style memory API that torchtitan's memory monitor calls."""
    total_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    module = types.ModuleType("titan_hybrid_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("__"):
            setattr(module, name, getattr(torch.cpu, name))
    module.set_device = lambda *args, **kwargs: None
    module.current_device = lambda: 0
    module.device_count = lambda: 1
    module.is_available = lambda: True
    module.synchronize = lambda *args, **kwargs: None
    module.get_device_name = lambda *args, **kwargs: f"{platform.processor() or 'cpu'} (CPU)"
    module.get_device_properties = lambda *args, **kwargs: types.SimpleNamespace(
        name="cpu", total_memory=total_bytes, multi_processor_count=os.cpu_count()
    )
    module.reset_peak_memory_stats = lambda *args, **kwargs: None
    module.empty_cache = lambda *args, **kwargs: None
    # Peak resident set size stands in for the allocator's peak: the closest CPU analogue.
    module.memory_stats = lambda *args, **kwargs: {
        "active_bytes.all.peak": peak_rss_bytes(),
        "reserved_bytes.all.peak": peak_rss_bytes(),
        "num_alloc_retries": 0,
        "num_ooms": 0,
    }
    module.max_memory_allocated = lambda *args, **kwargs: peak_rss_bytes()
    module.memory_allocated = lambda *args, **kwargs: 0
    module.manual_seed = torch.manual_seed
    module.manual_seed_all = torch.manual_seed
    return module


def matmul_flops(size: int = 1536, trials: int = 5) -> float:
    """fp32 matmul FLOP/s of this process now: the best of several timed matmuls after a
    warm-up (one timing on a shared machine catches other load and understates the rate)."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    torch.mm(a, b)  # warm-up: thread pool and allocator
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def peak_flops_cache() -> Path:
    return Path(os.environ.get("TITAN_HYBRID_CACHE", Path.home() / ".cache" / "titan_hybrid")
                ) / "cpu_peak_flops.json"


# After this many measurements at one key the best of them is used without measuring again:
# each measurement costs a second of every process's start-up, and a higher one is rarely seen
# after the first few on a machine.
MEASUREMENTS_PER_MACHINE = 8


@functools.cache
def measured_peak_flops() -> float:
    """The MFU denominator on CPU: the best fp32 matmul rate measured on this machine at this
    thread count and torch version.

    One measurement varies about 3x on a shared machine (3.6e10-1.1e11 FLOP/s seen on the same
    2-core VM), and a low one makes MFU exceed 100%. The first `MEASUREMENTS_PER_MACHINE` runs
    each measure once and keep the best in a small per-machine cache (`$TITAN_HYBRID_CACHE`,
    default ~/.cache/titan_hybrid); later runs read the best from it.
    """
    key = (f"{platform.processor() or platform.machine()} | {os.cpu_count()} cpus | "
           f"{torch.get_num_threads()} threads | torch {torch.__version__}")
    path = peak_flops_cache()
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    entry = known.get(key)
    if not isinstance(entry, dict):  # absent, or a bare figure from an older cache
        entry = {"best": float(entry or 0.0), "measurements": int(entry is not None)}
    if entry["measurements"] >= MEASUREMENTS_PER_MACHINE:
        return float(entry["best"])
    entry = {"best": max(matmul_flops(), float(entry["best"])),
             "measurements": entry["measurements"] + 1}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({**known, key: entry}, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home only costs the cache
    return entry["best"]


def apply() -> bool:
    """Apply every CPU patch once, if no accelerator exists. Returns whether they are active."""
    global _applied
    if _applied:
        return True
    if accelerator_available():
        return False
    import torchtitan.tools.utils as tt_utils

    point_device_globals_at_cpu(_cpu_device_module())
    force_sum_reduction_on_cpu()
    # The MFU denominator; on CPU torchtitan would fall back to an A100 figure.
    tt_utils.get_peak_flops = lambda device_name: measured_peak_flops()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        atexit.register(time.sleep, GLOO_SETTLE_SECONDS)
    _applied = True
    return True

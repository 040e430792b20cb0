"""Make torchtitan 0.2.2's trainer run on CPU (gloo), without editing torchtitan.

torchtitan assumes CUDA. Each patch below removes one obstacle found by running its trainer on a
CPU-only machine; all are applied by `apply()`, which does nothing when an accelerator exists.

- device: `torchtitan.tools.utils` computes `device_type = ... or "cuda"` at import time and
  several modules copy it with `from ... import device_type`. We rewrite those module globals to
  "cpu" (functions read globals at call time) and give them a CPU device module that has the
  memory-API methods torchtitan's DeviceMemoryMonitor calls. Works whether or not torchtitan was
  imported first, so `python -m torchtitan.train --experimental.custom_import titan_hybrid` runs.
- fsdp_sum: torchtitan asks FSDP2 for `gradient_divide_factor=1.0`, which FSDP2 implements with
  ReduceOp.PREMUL_SUM; gloo rejects that op. Force plain SUM on CPU (torch already does so for
  MTIA); the divide then happens locally, which is the same arithmetic.
- histc: torchtitan's MoE calls `torch.histc` on int64 expert ids; the CPU kernel only takes
  floating dtypes. Counting small integers in float32 is exact.
- moe_permute: torchtitan's expert-parallel permute uses a Triton kernel that has no CPU driver;
  the function has a `use_cpu=True` path, which we select for CPU tensors.
- peak flops: MFU on CPU divides by the best fp32 matmul rate measured on this machine, cached
  per machine (see `measured_peak_flops`).

The gloo-at-exit abort is handled by the launcher (`titan_hybrid.train`), which leaves with
`os._exit` once the process group is gone.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import resource
import sys
import time
import types
from pathlib import Path

import torch

_applied = False


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


@functools.cache
def measured_peak_flops() -> float:
    """The MFU denominator on CPU: the best fp32 matmul rate ever measured on this machine at
    this thread count and torch version.

    One measurement varies about 3x on a shared machine (3.6e10-1.1e11 FLOP/s seen on the same
    2-core VM), and a low one makes MFU exceed 100%. Each run measures once more and keeps the
    best in a small per-machine cache (`$TITAN_HYBRID_CACHE`, default ~/.cache/titan_hybrid),
    so the figure only rises towards the machine's real peak.
    """
    key = (f"{platform.processor() or platform.machine()} | {os.cpu_count()} cpus | "
           f"{torch.get_num_threads()} threads | torch {torch.__version__}")
    path = peak_flops_cache()
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    best = max(matmul_flops(), float(known.get(key, 0.0)))
    if best > float(known.get(key, 0.0)):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}")
            tmp.write_text(json.dumps({**known, key: best}, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only home only costs the cache
    return best


def _patch_device_globals(cpu_module: types.ModuleType) -> None:
    import torchtitan.tools.utils as tt_utils

    tt_utils.device_type, tt_utils.device_module = "cpu", cpu_module
    for name, module in list(sys.modules.items()):
        if not name.startswith("torchtitan") or module is None:
            continue
        if getattr(module, "device_type", None) == "cuda":
            module.device_type = "cpu"
        if getattr(module, "device_module", None) is torch.cuda:
            module.device_module = cpu_module

    # The trainer asks this for the MFU denominator; on CPU it would fall back to an A100 figure.
    tt_utils.get_peak_flops = lambda device_name: measured_peak_flops()
    import torchtitan.components.metrics as tt_metrics

    tt_metrics.utils.get_peak_flops = tt_utils.get_peak_flops


def _patch_fsdp_sum_reduction() -> None:
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as collectives

    original = collectives._get_gradient_divide_factors

    @functools.wraps(original)
    def sum_on_cpu(rs_group, ar_group, reduce_dtype, device_type="", factor=None,
                   force_sum_reduction_for_comms=False):
        if device_type == "cpu":
            force_sum_reduction_for_comms = True
        return original(rs_group, ar_group, reduce_dtype, device_type, factor,
                        force_sum_reduction_for_comms)

    collectives._get_gradient_divide_factors = sum_on_cpu


def _patch_integer_histc() -> None:
    original = torch.histc

    @functools.wraps(original)
    def histc(input, bins=100, min=0, max=0, *, out=None):
        if input.device.type == "cpu" and not input.is_floating_point() and out is None:
            return original(input.float(), bins=bins, min=min, max=max).to(input.dtype)
        if out is None:
            return original(input, bins=bins, min=min, max=max)
        return original(input, bins=bins, min=min, max=max, out=out)

    torch.histc = histc


def _patch_moe_permute() -> None:
    import torchtitan.models.moe.utils as moe_utils

    original = moe_utils.generate_permute_indices

    @functools.wraps(original)
    def permute_indices(tokens_per_expert_group, *args, use_cpu=False, **kwargs):
        use_cpu = use_cpu or tokens_per_expert_group.device.type == "cpu"
        return original(tokens_per_expert_group, *args, use_cpu=use_cpu, **kwargs)

    moe_utils.generate_permute_indices = permute_indices


def apply() -> bool:
    """Apply every CPU patch once, if no accelerator exists. Returns whether they are active."""
    global _applied
    if _applied:
        return True
    if accelerator_available():
        return False
    _patch_device_globals(_cpu_device_module())
    _patch_fsdp_sum_reduction()
    _patch_integer_histc()
    _patch_moe_permute()
    _applied = True
    return True

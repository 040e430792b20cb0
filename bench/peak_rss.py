"""Peak memory of one step on CPU, where torch has no allocator statistics: how far the step
raises the process's peak RSS (Linux VmHWM, the figure ru_maxrss reports) above the RSS before
it, measured in a fresh process so that nothing earlier hides the step's peak.

`rss_growth(step)` runs in that process; `in_fresh_process(script, args)` starts it. The child
runs with glibc's mmap threshold fixed at 64 KiB: glibc would otherwise raise it (to up to
32 MiB) as tensors are freed, and RSS would follow heap fragmentation instead of live tensors
(repeated probes then agree to ~0.1% rather than ~20%).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from collections.abc import Callable


def _rss_and_peak() -> tuple[int, int]:
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f)
    return tuple(int(status[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM"))


def rss_growth(step: Callable[[], object]) -> dict:
    """{"bytes": the peak-RSS growth of `step()`, "lower_bound": True when the peak could not
    be reset first, so an earlier, higher peak may hide the step's}."""
    gc.collect()
    try:  # "5" resets the peak RSS (VmHWM) to the current RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not Linux, or not permitted: the figure is then a lower bound
        pass
    rss_before, peak_before = _rss_and_peak()
    step()
    peak = _rss_and_peak()[1]
    return {"bytes": peak - rss_before, "lower_bound": peak <= peak_before}


def in_fresh_process(script: str, args: list[str]) -> dict:
    """Run `python script *args` (which prints rss_growth's dict as its last line, as JSON) and
    return that dict."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    done = subprocess.run([sys.executable, os.path.abspath(script), *args], capture_output=True,
                          text=True, check=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def fmt_mib(measured: dict | None) -> str:
    """A probe's peak in MiB for a table cell; "+" marks a lower bound, "-" no probe."""
    if measured is None:
        return "-"
    return f"{measured['bytes'] / 2**20:,.0f}{'+' if measured['lower_bound'] else ''}"

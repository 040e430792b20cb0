"""Every private torch / torchtitan / kernel-package name titan_hybrid uses, in one fenced
package.

Outside this package titan_hybrid uses only public names of torch, torchtitan and the GPU
kernel packages mamba_ssm, fla and causal_conv1d (tests/unit/test_compat.py checks it). Each
private use here says why no public API suffices and was checked on the versions below (torch
2.11, 2.13, 2.14 and 2.15, each of which CI runs the whole suite on, with torchtitan 0.2.2, and
torch 2.14 and 2.15 with torchtitan 0.3.0; the kernel packages' in kernel_packages.py); where a
release differs, the module takes a path chosen by `TORCH_RELEASE`. Importing this package (or any module in it) on other versions
raises ImportError before anything else happens: private names move between releases without
notice, and a clear refusal beats a wrong result.

Importing changes nothing global. The two patches (`point_device_globals_at_cpu`,
`force_sum_reduction_on_cpu`) run only when titan_hybrid.runtime.cpu.apply() calls them.

    torchtitan.py  torchtitan's device-type globals (patch), the same in 0.2 and 0.3
    torchtitan_0_2.py, torchtitan_0_3.py  each generation's CheckpointManager / ModelWrapper
                   hooks under the same public names, and its final sleep; torchtitan_hooks.py
                   picks the installed one
    collectives.py the functional all-to-all, all-gather and reduce-scatter, for context
                   parallelism inside compiled graphs
    process_groups.py  c10d's registry of the process groups a process holds (logged)
    dcp.py         DCP's chunk protocol, data-less wrapper tensors, a DTensor shard's offsets;
                   the background stager that keeps its buffers (a 2.11 / 2.12 path), and
                   the CUDA one that copies on a stream of its own
    fsdp.py        FSDP2's `replicate` (DDP); plain SUM gradient reduction on CPU (patch)
    pipelining.py  torch's pipelining runtime, for custom (overlapped) actions; schedules'
                   private fields; the hook after the first step's shape inference
    kernel_packages.py  the kernel packages' forward / backward launchers (mamba_ssm's are
                   private), imported when called. The kernel packages are optional, so a
                   version outside the accepted range, or a launcher whose signature changed,
                   is not an ImportError here but a package the start-up probe
                   (titan_hybrid.ops.kernels) reports unusable, saying which
    triton_autotune.py  mamba_ssm's SSD autotuners and Triton's in-memory table of their
                   choices, which the shipped autotune picks fill (titan_hybrid.ops.autotune_picks)
"""

from __future__ import annotations

import importlib.metadata
import re

import torch

# major.minor, every patch release of these: exactly the versions CI runs the whole suite on
# (.ci/run, scripts/bootstrap.sh). 2.12 was read, not run, so it is refused like any other.
CHECKED_TORCH = ("2.11", "2.13", "2.14", "2.15")
# Each torchtitan release checked, with the torch lines it was checked with: 0.3.0 was released
# against torch 2.14 and calls APIs (torch.distributed.set_timeout, the schedules' `arg_mbs`)
# that 2.11 and 2.13 lack.
CHECKED_TORCHTITAN = {"0.2.2": CHECKED_TORCH, "0.3.0": ("2.14", "2.15")}


def _release(version: str, parts: int) -> str:
    """The first `parts` numbers of a version string: "2.13.0+cpu", 2 -> "2.13"."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return ".".join((match.group(0) if match else "").split(".")[:parts])


def check_versions(torch_version: str, torchtitan_version: str) -> None:
    """Raise ImportError unless both versions are ones the private names were checked on,
    together."""
    torch_lines = CHECKED_TORCHTITAN.get(_release(torchtitan_version, 3), ())
    if _release(torch_version, 2) in torch_lines:
        return
    pairs = "; ".join(f"torchtitan {titan} with torch {' / '.join(v + '.x' for v in lines)}"
                      for titan, lines in CHECKED_TORCHTITAN.items())
    raise ImportError(
        f"titan_hybrid uses private torch / torchtitan names that were checked (and its tests "
        f"run) on {pairs}, but torch {torch_version} and torchtitan {torchtitan_version} are "
        "installed; install a checked pair (scripts/bootstrap.sh, pyproject.toml) or re-check "
        "titan_hybrid/compat/ against these ones")


def _installed_torchtitan() -> str:
    try:
        return importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


check_versions(torch.__version__, _installed_torchtitan())

# The installed torch as (major, minor), e.g. (2, 13): always one of CHECKED_TORCH here. The
# version-conditional paths in this package compare it (`TORCH_RELEASE < (2, 12)`).
TORCH_RELEASE: tuple[int, int] = tuple(int(p) for p in _release(torch.__version__, 2).split("."))
# The installed torchtitan as (major, minor): (0, 2) or (0, 3), the API generation whose adapter
# (titan_hybrid/adapters) runs.
TORCHTITAN_RELEASE: tuple[int, int] = tuple(
    int(p) for p in _release(_installed_torchtitan(), 2).split("."))

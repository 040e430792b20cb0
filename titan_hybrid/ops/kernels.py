"""Which path an op takes: a GPU kernel (mamba_ssm, fla, causal-conv1d) or its pure-torch twin.

By default an op calls its kernel for CUDA tensors when the kernel's package is usable here, and
its torch path otherwise. Inside ``force_kernels()`` the ops call the kernels for CPU tensors too:
that is how the tests run them in Triton's interpreter (``TRITON_INTERPRET=1`` executes Triton
kernels on CPU tensors with numpy)::

    with force_kernels():
        y = mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size=64)  # mamba_ssm's kernel

While forced, an unusable kernel package is an error rather than a silent fall-back to the torch
path, so a kernel test cannot pass by accident. Dtypes the kernels do not take (float64) still use
the torch path. Nothing here runs at import.

Usable means: the package's version is in the range our custom ops accept (they call
launchers below the packages' public APIs: titan_hybrid.compat.kernel_packages), the modules
they import do import (a package installed without its compiled extension fails here), every
launcher the ops call is there and takes the ops' call (its parameters, read from its
signature), and the package accepts this runtime (fla 0.6 raises in its backward on Hopper
GPUs with triton >= 3.4, < 3.7.1). ``probe_kernels()`` decides this once per process, outside
any traced code: dynamo cannot trace an import, and a failure found mid-step would kill the
run. The ops an unusable package serves then take their torch paths, ~3x slower on a GPU, so a
run says so twice: at start-up, ``kernel_fallbacks()``, one warning line per unusable package
with the whole reason (titan_hybrid.train), and on every logged step, ``kernel_path_field()``
in titan_hybrid's per-step line (titan_hybrid.training.metrics), for whoever looks at a slow
step long after start-up. Neither says anything without CUDA, where the torch paths are the
plan, not a fall-back.

Each kernel call goes through a ``torch.library`` custom op (``titan_hybrid::...``, defined by
the op modules), so ``torch.compile`` with ``fullgraph=True`` sees one opaque node per kernel
forward and backward instead of breaking its graph on Triton launches or C++ extensions.
"""

from __future__ import annotations

import contextlib
import importlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from titan_hybrid.compat import kernel_packages

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def fla_refusal(capability: tuple[int, int] | None, triton_version: str) -> str | None:
    """Why fla's gated delta rule may not run on a GPU of this compute capability with this
    triton: fla 0.6 refuses Hopper (sm_90) with triton >= 3.4.0, < 3.7.1 in its backward (its
    issue #640: the gated dq/dk/dw kernel computes wrong results there)."""
    if capability is None or capability[0] != 9:
        return None
    if (3, 4, 0) <= _version(triton_version) < (3, 7, 1):
        return (f"triton {triton_version} on a Hopper GPU gives wrong gated-delta-rule gradients "
                "(fla refuses triton >= 3.4.0, < 3.7.1 there; install triton >= 3.7.1)")
    return None


def _fla_refuses_this_runtime() -> str | None:
    if not torch.cuda.is_available():
        return None
    return fla_refusal(torch.cuda.get_device_capability(),
                       importlib.import_module("triton").__version__)


@dataclass(frozen=True)
class KernelPackage:
    name: str
    launchers: tuple[kernel_packages.Launcher, ...]  # what the custom ops call
    serves: str  # the ops that fall back to their torch paths without it
    refuses_runtime: Callable[[], str | None] = lambda: None

    @property
    def modules(self) -> tuple[str, ...]:
        """The modules its launchers come from, in order: what the probe imports."""
        return tuple(dict.fromkeys(launcher.module for launcher in self.launchers))


KERNEL_PACKAGES = {package.name: package for package in (
    KernelPackage("mamba_ssm", kernel_packages.launchers_of("mamba_ssm"),
                  "the Mamba2 SSD scan and gated RMS norm"),
    KernelPackage("fla", kernel_packages.launchers_of("fla"),
                  "the gated delta rule", refuses_runtime=_fla_refuses_this_runtime),
    KernelPackage("causal_conv1d", kernel_packages.launchers_of("causal_conv1d"),
                  "the Mamba2 / GDN causal convolution"),
)}

_forced = False
_unusable: dict[str, str | None] = {}  # package -> why it is unusable (None: usable)


@contextlib.contextmanager
def force_kernels() -> Iterator[None]:
    """Call the GPU kernels for CPU tensors too (not thread-safe: meant for tests). Probes again
    inside: tests make the kernel packages importable only for the block."""
    global _forced
    previous, _forced = _forced, True
    _unusable.clear()
    try:
        yield
    finally:
        _forced = previous
        _unusable.clear()


def kernels_forced() -> bool:
    return _forced


def _why_unusable(package: KernelPackage) -> str | None:
    # A version the metadata shows is checked before anything is imported (another version's
    # modules may not import, or import with other launchers); a version that only the package
    # itself states (`__version__`) is read once it is imported.
    version_known = kernel_packages.installed_version(package.name) is not None
    if version_known and (refusal := kernel_packages.version_refusal(package.name)):
        return refusal
    for module in package.modules:
        try:
            importlib.import_module(module)
        except Exception as error:  # a broken extension raises OSError / RuntimeError too
            first_line = (str(error).strip().splitlines() or [""])[0]
            return f"{module} does not import ({type(error).__name__}: {first_line})"
    if not version_known and (refusal := kernel_packages.version_refusal(package.name)):
        return refusal
    if refusal := kernel_packages.launcher_refusal(package.name, package.launchers):
        return refusal
    return package.refuses_runtime()


def _probe(name: str) -> str | None:
    if name not in _unusable:
        _unusable[name] = _why_unusable(KERNEL_PACKAGES[name])
    return _unusable[name]


def probe_kernels() -> dict[str, str | None]:
    """Every kernel package: None when the ops may call it here, else why not. Imports each
    package once per process (the result is kept)."""
    return {name: _probe(name) for name in KERNEL_PACKAGES}


def _fallback_reasons() -> dict[str, str]:
    """Why each kernel package the ops cannot use on this CUDA machine is unusable (nothing
    without CUDA, where the torch paths are the plan, not a fall-back)."""
    if not torch.cuda.is_available():
        return {}
    return {name: reason for name, reason in probe_kernels().items() if reason}


def kernel_fallbacks() -> list[str]:
    """One line per kernel package the ops cannot use on this CUDA machine: the start-up
    warnings."""
    return [f"kernel package {name} is not used: {reason}; the torch path runs "
            f"{KERNEL_PACKAGES[name].serves}" for name, reason in _fallback_reasons().items()]


def kernel_path_field() -> str | None:
    """`kernels: torch path (fla: <reason>; ...)` when some kernel package is unusable on this
    CUDA machine, for the per-step metrics line; None when every kernel runs (or without CUDA),
    so a run on the fused kernels keeps its line as it was. Reads the start-up probe's result."""
    reasons = _fallback_reasons()
    if not reasons:
        return None
    return "kernels: torch path (" + "; ".join(
        f"{name}: {reason}" for name, reason in reasons.items()) + ")"


# A constant of the graph when torch.compile meets it (dynamo calls it instead of tracing it):
# entry points probe before compiling, so this only reads the kept result.
@torch.compiler.assume_constant_result
def _package_usable(package: str) -> bool:
    return _probe(package) is None


def use_kernel(tensor: torch.Tensor, package: str) -> bool:
    """True when an op given `tensor` should call the kernel of `package` (KERNEL_PACKAGES)."""
    if not (tensor.is_cuda or _forced) or tensor.dtype not in KERNEL_DTYPES:
        return False
    if _package_usable(package):
        return True
    if _forced:
        raise RuntimeError(f"force_kernels(): the kernel package {package} is unusable: "
                           f"{_probe(package)} (install the gpu extra, or see "
                           "scripts/bootstrap.sh)")
    return False

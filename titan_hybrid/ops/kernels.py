"""Which path an op takes: a GPU kernel (mamba_ssm, its TileLang kernels, fla, causal-conv1d) or
its pure-torch twin.

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
they import do import (a package installed without its compiled extension fails here), and
every launcher the ops call is there and takes the ops' call (its parameters, read from its
signature). A usable package may still have single kernels that this runtime computes wrong:
the runtime refuses those custom ops alone (``RefusedOp``), and each one's caller takes the
torch path for that op while the rest of the package runs. Today that is fla's gated delta
rule backward on Hopper GPUs with triton >= 3.4, < 3.7.1 (``fla_gated_delta_bwd_refusal``):
GDN's forward, KDA and fla's l2norm keep fla's kernels there. ``probe_kernels()`` decides all
this once per process, outside any traced code: dynamo cannot trace an import, and a failure
found mid-step would kill the run. A torch path is ~3x slower on a GPU, so a run says so
twice: at start-up, ``kernel_fallbacks()``, one warning line per unusable package or refused
op with the whole reason (titan_hybrid.train), and on every logged step,
``kernel_path_field()`` in titan_hybrid's per-step line (titan_hybrid.training.metrics), for
whoever looks at a slow step long after start-up. Neither says anything without CUDA, where
the torch paths are the plan, not a fall-back. ``simulate_gpu_runtime()`` makes the probe and
both reports take a given GPU and triton (tests: a Hopper runtime on CPU).

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
from packaging.version import InvalidVersion, Version

from titan_hybrid.compat import kernel_packages

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def fla_gated_delta_bwd_refusal(capability: tuple[int, int] | None,
                                triton_version: str) -> str | None:
    """Why fla's gated delta rule backward may not run on a GPU of this compute capability
    with this triton. fla 0.6 raises in the gated branch of `chunk_bwd_dqkwg`
    (fla/ops/common/chunk_o.py: the dq / dk / dw / dg kernel that only the gated delta rule's
    backward calls here) when fla's IS_NVIDIA_HOPPER (compute capability 9) and triton >= 3.4.0,
    < 3.7.1: triton miscompiles that kernel there (fla issue #640, fixed in triton 3.7.1; the
    issue's bisection found only its BK = 64 tile wrong, but a launcher that avoids that tile
    was never checked on a Hopper GPU, so the whole backward takes the torch path). No other
    kernel the ops call checks the runtime: the forward, KDA's backward (it has its own fused
    dq / dk / dg kernel) and l2norm run. With tilelang installed fla would send that kernel to
    its TileLang backend instead of raising; that backend is not checked here, so the refusal
    holds either way."""
    if capability is None or capability[0] != 9:
        return None
    if (3, 4, 0) <= _version(triton_version) < (3, 7, 1):
        return (f"triton {triton_version} on a Hopper GPU miscompiles fla's gated dq/dk/dw "
                "backward kernel (chunk_bwd_dqkwg, fla issue #640: fla raises there with "
                "triton >= 3.4.0, < 3.7.1; install triton >= 3.7.1 for the kernel)")
    return None


def mamba3_siso_refusal(capability: tuple[int, int] | None,
                        mamba_ssm_version: str | None) -> str | None:
    """Why mamba_ssm's Mamba-3 SISO kernels may not run on a GPU of this compute capability:
    mamba-ssm <= 2.3.2.post1's SISO forward computes wrong outputs on Blackwell (compute
    capability 10; fixed on its main branch, state-spaces/mamba#997). The layers then take the
    torch path; mamba_ssm's other kernels run."""
    if capability is None or capability[0] != 10 or mamba_ssm_version is None:
        return None
    try:
        fixed = Version(Version(mamba_ssm_version).public) > Version("2.3.2.post1")
    except InvalidVersion:
        fixed = False
    if fixed:
        return None
    return (f"mamba-ssm {mamba_ssm_version}'s Mamba-3 SISO forward is wrong on Blackwell "
            "(compute capability 10; state-spaces/mamba#997, fixed after 2.3.2.post1)")


_simulated_gpu: tuple[tuple[int, int], str] | None = None


@contextlib.contextmanager
def simulate_gpu_runtime(capability: tuple[int, int], triton_version: str) -> Iterator[None]:
    """Probe and report as on a CUDA GPU of this compute capability with this triton, whatever
    the machine has (not thread-safe: meant for tests, e.g. a Hopper GPU with triton 3.6 on
    CPU). Probes again inside and after, as `force_kernels` does."""
    global _simulated_gpu
    previous, _simulated_gpu = _simulated_gpu, (tuple(capability), triton_version)
    _forget_probe()
    try:
        yield
    finally:
        _simulated_gpu = previous
        _forget_probe()


def _on_gpu() -> bool:
    return _simulated_gpu is not None or torch.cuda.is_available()


def _gpu_runtime() -> tuple[tuple[int, int], str] | None:
    """(compute capability, triton version) of the GPU the ops run on; None without one."""
    if _simulated_gpu is not None:
        return _simulated_gpu
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(), importlib.import_module("triton").__version__


@dataclass(frozen=True)
class RefusedOp:
    """A custom op of a usable kernel package that this runtime refuses: its caller runs the
    torch path for it (`kernel_op_refused`), the package's other ops run their kernels."""

    package: str
    op: str  # the custom op titan_hybrid::<op> that does not run
    serves: str  # what the torch path runs instead
    reason: str


def _fla_ops_this_runtime_refuses() -> tuple[RefusedOp, ...]:
    runtime = _gpu_runtime()
    reason = runtime and fla_gated_delta_bwd_refusal(*runtime)
    if not reason:
        return ()
    # gated_delta.py's backward then recomputes the forward on the torch path and
    # differentiates it
    return (RefusedOp("fla", "fla_gated_delta_bwd", "the gated delta rule's backward", reason),)


def _mamba_ssm_ops_this_runtime_refuses() -> tuple[RefusedOp, ...]:
    runtime = _gpu_runtime()
    reason = runtime and mamba3_siso_refusal(runtime[0],
                                             kernel_packages.installed_version("mamba_ssm"))
    if not reason:
        return ()
    return (RefusedOp("mamba_ssm", "mamba3_siso_fwd", "Mamba-3's SISO scan", reason),)


@dataclass(frozen=True)
class KernelPackage:
    name: str
    launchers: tuple[kernel_packages.Launcher, ...]  # what the custom ops call
    serves: str  # the ops that fall back to their torch paths without it
    fallback: str = "the torch path"  # what runs them instead
    refuses_ops: Callable[[], tuple[RefusedOp, ...]] = tuple  # of this runtime, once usable
    # Probed, and reported, only once a layer asks for it (`request_kernel_package` when it is
    # built, `use_kernel`): most models never call it, its import is slow (tilelang and
    # mamba_ssm's TileLang modules: ~10 s), and its absence says nothing about their speed.
    on_demand: bool = False

    @property
    def modules(self) -> tuple[str, ...]:
        """The modules its launchers come from, in order: what the probe imports."""
        return tuple(dict.fromkeys(launcher.module for launcher in self.launchers))


KERNEL_PACKAGES = {package.name: package for package in (
    KernelPackage("mamba_ssm", kernel_packages.launchers_of("mamba_ssm"),
                  "the Mamba2 SSD scan, the gated RMS norm and Mamba-3's SISO scan",
                  refuses_ops=_mamba_ssm_ops_this_runtime_refuses),
    KernelPackage("fla", kernel_packages.launchers_of("fla"),
                  "the gated delta rule and KDA", refuses_ops=_fla_ops_this_runtime_refuses),
    KernelPackage("causal_conv1d", kernel_packages.launchers_of("causal_conv1d"),
                  "the Mamba2 / GDN causal convolution",
                  fallback="titan_hybrid's Triton kernel (ops/conv_triton.py)"),
    KernelPackage("tilelang", kernel_packages.launchers_of("tilelang"),
                  "Mamba-3's MIMO scan (mamba_ssm's TileLang kernels)",
                  on_demand=True),
)}

_forced = False
_unusable: dict[str, str | None] = {}  # package -> why it is unusable (None: usable)
_refused: dict[str, tuple[RefusedOp, ...]] = {}  # usable package -> its ops this runtime refuses
_asked: set[str] = set()  # the on-demand packages a layer has asked for in this process


def kernels_forced() -> bool:
    """True inside force_kernels(): our own Triton ops (no package behind them) take this to run
    for CPU tensors too."""
    return _forced


def _forget_probe() -> None:
    _unusable.clear()
    _refused.clear()


@contextlib.contextmanager
def force_kernels() -> Iterator[None]:
    """Call the GPU kernels for CPU tensors too (not thread-safe: meant for tests). Probes again
    inside: tests make the kernel packages importable only for the block."""
    global _forced
    previous, _forced = _forced, True
    _forget_probe()
    try:
        yield
    finally:
        _forced = previous
        _forget_probe()


def _why_unusable(package: KernelPackage) -> str | None:
    # A version the metadata shows is checked before anything is imported (another version's
    # modules may not import, or import with other launchers); a version that only the package
    # itself states (`__version__`) is read once it is imported.
    version_known = kernel_packages.installed_version(package.name) is not None
    if version_known and (refusal := kernel_packages.version_refusal(package.name)):
        return refusal
    for module in package.modules:
        try:
            kernel_packages.import_kernel_module(module)
        except Exception as error:  # a broken extension raises OSError / RuntimeError too
            first_line = (str(error).strip().splitlines() or [""])[0]
            return f"{module} does not import ({type(error).__name__}: {first_line})"
    if not version_known and (refusal := kernel_packages.version_refusal(package.name)):
        return refusal
    return kernel_packages.launcher_refusal(package.name, package.launchers)


def _probe(name: str) -> str | None:
    if name not in _unusable:
        package = KERNEL_PACKAGES[name]
        _unusable[name] = _why_unusable(package)
        _refused[name] = () if _unusable[name] else package.refuses_ops()
    return _unusable[name]


def probe_kernels(*, on_demand: bool = False) -> dict[str, str | None]:
    """Every kernel package but the on-demand ones no layer has asked for (all of them with
    `on_demand`): None when the ops may call it here, else why not. Imports each package once
    per process (the result is kept)."""
    return {name: _probe(name) for name, package in KERNEL_PACKAGES.items()
            if on_demand or not package.on_demand or name in _asked}


def request_kernel_package(name: str) -> None:
    """A layer that calls the on-demand package `name` says so when it is built, outside any
    traced code: the package is probed now (on a GPU: elsewhere no kernel is called) and
    reported from then on."""
    _asked.add(name)
    if _on_gpu():
        _probe(name)


def refused_ops() -> dict[str, RefusedOp]:
    """The custom ops of usable kernel packages that this runtime refuses, by op name (probes
    every package once per process, as `probe_kernels`)."""
    probe_kernels()
    return {refused.op: refused for name in KERNEL_PACKAGES for refused in _refused.get(name, ())}


def _fallbacks() -> list[tuple[str, RefusedOp | None, str]]:
    """(package, the refused op or None for the whole package, why) for everything the ops run
    on their torch paths on this CUDA machine (nothing without CUDA, where the torch paths are
    the plan, not a fall-back)."""
    if not _on_gpu():
        return []
    unusable = [(name, None, reason) for name, reason in probe_kernels().items() if reason]
    return unusable + [(op.package, op, op.reason) for op in refused_ops().values()]


def kernel_fallbacks() -> list[str]:
    """One line per kernel package the ops cannot use, or op the runtime refuses, on this CUDA
    machine: the start-up warnings."""
    lines = []
    for name, refused, reason in _fallbacks():
        if refused is None:
            package = KERNEL_PACKAGES[name]
            lines.append(f"kernel package {name} is not used: {reason}; {package.fallback} "
                         f"runs {package.serves}")
        else:
            lines.append(f"kernel package {name} is used except for {refused.serves}, which "
                         f"the torch path runs: {reason}")
    return lines


def kernel_path_field() -> str | None:
    """`kernels: torch path (mamba_ssm: <reason>; fla for the gated delta rule's backward:
    <reason>)` when some kernel package is unusable, or some op refused, on this CUDA machine,
    for the per-step metrics line; None when every kernel runs (or without CUDA), so a run on
    the fused kernels keeps its line as it was. Reads the start-up probe's result."""
    # A package whose ops have another kernel (causal-conv1d: our Triton conv) is no torch path.
    fallbacks = [(name, refused, reason) for name, refused, reason in _fallbacks()
                 if refused is not None or KERNEL_PACKAGES[name].fallback == "the torch path"]
    if not fallbacks:
        return None
    return "kernels: torch path (" + "; ".join(
        f"{name}{'' if refused is None else f' for {refused.serves}'}: {reason}"
        for name, refused, reason in fallbacks) + ")"


# A constant of the graph when torch.compile meets it (dynamo calls it instead of tracing it):
# entry points probe before compiling, so this only reads the kept result.
@torch.compiler.assume_constant_result
def _package_usable(package: str) -> bool:
    _asked.add(package)
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


@torch.compiler.assume_constant_result
def kernel_op_refused(op: str) -> bool:
    """True when this runtime refuses the custom op `op` (titan_hybrid::<op>) of a usable kernel
    package, so its caller runs the torch path instead: decided by the start-up probe, a
    constant of the graph under torch.compile."""
    return op in refused_ops()

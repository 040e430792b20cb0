"""Which path an op takes: a GPU kernel (mamba_ssm, fla) or its pure-torch twin.

By default an op calls its Triton kernel for CUDA tensors when the kernel's package imports, and
its torch path otherwise. Inside ``force_kernels()`` the ops call the kernels for CPU tensors too:
that is how the tests run them in Triton's interpreter (``TRITON_INTERPRET=1`` executes Triton
kernels on CPU tensors with numpy)::

    with force_kernels():
        y = mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size=64)  # mamba_ssm's kernel

While forced, a kernel package that does not import is an error rather than a silent fall-back
to the torch path, so a kernel test cannot pass by accident. Dtypes the kernels do not take
(float64) still use the torch path. Nothing here runs at import: the flag is only changed by
``force_kernels`` and restored when it exits.

Each kernel call goes through a ``torch.library`` custom op (``titan_hybrid::...``, defined by
the op modules), so ``torch.compile`` with ``fullgraph=True`` sees one opaque node per kernel
forward and backward instead of breaking its graph on Triton launches (fla even marks its entry
point ``torch.compiler.disable``).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

import torch

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_forced = False
_imports: dict[str, bool] = {}


@contextlib.contextmanager
def force_kernels() -> Iterator[None]:
    """Call the GPU kernels for CPU tensors too (not thread-safe: meant for tests)."""
    global _forced
    previous, _forced = _forced, True
    try:
        yield
    finally:
        _forced = previous


def kernels_forced() -> bool:
    return _forced


# Run once at trace time by torch.compile (its result is a constant of the graph) instead of
# being traced: dynamo cannot trace an import.
@torch.compiler.assume_constant_result
def _module_imports(module: str) -> bool:
    if module not in _imports:
        try:
            importlib.import_module(module)
            _imports[module] = True
        except ImportError:
            _imports[module] = False
    return _imports[module]


def use_kernel(tensor: torch.Tensor, module: str) -> bool:
    """True when an op given `tensor` should call the kernel that lives in `module`."""
    if not (tensor.is_cuda or _forced) or tensor.dtype not in KERNEL_DTYPES:
        return False
    if _module_imports(module):
        return True
    if _forced:
        raise RuntimeError(f"force_kernels(): the kernel module {module} does not import "
                           "(install the gpu extra, or see scripts/bootstrap.sh)")
    return False

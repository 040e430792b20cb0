"""Run the GPU kernels behind our ops in tests: on CUDA when there is a GPU, else on CPU tensors in
Triton's interpreter (TRITON_INTERPRET=1: each Triton program runs as Python over numpy arrays).

    with kernels_on():          # our public ops call mamba_ssm / fla kernels in here
        y = mamba_chunk_scan_combined(...)   # on DEVICE tensors

Tests that use it carry the `triton_interpreter` marker (`./run_tests.sh -m triton_interpreter`).

Triton decides whether a kernel is interpreted when its `@triton.jit` decorator runs: for
triton.language's own jit functions (tl.cumsum, ...) that is when triton is imported, which the
model modules do through torchtitan. So tests/conftest.py sets TRITON_INTERPRET=1 for the whole
test process on machines without CUDA, before anything imports triton. It changes nothing else
there: no other CPU code path launches a Triton kernel (without the interpreter, one would fail
for want of a GPU driver). `kernels_on` checks the kernels it uses are interpreted ones.

Interpreter-only shims, active only inside `kernels_on()` on CPU (none of them on CUDA, none in
the library):
- Triton 3.7's interpreter rewrites every `x = value` in a kernel to wrap the value as an
  interpreter tensor, but not the target of a `for` loop, so a `range` / `tl.range` induction
  variable stays a Python int. Compiled Triton makes it an int32 scalar tensor, and fla's kernels
  call methods on it (`i_t.to(tl.int64)` in chunk_delta_h.py: "'int' object has no attribute
  'to'"). `_LoopIndexAsTensor` adds the same wrapping at the top of such loops' bodies.
  `tl.static_range` loops are left alone: their index is a compile-time constant.
- Triton's autotuner times each config with the GPU driver (there is none): every config is
  scored equal, so the first is used.
- The launchers' host code wraps launches in `torch.cuda.device(t.device.index)`, which fails for
  a CPU tensor (index None), and sizes backward grids from the GPU's SM count: a no-op context
  and a device with 4 SMs (few programs, so several rows per program are exercised).
- scripts/bootstrap.sh installs mamba_ssm's and fla's sources outside site-packages, in
  KERNEL_SITE: importable only inside `kernels_on()`, and hidden again after it (the packages'
  top-level modules leave sys.modules), because transformers switches its own torch paths
  (Qwen3-Next's gated delta rule, NemotronH's SSD, which other tests and bench/ compare against)
  to these packages whenever they import, on any device.
- mamba_ssm's package __init__ imports its compiled CUDA extension (not built here); its
  Triton modules are imported through the bare package that compat enters where that extension
  is missing (`kernel_packages.import_kernel_module`), as on a GPU host with torch >= 2.14.
- causal-conv1d is CUDA C++ only: its stand-in (tests/stand_ins/, the same functions in torch)
  takes its place, so layers run their conv through our custom ops too.
- mamba_ssm's Mamba-3 MIMO kernels are TileLang's, which compiles for CUDA only: where they cannot
  run (on CPU, or without tilelang) their stand-in (tests/stand_ins/tilelang_mamba3_mimo.py)
  takes the place of their four modules and of `tilelang`; the Triton kernels around them
  (the decay sums, the angles' running sum) are mamba_ssm's own.
The interpreter has no bfloat16 arithmetic (bf16 values are held as their uint16 bit patterns
and only converted at loads, stores and casts: a bf16 `tl.dot` multiplies bit patterns), so
kernels whose dots take bf16 operands are checked in float32 there, and in bf16 only on CUDA.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import sys
import textwrap
import types
import warnings
from pathlib import Path
from unittest import mock

import torch

from titan_hybrid.compat import kernel_packages
from titan_hybrid.ops.kernels import force_kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = DEVICE == "cpu"
KERNEL_MODULES = ("mamba_ssm.ops.triton.ssd_combined", "mamba_ssm.ops.triton.layernorm_gated",
                  "fla.ops.gated_delta_rule.chunk")
# Dtypes whose kernels compute correctly where the tests run (see the module docstring).
LOW_PRECISION = (torch.bfloat16,) if not INTERPRETED else ()


class _LoopIndexAsTensor(ast.NodeTransformer):
    """Adds `i = interpreter_semantic.to_tensor(i, False)` (what the interpreter already does for
    assignments) as the first statement of every `for i in range(...)` / `tl.range(...)`."""

    def __init__(self, base: ast.NodeTransformer) -> None:
        self.base = base

    def visit(self, node):
        node = self.base.visit(node)
        for loop in ast.walk(node):
            if isinstance(loop, ast.For) and isinstance(loop.target, ast.Name) \
                    and _called_name(loop.iter) == "range":
                name = loop.target.id
                wrap = ast.parse(f"{name} = interpreter_semantic.to_tensor({name}, False)").body[0]
                for part in ast.walk(wrap):  # tracebacks point at the loop
                    ast.copy_location(part, loop)
                loop.body.insert(0, wrap)
        return node


def _called_name(node) -> str | None:
    if isinstance(node, ast.Call):
        func = node.func
        return func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
    return None


# Where scripts/bootstrap.sh installs the kernel packages on machines without CUDA.
KERNEL_SITE = Path(sys.prefix) / "triton-interpreter-kernels"
_hidden: dict[str, types.ModuleType] = {}  # their top-level modules, between kernels_on blocks
STAND_INS = Path(__file__).resolve().parent / "stand_ins"


@contextlib.contextmanager
def _kernel_packages_importable():
    if not KERNEL_SITE.is_dir():
        raise RuntimeError(f"{KERNEL_SITE} is missing: scripts/bootstrap.sh installs the kernel "
                           "packages there (./run_tests.sh runs it)")
    sys.path[:0] = [str(KERNEL_SITE), str(STAND_INS)]
    sys.modules.update(_hidden)
    try:
        # mamba_ssm's package __init__ needs its compiled Mamba1 scan, not built here: compat
        # enters the package bare, as on a GPU host that installed it with
        # MAMBA_SKIP_CUDA_BUILD=TRUE.
        kernel_packages.import_kernel_module("mamba_ssm")
        yield
    finally:
        sys.path.remove(str(KERNEL_SITE))
        sys.path.remove(str(STAND_INS))
        for name in ("mamba_ssm", "fla"):
            if name in sys.modules:
                _hidden[name] = sys.modules.pop(name)
        for name in [name for name in sys.modules if name.split(".")[0] == "causal_conv1d"]:
            del sys.modules[name]  # imported afresh next time: tests also load a broken one


def _check_interpreted(module) -> None:
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    for value in vars(module).values():
        for _ in range(4):  # through autotune / heuristics wrappers
            if isinstance(value, (JITFunction, InterpretedFunction)) or not hasattr(value, "fn"):
                break
            value = value.fn
        if isinstance(value, JITFunction):
            raise RuntimeError(f"{module.__name__} was imported while TRITON_INTERPRET was "
                               "unset: its kernels are compiled ones")


@contextlib.contextmanager
def _interpreter():
    import triton
    import triton.runtime.autotuner
    import triton.runtime.interpreter as interpreter

    rewriter = interpreter.FunctionRewriter
    device = types.SimpleNamespace(name="Triton interpreter", multi_processor_count=4)
    if not triton.knobs.runtime.interpret:
        raise RuntimeError("TRITON_INTERPRET=1 must be set before triton is imported (on a "
                           "machine without CUDA tests/conftest.py does it)")
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(
            rewriter, "ast_transformer", _LoopIndexAsTensor(rewriter.ast_transformer)))
        # Its int32 overflow checks (a debugging aid, several extra ops per integer op) triple
        # the run time; our shapes are far from 2**31.
        stack.enter_context(mock.patch.object(
            interpreter.interpreter_builder, "options",
            dataclasses.replace(interpreter.interpreter_builder.options, sanitize_overflow=False)))
        stack.enter_context(mock.patch.object(
            triton.runtime.autotuner.Autotuner, "_bench",
            lambda self, *args, config, **kwargs: [0.0, 0.0, 0.0]))
        stack.enter_context(mock.patch.object(
            torch.cuda, "device", lambda index: contextlib.nullcontext()))
        stack.enter_context(mock.patch.object(
            torch.cuda, "get_device_properties", lambda *args, **kwargs: device))
        stack.enter_context(_kernel_packages_importable())
        with warnings.catch_warnings():
            # fla: "Triton is not supported on current platform, roll back to CPU."
            warnings.simplefilter("ignore", UserWarning)
            for name in KERNEL_MODULES:
                _check_interpreted(importlib.import_module(name))
        yield


# mamba_ssm's TileLang modules, which the stand-in replaces where they cannot run.
TILELANG_MODULES = tuple(f"mamba_ssm.ops.tilelang.mamba3.{name}" for name in (
    "mamba3_mimo_fwd", "mamba3_mimo_fwd_varlen", "mamba3_mimo_bwd", "mamba3_mimo_bwd_varlen"))


@contextlib.contextmanager
def _tilelang_stand_in():
    if not INTERPRETED and importlib.util.find_spec("tilelang") is not None:
        yield
        return
    sys.path.insert(0, str(STAND_INS))
    try:
        stand_in = importlib.import_module("tilelang_mamba3_mimo")
    finally:
        sys.path.remove(str(STAND_INS))
    names = (*TILELANG_MODULES, "tilelang")
    sys.modules.update(dict.fromkeys(names, stand_in))
    try:
        yield
    finally:
        for name in names:
            sys.modules.pop(name, None)


@contextlib.contextmanager
def kernels_on():
    """Our ops call the GPU kernels inside: on CUDA directly, on CPU in Triton's interpreter."""
    with _interpreter() if INTERPRETED else contextlib.nullcontext(), _tilelang_stand_in(), \
            force_kernels():
        yield


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Frobenius-norm relative error of `a` against the reference `b`, in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def outputs_and_grads(fn, inputs: dict, **kwargs):
    """`fn(**inputs, **kwargs)`'s tensor outputs and the gradients of a fixed random projection
    of them with respect to every floating-point input: ([outputs], {name: grad})."""
    leaves = {name: value.detach().clone().requires_grad_(value.is_floating_point())
              if isinstance(value, torch.Tensor) else value for name, value in inputs.items()}
    result = fn(**leaves, **kwargs)
    outputs = [out for out in (result if isinstance(result, tuple) else (result,))
               if out is not None]
    gen = torch.Generator().manual_seed(1234)
    loss = sum((out * torch.randn(out.shape, generator=gen).to(out)).sum() for out in outputs)
    names = [name for name, leaf in leaves.items()
             if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
    grads = torch.autograd.grad(loss, [leaves[name] for name in names])
    return outputs, dict(zip(names, grads))


def assert_close_rel(got, want, tol: float, what: str) -> float:
    """Relative error of each output and gradient below `tol` (and every reference gradient
    non-zero, so no comparison is vacuous); returns the largest error."""
    (outs, grads), (ref_outs, ref_grads) = got, want
    assert len(outs) == len(ref_outs) and grads.keys() == ref_grads.keys()
    pairs = [(f"output {i}", a, b) for i, (a, b) in enumerate(zip(outs, ref_outs))]
    pairs += [(f"grad {name}", grads[name], ref_grads[name]) for name in ref_grads]
    worst = 0.0
    for name, a, b in pairs:
        assert a.shape == b.shape and a.dtype == b.dtype, (what, name, a.shape, b.shape, a.dtype)
        assert b.abs().max() > 0, f"{what}: reference {name} is zero"
        err = rel_err(a.detach(), b.detach())
        assert err < tol, f"{what}: {name} relative error {err:.2e} >= {tol:.0e}"
        worst = max(worst, err)
    print(f"\n{what}: largest relative error {worst:.1e} (tolerance {tol:.0e})")
    return worst


def layer_outputs_and_grads(layer, u: torch.Tensor, *args) -> dict[str, torch.Tensor]:
    """`layer(u, *args)` ("output") and the gradients of a fixed projection of it with respect
    to its input ("input", which requires grad) and every parameter (by name)."""
    leaves = {"input": u, **dict(layer.named_parameters())}
    y = layer(u, *args)
    grads = torch.autograd.grad((y * torch.cos(torch.arange(y.numel()).view_as(y))).sum(),
                                list(leaves.values()))
    return {"output": y.detach(), **dict(zip(leaves, grads, strict=True))}


def assert_close_to_scale(got: dict, want: dict, tolerance) -> None:
    """Each tensor of `got` within `tolerance(name)` times the largest magnitude of `want`'s
    (which must not be zero: no comparison is vacuous)."""
    assert got.keys() == want.keys()
    for name, reference in want.items():
        scale = reference.abs().max().item()
        error = (got[name] - reference).abs().max().item()
        assert scale > 0 and error <= tolerance(name) * scale, (name, error / scale)


@contextlib.contextmanager
def expect_custom_ops(*names: str, not_run: tuple[str, ...] = ()):
    """Asserts that the custom ops `names` (titan_hybrid::..., the kernel calls' forward and
    backward) ran inside the block: the proof that our dispatch took the kernel path; and that
    those of `not_run` did not (a kernel the runtime refuses)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        yield
    seen = {event.name for event in profile.events()}
    missing = [name for name in names if f"titan_hybrid::{name}" not in seen]
    assert not missing, f"custom ops {missing} did not run"
    ran = [name for name in not_run if f"titan_hybrid::{name}" in seen]
    assert not ran, f"custom ops {ran} ran"


# mamba_ssm's Mamba-3 kernels call PTX approximations through tl.inline_asm_elementwise (its
# ops/triton/mamba3/utils.py), which the interpreter cannot run: inside `mamba3_kernels_on`
# each kernel module's names for them point at the exact functions (cos, sin, tanh and
# sech^2 = 1 - tanh^2: tests/mamba3_exact_functions.py), so a comparison with them holds to the approximations' error on a GPU.
MAMBA3_KERNEL_MODULES = ("mamba_ssm.ops.triton.mamba3.angle_dt",
                         "mamba_ssm.ops.triton.mamba3.mamba3_siso_fwd",
                         "mamba_ssm.ops.triton.mamba3.mamba3_siso_bwd",
                         "mamba_ssm.ops.triton.mamba3.mamba3_siso_step")
MAMBA3_APPROXIMATIONS = ("cos_approx", "sin_approx", "tanh_approx", "sech2_approx")
# ... and its SISO backward's Python wrappers assert that their tensors are on CUDA: in the
# interpreter they run compiled again without their assert statements (Python's -O).
MAMBA3_CUDA_ASSERTS = {"mamba_ssm.ops.triton.mamba3.mamba3_siso_bwd": ("compute_dzdo",
                                                                       "compute_dqkv")}


def _without_asserts(function):
    """`function` compiled again from its source with its assert statements dropped."""
    namespace: dict = {}
    code = compile(textwrap.dedent(inspect.getsource(function)),
                   inspect.getsourcefile(function), "exec", optimize=1)
    exec(code, function.__globals__, namespace)
    return namespace[function.__name__]


@contextlib.contextmanager
def mamba3_kernels_on():
    """kernels_on(), with mamba_ssm's Mamba-3 kernel modules importable; on CPU their PTX
    approximations replaced by the exact functions (above)."""
    with kernels_on(), contextlib.ExitStack() as stack:
        if INTERPRETED:
            from tests import mamba3_exact_functions as exact
            for name in MAMBA3_KERNEL_MODULES:
                module = importlib.import_module(name)
                _check_interpreted(module)
                for function in MAMBA3_APPROXIMATIONS:
                    if hasattr(module, function):
                        stack.enter_context(mock.patch.object(
                            module, function, getattr(exact, function)))
                for function in MAMBA3_CUDA_ASSERTS.get(name, ()):
                    stack.enter_context(mock.patch.object(
                        module, function, _without_asserts(getattr(module, function))))
        yield

"""GPU verification (issue 7, item 4): GPU kernels against our torch paths, and bf16 training MFU.

    python bench/gpu_verify.py [--json PATH] [--skip-kernels] [--skip-tests] [--skip-train]
        [--train-configs nemotron_h_1b hybrid_moe_2b nemotron_h_1b_gdn] [--batch 2]
        [--seq-len 4096] [--warmup 3] [--steps 10] [--compile]
    python bench/gpu_verify.py --triton-interpreter     # CPU: mamba_ssm's SSD kernel semantics

Without CUDA (and without --triton-interpreter) it says so and exits 0. On a lent GPU machine
without a package index, `bash bench/gpu_verify_wheels.sh` here first, carry `.whl`, and there:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD:$PWD/.whl/mamba_ssm_src
    python3 bench/gpu_verify.py --json $OUT/gpu_verify.json 2>&1 | tee $OUT/gpu_verify_output.txt

1. Kernel parity. Each GPU kernel our ops dispatch to is run on the same inputs as our pure-torch
   path (the reference), forward + backward with the same random cotangents, and every output and
   every input gradient is compared:
     * SSD scan: mamba_ssm's Triton `mamba_chunk_scan_combined` vs `ssd_chunked_torch`;
     * gated delta rule: fla's `chunk_gated_delta_rule` vs `chunk_gated_delta_rule_torch`;
     * causal conv: causal-conv1d's `causal_conv1d_fn` vs `causal_depthwise_conv1d_torch`, when
       causal-conv1d is installed (its CUDA extension must be compiled; reported if absent).
   Columns: max|kernel - torch|, that over max|torch| ("rel-to-max", the PASS criterion), and
   the L2-relative error of the kernel and of the torch path each against our torch path run in
   float64 on the same (already rounded) inputs, which says which of the two is further from
   exact arithmetic. Tolerances on rel-to-max, stated before the run: 5e-3 for float32 inputs
   (Triton runs float32 dots as tf32 by default, ~1e-3 relative per product) and 5e-2 for
   bfloat16 inputs (outputs and gradients are rounded to bf16, 2^-8 = 4e-3, and the kernels keep
   intermediates such as chunk states and decays in bf16 in places). NaN or Inf never passes.
   Each case also times one forward + backward of the kernel and of the torch path (median of 5,
   CUDA events) and checks that our dispatcher picked the kernel.

2. The CUDA-only unit tests: `pytest tests/unit/test_ssd.py tests/unit/test_gated_delta.py
   -m "not slow"`, run in this process so that the mamba_ssm loading described below applies.

3. bf16 training throughput on one GPU. Recipe: float32 parameters (master weights) with
   torch.autocast(bfloat16) around forward and loss, as torchtitan does on one device without
   FSDP; AdamW (fused, lr 3e-4, betas (0.9, 0.95), weight decay 0.1 except on the
   parameters `titan_hybrid.optimizer` exempts), grad-norm clipping at 1.0; random tokens. A few
   warm-up steps (Triton autotuning and compilation happen there), then timed steps, each
   bracketed by torch.cuda.synchronize. MFU = FLOPs per token x tokens/s / peak, with FLOPs per
   token from `titan_hybrid.model.flops` (6 x active matmul parameters + 3 x the forward FLOPs of
   the attention / SSD / gated-delta cores: forward + backward = 3 x forward) and peak both the
   H100 SXM datasheet dense bf16 rate (989 TFLOP/s) and an 8192^3 bf16 matmul measured here.

mamba_ssm: its package __init__ imports the compiled selective-scan CUDA extension, which this
verification does not build. The SSD kernel lives in `mamba_ssm.ops.triton.ssd_combined`, pure
Python + Triton. If `import mamba_ssm` fails, `load_mamba_ssm_ssd_kernel` registers a bare
package module for `mamba_ssm` whose __path__ is the installed source folder, so its submodules
import without the package __init__; the output says when that happened.

--triton-interpreter (no GPU needed): mamba_ssm's SSD Triton kernel run by Triton's CPU
interpreter against our torch path at tiny shapes; see `triton_interpreter_cases`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import itertools
import json
import math
import os
import re
import statistics
import sys
import time
import traceback
import types
from functools import partial
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `python bench/gpu_verify.py` from a plain checkout
    sys.path.insert(0, str(REPO_ROOT))

H100_SXM_DENSE_BF16_FLOPS = 989e12
TOLERANCE_REL_TO_MAX = {torch.float32: 5e-3, torch.bfloat16: 5e-2}
# Training configurations: a flavor, optionally with another pattern. The GDN variant replaces
# every Mamba layer of nemotron_h_1b by a gated DeltaNet layer, so that fla runs inside a model.
TRAIN_CONFIGS = {
    "nemotron_h_1b": ("nemotron_h_1b", None),
    "hybrid_moe_2b": ("hybrid_moe_2b", None),
    "nemotron_h_1b_gdn": ("nemotron_h_1b", "G-G*-G-G-G*-G-G-G*-G-G-G-"),
}


# ----------------------------------------------------------------------------- optional kernels

def load_mamba_ssm_ssd_kernel():
    """(mamba_ssm's Triton mamba_chunk_scan_combined or None, a line saying how it loaded)."""
    try:
        import mamba_ssm

        how = f"mamba_ssm {mamba_ssm.__version__} (full package import)"
    except ImportError as error:
        spec = importlib.util.find_spec("mamba_ssm")
        if spec is None or not spec.submodule_search_locations:
            return None, "mamba_ssm not installed"
        # The failed import may have left half-initialised submodules behind; drop them so
        # that everything below comes from one consistent import.
        for name in [n for n in sys.modules if n == "mamba_ssm" or n.startswith("mamba_ssm.")]:
            del sys.modules[name]
        source_dir = Path(next(iter(spec.submodule_search_locations)))
        package = types.ModuleType("mamba_ssm")
        package.__path__ = [str(source_dir)]
        version = re.search(r'__version__\s*=\s*"([^"]+)"', (source_dir / "__init__.py").read_text())
        package.__version__ = version.group(1) if version else "unknown"
        sys.modules["mamba_ssm"] = package
        how = (f"mamba_ssm {package.__version__} from {source_dir}, Triton SSD kernel only: "
               f"the package __init__ failed ({type(error).__name__}: {error}), so a bare "
               "package module stands in for it")
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception as error:  # noqa: BLE001 - any failure here means "no kernel", reported
        return None, f"{how}; ssd_combined failed to import: {type(error).__name__}: {error}"
    return mamba_chunk_scan_combined, how


def load_fla_gated_delta_kernel():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as error:  # noqa: BLE001
        return None, f"fla not usable: {type(error).__name__}: {error}"
    return chunk_gated_delta_rule, f"flash-linear-attention {_dist_version('flash-linear-attention')}, fla-core {_dist_version('fla-core')}"


def load_causal_conv1d_kernel():
    if importlib.util.find_spec("causal_conv1d") is None:
        return None, "causal-conv1d not installed (its CUDA extension needs a compiled build)"
    try:
        from causal_conv1d import causal_conv1d_fn
    except Exception as error:  # noqa: BLE001
        return None, f"causal-conv1d not usable: {type(error).__name__}: {error}"
    return causal_conv1d_fn, f"causal-conv1d {_dist_version('causal-conv1d')}"


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# ---------------------------------------------------------------------------- comparison harness

def run_forward_backward(fn, inputs: dict, *, output_names: tuple[str, ...],
                         cotangents: list | None = None, seed: int = 0):
    """fn(**inputs) -> output tensor(s); returns ({"y": .., "grad:x": ..}, cotangents).

    Every floating input is a leaf that receives a gradient. Cotangents are drawn once (from the
    first run, rounded to its output dtypes) and passed to later runs, so that every path
    differentiates exactly the same function of its outputs."""
    leaves = {name: (t.detach().clone().requires_grad_(True) if _is_float(t) else t)
              for name, t in inputs.items()}
    outputs = fn(**leaves)
    outputs = [o for o in (outputs if isinstance(outputs, tuple) else (outputs,)) if o is not None]
    if cotangents is None:
        gen = torch.Generator(device=outputs[0].device).manual_seed(seed)
        cotangents = [torch.randn(o.shape, generator=gen, device=o.device).to(o.dtype)
                      for o in outputs]
    torch.autograd.backward(outputs, [c.to(o.dtype) for c, o in zip(cotangents, outputs)])
    results = {name: o.detach() for name, o in zip(output_names, outputs, strict=True)}
    results.update({f"grad:{name}": leaf.grad for name, leaf in leaves.items() if _is_float(leaf)})
    return results, cotangents


def _is_float(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _to_float64(inputs: dict) -> dict:
    return {name: (t.double() if _is_float(t) else t) for name, t in inputs.items()}


def error_stats(candidate: torch.Tensor, reference: torch.Tensor) -> dict:
    diff = candidate.double() - reference.double()
    ref_max = reference.double().abs().max().item()
    max_abs = diff.abs().max().item()
    return {"max_abs": max_abs, "rel_to_max": max_abs / ref_max if ref_max > 0 else math.inf,
            "rel_l2": (diff.norm() / reference.double().norm()).item(),
            "finite": bool(torch.isfinite(candidate).all())}


def compare_paths(name: str, *, kernel_fn, torch_fn, inputs: dict, output_names: tuple[str, ...],
                  tolerance: float, time_reps: int = 5) -> dict:
    """Kernel vs torch path (PASS criterion) and both vs the torch path in float64."""
    run = partial(run_forward_backward, output_names=output_names)
    kernel_out, cotangents = run(kernel_fn, inputs)
    torch_out, _ = run(torch_fn, inputs, cotangents=cotangents)
    exact_out, _ = run(torch_fn, _to_float64(inputs), cotangents=cotangents)
    rows = []
    for key, reference in torch_out.items():
        if reference is None or kernel_out.get(key) is None:
            rows.append({"tensor": key, "missing": True, "passed": False})
            continue
        stats = error_stats(kernel_out[key], reference)
        stats["kernel_vs_f64_rel_l2"] = error_stats(kernel_out[key], exact_out[key])["rel_l2"]
        stats["torch_vs_f64_rel_l2"] = error_stats(reference, exact_out[key])["rel_l2"]
        stats["passed"] = stats["finite"] and stats["rel_to_max"] <= tolerance
        rows.append({"tensor": key, **stats})
    case = {"case": name, "tolerance": tolerance, "rows": rows,
            "passed": all(row["passed"] for row in rows)}
    if time_reps and next(iter(inputs.values())).is_cuda:
        case["kernel_ms"] = time_forward_backward(run, kernel_fn, inputs, cotangents, reps=time_reps)
        case["torch_ms"] = time_forward_backward(run, torch_fn, inputs, cotangents, reps=time_reps)
    return case


def time_forward_backward(run, fn, inputs: dict, cotangents: list, *, reps: int) -> float:
    """Median milliseconds of one forward + backward (after one untimed run), CUDA events."""
    times = []
    for rep in range(reps + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run(fn, inputs, cotangents=cotangents)
        end.record()
        torch.cuda.synchronize()
        if rep:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def print_case(case: dict) -> None:
    status = "PASS" if case["passed"] else "FAIL"
    timing = ""
    if "kernel_ms" in case:
        timing = (f"  fwd+bwd kernel {case['kernel_ms']:.2f} ms, torch path "
                  f"{case['torch_ms']:.2f} ms ({case['torch_ms'] / case['kernel_ms']:.1f}x)")
    print(f"\n[{status}] {case['case']} (tolerance rel-to-max {case['tolerance']:g}){timing}")
    if case.get("note"):
        print(f"  {case['note']}")
    print(f"  {'tensor':<18}{'max abs':>11}{'rel-to-max':>12}{'kern~f64 L2':>13}"
          f"{'torch~f64 L2':>14}")
    for row in case["rows"]:
        if row.get("missing"):
            print(f"  {row['tensor']:<18} missing from one path  FAIL")
            continue
        flag = "" if row["passed"] else "  FAIL" + ("" if row["finite"] else " (non-finite)")
        print(f"  {row['tensor']:<18}{row['max_abs']:>11.3e}{row['rel_to_max']:>12.3e}"
              f"{row['kernel_vs_f64_rel_l2']:>13.3e}{row['torch_vs_f64_rel_l2']:>14.3e}{flag}")


# ---------------------------------------------------------------------------------- the op cases

def ssd_inputs(*, batch: int, seq_len: int, heads: int, head_dim: int, groups: int, state: int,
               dtype: torch.dtype, device, packed: bool, seed: int, with_z: bool = True,
               with_initial_states: bool = True, D_per_channel: bool = False) -> dict:
    """Inputs shaped and scaled like the Mamba2 mixer's: dt from the mixer's init range, A in
    [-16, -1], D ([h], or [h, p] with `D_per_channel`), fp32 A / D / dt_bias / initial states
    (parameters and carried state stay fp32 in bf16 training). `packed` adds documents via
    seq_idx."""
    from titan_hybrid.model.common import inverse_softplus

    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    def uniform(low, high, *shape):
        return low + (high - low) * torch.rand(*shape, generator=gen, device=device)

    inputs = {
        "x": randn(batch, seq_len, heads, head_dim).to(dtype),
        "dt": (0.5 * randn(batch, seq_len, heads)).to(dtype),
        "A": -uniform(1.0, 16.0, heads),
        "B": randn(batch, seq_len, groups, state).to(dtype),
        "C": randn(batch, seq_len, groups, state).to(dtype),
        "D": randn(heads, head_dim) if D_per_channel else randn(heads),
        "dt_bias": inverse_softplus(uniform(math.log(1e-3), math.log(0.1), heads).exp()),
    }
    if with_z:
        inputs["z"] = randn(batch, seq_len, heads, head_dim).to(dtype)
    if with_initial_states:
        inputs["initial_states"] = 0.5 * randn(batch, heads, head_dim, state)
    if packed:  # document starts (ids 0, 1, 2, ... as mamba_ssm expects), different per row
        seq_idx = torch.zeros(batch, seq_len, dtype=torch.int32, device=device)
        for row in range(batch):
            for doc, start in enumerate(sorted({seq_len // (3 + row), seq_len // 2 + 17 * row}), 1):
                seq_idx[row, start:] = doc
        inputs["seq_idx"] = seq_idx
    return inputs


def gdn_inputs(*, batch: int, seq_len: int, heads: int, head_dim: int, dtype: torch.dtype, device,
               doc_lens: list[int] | None, seed: int) -> dict:
    """Gated-delta inputs like the GDN mixer's: q, k, v, beta in `dtype`; the log-decay g in
    fp32 (-A * softplus(alpha + dt_bias) with A in [1, 16]); initial state fp32. With
    `doc_lens`, one packed row with cu_seqlens (int32, as the mixer builds it)."""
    from titan_hybrid.model.common import inverse_softplus

    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    def uniform(low, high, *shape):
        return low + (high - low) * torch.rand(*shape, generator=gen, device=device)

    if doc_lens is not None:
        batch, seq_len = 1, sum(doc_lens)
    n_states = batch if doc_lens is None else len(doc_lens)
    dt_bias = inverse_softplus(uniform(math.log(1e-3), math.log(0.1), heads).exp())
    decay_rate = uniform(1.0, 16.0, heads)
    inputs = {
        "q": randn(batch, seq_len, heads, head_dim).to(dtype),
        "k": randn(batch, seq_len, heads, head_dim).to(dtype),
        "v": randn(batch, seq_len, heads, head_dim).to(dtype),
        "g": -decay_rate * torch.nn.functional.softplus(0.5 * randn(batch, seq_len, heads) + dt_bias),
        "beta": torch.sigmoid(randn(batch, seq_len, heads)).to(dtype),
        "initial_state": 0.1 * randn(n_states, heads, head_dim, head_dim),
    }
    if doc_lens is not None:
        inputs["cu_seqlens"] = torch.tensor([0, *itertools.accumulate(doc_lens)],
                                            dtype=torch.int32, device=device)
    return inputs


def conv_inputs(*, batch: int, seq_len: int, channels: int, width: int, dtype, device, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    seq_idx = torch.zeros(batch, seq_len, dtype=torch.int32, device=device)
    seq_idx[:, seq_len // 3:] = 1
    return {"x_BTC": torch.randn(batch, seq_len, channels, generator=gen, device=device).to(dtype),
            "weight_CW": 0.5 * torch.randn(channels, width, generator=gen, device=device).to(dtype),
            "bias_C": torch.randn(channels, generator=gen, device=device).to(dtype),
            "seq_idx": seq_idx}


def kernel_cases(device, *, ssd_kernel, gdn_kernel, conv_kernel, small: bool = False) -> list[dict]:
    """All parity cases. `small` shrinks shapes (the CPU smoke test passes torch-path stand-ins
    for the kernels to check this harness, not numerics)."""
    from titan_hybrid.ops.conv import causal_depthwise_conv1d, causal_depthwise_conv1d_torch
    from titan_hybrid.ops.gated_delta import chunk_gated_delta_rule, chunk_gated_delta_rule_torch
    from titan_hybrid.ops.ssd import mamba_chunk_scan_combined, ssd_chunked_torch

    if small:
        ssd_shape = dict(batch=1, seq_len=48, heads=2, head_dim=8, groups=2, state=8)
        gdn_shape = dict(heads=2, head_dim=8)
        gdn_batch, gdn_len, gdn_docs = 1, 40, [20, 3, 17]
        ssd_chunks, conv_shape = (32, 16), dict(batch=1, seq_len=30, channels=8, width=4)
    else:
        # Realistic sizes: the GPU flavors' mixers (32 heads of 64, state 128, 8 groups).
        ssd_shape = dict(batch=2, seq_len=2048, heads=32, head_dim=64, groups=8, state=128)
        gdn_shape = dict(heads=16, head_dim=128)
        gdn_batch, gdn_len, gdn_docs = 2, 2048, [1000, 37, 2000, 1059]
        ssd_chunks, conv_shape = (256, 128), dict(batch=2, seq_len=2048, channels=6144, width=4)
    cases = []

    def run(name, note, kernel_fn, torch_fn, inputs, dtype, output_names, dispatch_fn=None,
            required=True):
        try:
            case = compare_paths(name, kernel_fn=kernel_fn, torch_fn=torch_fn, inputs=inputs,
                                 output_names=output_names, tolerance=TOLERANCE_REL_TO_MAX[dtype],
                                 time_reps=0 if small else 5)
            case["note"] = note
            if dispatch_fn is not None:
                # Our public op must route CUDA tensors of this dtype to the kernel: same forward.
                with torch.no_grad():
                    via_dispatch = dispatch_fn(**inputs)
                    via_kernel = kernel_fn(**inputs)
                first = (lambda o: o[0] if isinstance(o, tuple) else o)
                case["dispatch_uses_kernel"] = bool(torch.equal(first(via_dispatch), first(via_kernel)))
                case["note"] += f"; dispatcher == kernel: {case['dispatch_uses_kernel']}"
        except Exception as error:  # noqa: BLE001 - a failing case is reported, the rest still run
            case = {"case": name, "passed": False, "error": f"{type(error).__name__}: {error}",
                    "traceback": traceback.format_exc(limit=6)}
        # A case that is not required records what a kernel does outside what our
        # dispatcher sends it (it neither passes nor fails the run).
        case["required"] = required
        cases.append(case)
        if "error" in case:
            print(f"\n[{'FAIL' if required else 'INFO'}] {name}: {case['error']}\n"
                  f"{case['traceback']}")
        else:
            print_case(case)

    if ssd_kernel is not None:
        for dtype, chunk, packed in ((torch.float32, ssd_chunks[0], False),
                                     (torch.bfloat16, ssd_chunks[0], True),
                                     (torch.bfloat16, ssd_chunks[1], False)):
            inputs = ssd_inputs(**ssd_shape, dtype=dtype, device=device, packed=packed, seed=len(cases))
            # With seq_idx, initial states feed only the first document (seq_idx 0) in both.
            note = ("seq_idx (3 docs per row), " if packed else "") + \
                "initial_states, D, z, dt_bias, softplus"
            kwargs = dict(chunk_size=chunk, dt_softplus=True, return_final_states=True)
            shape = ssd_shape
            run(f"SSD {_dtype_name(dtype)} b{shape['batch']} T{shape['seq_len']} h{shape['heads']}"
                f" p{shape['head_dim']} g{shape['groups']} n{shape['state']} chunk {chunk}",
                note, partial(ssd_kernel, **kwargs), partial(ssd_chunked_torch, **kwargs), inputs,
                dtype, ("y", "final_states"), dispatch_fn=partial(mamba_chunk_scan_combined, **kwargs))

    if gdn_kernel is not None:
        # fla's kernels take bf16 / fp16 (our dispatcher sends only those); fp32 is tried
        # directly to record whether fla accepts it.
        for dtype, docs in ((torch.bfloat16, None), (torch.bfloat16, gdn_docs),
                            (torch.float32, None)):
            inputs = gdn_inputs(batch=gdn_batch, seq_len=gdn_len, **gdn_shape, dtype=dtype,
                                device=device, doc_lens=docs, seed=100 + len(cases))
            kwargs = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
            layout = (f"B{gdn_batch} T{gdn_len}" if docs is None
                      else f"cu_seqlens docs {docs}")
            note = "q/k L2-norm in kernel, initial_state, output_final_state"
            dispatch = (partial(chunk_gated_delta_rule, **kwargs) if dtype != torch.float32
                        else None)
            if dtype == torch.float32:
                note += "; informational: our dispatcher never sends fp32 to fla"
            run(f"gated delta {_dtype_name(dtype)} {layout} H{gdn_shape['heads']} "
                f"K=V={gdn_shape['head_dim']}", note, partial(gdn_kernel, **kwargs),
                partial(chunk_gated_delta_rule_torch, **kwargs), inputs, dtype,
                ("o", "final_state"), dispatch_fn=dispatch, required=dtype != torch.float32)

    if conv_kernel is not None:
        for dtype in (torch.float32, torch.bfloat16):
            inputs = conv_inputs(**conv_shape, dtype=dtype, device=device, seed=200 + len(cases))
            run(f"causal conv {_dtype_name(dtype)} b{conv_shape['batch']} T{conv_shape['seq_len']} "
                f"C{conv_shape['channels']} w{conv_shape['width']}", "seq_idx (2 docs), bias, silu",
                partial(conv_kernel, activation="silu"),
                partial(causal_depthwise_conv1d_torch, activation="silu"), inputs, dtype,
                ("out",), dispatch_fn=partial(causal_depthwise_conv1d, activation="silu"))
    return cases


def causal_conv1d_channels_last(causal_conv1d_fn):
    """causal-conv1d's function with our op's signature ([b, l, c] in and out)."""
    def conv(x_BTC, weight_CW, bias_C=None, *, seq_idx=None, activation=None):
        out = causal_conv1d_fn(x_BTC.contiguous().transpose(1, 2), weight_CW, bias_C,
                               seq_idx=seq_idx, activation=activation)
        return out.transpose(1, 2)
    return conv


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float64: "fp64"}[dtype]


# ------------------------------------------------------------------- Triton interpreter (CPU)

def triton_interpreter_cases() -> list[dict]:
    """mamba_ssm's SSD Triton kernel run by Triton's CPU interpreter against our torch path.

    Needs TRITON_INTERPRET=1 in the environment before mamba_ssm is imported (Triton decides at
    `@triton.jit` time). Tiny shapes, float32, every option our mixer passes plus the others
    our API takes: this shows that kernel and torch path compute the same function, forward and
    gradients. It says nothing about GPU numerics (the interpreter runs dots in numpy float32,
    not tf32 / bf16 tensor cores) or speed. fla's kernels do not run in the interpreter (fla
    0.6.0 calls `.to()` on a Python-int loop index), so only mamba_ssm is checked here.

    The kernel's host code assumes CUDA tensors; three stand-ins, active only inside this
    function, let it run on CPU tensors: `torch.cuda.device(None)` becomes a no-op context,
    `torch.cuda.get_device_properties` reports an H100's 132 SMs (backward grid sizing), and
    Triton's autotuner, which times configs with the GPU driver, scores every config equal so
    the first is used.
    """
    import contextlib
    from unittest import mock

    import triton.runtime.autotuner

    from titan_hybrid.ops.ssd import ssd_chunked_torch

    kernel, how = load_mamba_ssm_ssd_kernel()
    print(how)
    if kernel is None:
        return [{"case": "mamba_ssm SSD in the Triton interpreter", "passed": False,
                 "required": True, "error": how}]
    device_properties = types.SimpleNamespace(name="Triton interpreter", multi_processor_count=132)
    variants = [  # (name, input options, kernel options)
        ("seq_idx (3 docs per row), initial_states, D [h], z, dt_bias, softplus",
         dict(batch=2, seq_len=96, heads=4, head_dim=8, groups=2, state=16, packed=True),
         dict(chunk_size=32)),
        ("T=80 not a multiple of chunk 32, D [h, p], no z, dt_limit (1e-3, 0.05)",
         dict(batch=1, seq_len=80, heads=4, head_dim=16, groups=1, state=16, packed=False,
              with_z=False, D_per_channel=True),
         dict(chunk_size=32, dt_limit=(1e-3, 0.05))),
        ("the mixer's call: D [h], dt_bias, softplus, no z, no initial state",
         dict(batch=1, seq_len=64, heads=4, head_dim=8, groups=2, state=16, packed=False,
              with_z=False, with_initial_states=False),
         dict(chunk_size=16)),
    ]
    cases = []
    with mock.patch.object(torch.cuda, "device", lambda index: contextlib.nullcontext()), \
            mock.patch.object(torch.cuda, "get_device_properties",
                              lambda *args, **kwargs: device_properties), \
            mock.patch.object(triton.runtime.autotuner.Autotuner, "_bench",
                              lambda self, *args, config, **kwargs: [0.0, 0.0, 0.0]):
        for seed, (note, input_options, kernel_options) in enumerate(variants):
            inputs = ssd_inputs(**input_options, dtype=torch.float32, device="cpu", seed=seed)
            kwargs = dict(dt_softplus=True, return_final_states=True, **kernel_options)
            name = (f"SSD interpreter fp32 b{input_options['batch']} T{input_options['seq_len']} "
                    f"h{input_options['heads']} p{input_options['head_dim']} "
                    f"g{input_options['groups']} n{input_options['state']} "
                    f"chunk {kernel_options['chunk_size']}")
            try:
                case = compare_paths(name, kernel_fn=partial(kernel, **kwargs),
                                     torch_fn=partial(ssd_chunked_torch, **kwargs), inputs=inputs,
                                     output_names=("y", "final_states"),
                                     tolerance=TOLERANCE_REL_TO_MAX[torch.float32], time_reps=0)
                case["note"] = note
                print_case(case)
            except Exception as error:  # noqa: BLE001
                case = {"case": name, "passed": False, "error": f"{type(error).__name__}: {error}"}
                print(f"\n[FAIL] {name}: {case['error']}\n{traceback.format_exc(limit=6)}")
            case["required"] = True
            cases.append(case)
    return cases


# ------------------------------------------------------------------------------ training speed

def measure_bf16_matmul_flops(*, n: int = 8192, reps: int = 20) -> float:
    """FLOP/s of an n^3 bf16 matmul on random data (median of `reps` after 3 warm-ups)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    times = []
    for rep in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.mm(a, b)
        end.record()
        torch.cuda.synchronize()
        if rep >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    return 2 * n**3 / statistics.median(times)


def measure_training(config: str, *, batch: int, seq_len: int, warmup: int, steps: int,
                     device: torch.device, compile_layers: bool = False) -> dict:
    """Steady-state bf16 training speed of one model on one device (see module docstring)."""
    from titan_hybrid.loss import hybrid_loss
    from titan_hybrid.model.args import hybrid_flavors
    from titan_hybrid.model.flops import nparams_and_flops_per_token
    from titan_hybrid.model.model import HybridModel
    from titan_hybrid.optimizer import param_groups

    flavor, pattern = TRAIN_CONFIGS.get(config, (config, None))
    args = dataclasses.replace(hybrid_flavors[flavor], max_seq_len=seq_len)
    if pattern is not None:
        args = dataclasses.replace(args, pattern=pattern)
    torch.manual_seed(0)
    with torch.device(device):
        model = HybridModel(args)
    model.init_weights(buffer_device=device)
    model.train()
    n_params, flops_per_token = nparams_and_flops_per_token(args, model, seq_len)
    if compile_layers:  # per layer, as torchtitan does; the layers keep their keys
        for key, layer in list(model.layers.items()):
            model.layers[key] = torch.compile(layer)
    on_cuda = device.type == "cuda"
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=3e-4, betas=(0.9, 0.95),
                                  fused=on_cuda)
    gen = torch.Generator(device=device).manual_seed(1)
    tokens = torch.randint(0, args.vocab_size, (batch, seq_len + 1), generator=gen, device=device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def train_step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            pred = model(inputs)
            # hybrid_loss sums; the trainer divides by the number of label tokens.
            loss = hybrid_loss(pred, labels, mtp_loss_coeff=args.mtp_loss_coeff) / labels.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def sync():
        if on_cuda:
            torch.cuda.synchronize()

    losses = []
    warmup_start = time.perf_counter()
    for _ in range(warmup):
        losses.append(train_step())
    sync()
    warmup_s = time.perf_counter() - warmup_start
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    step_times = []
    for _ in range(steps):
        start = time.perf_counter()
        losses.append(train_step())
        sync()
        step_times.append(time.perf_counter() - start)
    step_s = statistics.median(step_times)
    result = {
        "config": config, "pattern": args.pattern, "params": n_params,
        "flops_per_token": flops_per_token, "batch": batch, "seq_len": seq_len,
        "warmup_steps": warmup, "warmup_s": warmup_s, "timed_steps": steps,
        "step_s_median": step_s, "step_s_min": min(step_times), "step_s_max": max(step_times),
        "tokens_per_s": batch * seq_len / step_s,
        "losses": [round(float(loss), 4) for loss in losses],
        "compiled_layers": compile_layers,
    }
    if on_cuda:
        result["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return result


def training_runs(configs: list[str], *, batch: int, seq_len: int, warmup: int, steps: int,
                  compile_layers: bool, peaks: dict) -> list[dict]:
    results = []
    for config in configs:
        size = batch
        while size >= 1:
            label = f"{config} batch {size} x seq {seq_len}" + (" compiled" if compile_layers else "")
            print(f"\ntraining {label} ...", flush=True)
            try:
                result = measure_training(config, batch=size, seq_len=seq_len, warmup=warmup,
                                          steps=steps, device=torch.device("cuda"),
                                          compile_layers=compile_layers)
            except torch.OutOfMemoryError:
                print(f"  out of memory at batch {size}")
                results.append({"config": config, "batch": size, "error": "OutOfMemoryError"})
                size //= 2
                torch.cuda.empty_cache()
                continue
            except Exception as error:  # noqa: BLE001
                print(f"  FAILED: {type(error).__name__}: {error}\n{traceback.format_exc(limit=8)}")
                results.append({"config": config, "batch": size,
                                "error": f"{type(error).__name__}: {error}"})
                break
            flops = result["flops_per_token"] * result["tokens_per_s"]
            result["achieved_tflops"] = flops / 1e12
            result["mfu"] = {name: flops / peak for name, peak in peaks.items()}
            results.append(result)
            print(f"  {result['params'] / 1e9:.3f}B params, {result['flops_per_token'] / 1e9:.2f} "
                  f"GFLOP/token, step {result['step_s_median'] * 1e3:.1f} ms (median of "
                  f"{steps}; min {result['step_s_min'] * 1e3:.1f}, max "
                  f"{result['step_s_max'] * 1e3:.1f}), {result['tokens_per_s']:,.0f} tokens/s, "
                  f"{result['achieved_tflops']:.1f} TFLOP/s, MFU "
                  + ", ".join(f"{mfu:.1%} of {name}" for name, mfu in result["mfu"].items())
                  + f"; peak memory {result['peak_allocated_gib']:.1f} GiB allocated / "
                  f"{result['peak_reserved_gib']:.1f} GiB reserved; warm-up "
                  f"{result['warmup_s']:.1f} s; losses {result['losses']}", flush=True)
            break
        torch.cuda.empty_cache()
    return results


# ------------------------------------------------------------------------------------------ main

def import_titan_hybrid() -> str:
    """Import our package normally; if its __init__ (TrainSpec registration, which pulls in the
    parallel and torchtitan trainer code) fails here, fall back to a bare package so the ops and
    model code can still be verified, and say so."""
    try:
        import titan_hybrid.torchtitan_plugin  # noqa: F401  (TrainSpec, dataset; CPU runtime)
        return "titan_hybrid imported normally"
    except Exception as error:  # noqa: BLE001
        for name in [n for n in sys.modules if n.split(".")[0] == "titan_hybrid"]:
            del sys.modules[name]
        package = types.ModuleType("titan_hybrid")
        package.__path__ = [str(REPO_ROOT / "titan_hybrid")]
        sys.modules["titan_hybrid"] = package
        return (f"titan_hybrid __init__ FAILED ({type(error).__name__}: {error}); "
                "continuing with a bare package (ops and model only)")


def run_unit_tests() -> int:
    import pytest

    print("\n$ pytest tests/unit/test_ssd.py tests/unit/test_gated_delta.py -m 'not slow' -q -rs",
          flush=True)
    return int(pytest.main([str(REPO_ROOT / "tests/unit/test_ssd.py"),
                            str(REPO_ROOT / "tests/unit/test_gated_delta.py"),
                            "-m", "not slow", "-q", "-rs", "-p", "no:cacheprovider"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write all results to this file")
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--train-configs", nargs="+", default=list(TRAIN_CONFIGS),
                        help=f"flavors, or {sorted(TRAIN_CONFIGS)}")
    parser.add_argument("--batch", type=int, default=2, help="halved on out-of-memory")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile per layer")
    parser.add_argument("--triton-interpreter", action="store_true",
                        help="CPU only: run mamba_ssm's SSD Triton kernel in Triton's interpreter "
                             "against our torch path (sets TRITON_INTERPRET=1), then exit")
    args = parser.parse_args(argv)

    if args.triton_interpreter:
        os.environ["TRITON_INTERPRET"] = "1"
        print(f"import: {import_titan_hybrid()}")
        cases = triton_interpreter_cases()
        if args.json:
            args.json.write_text(json.dumps({"interpreter_cases": cases}, indent=1, default=str))
        passed = all(case["passed"] for case in cases)
        print(f"\ngpu_verify --triton-interpreter: {'all cases passed' if passed else 'FAILED'}")
        return 0 if passed else 1

    if not torch.cuda.is_available():
        print("gpu_verify: no CUDA device (torch.cuda.is_available() is False). The kernel "
              "parity checks and the training throughput need an NVIDIA GPU with mamba_ssm / fla; "
              "nothing was measured.")
        return 0

    report = {"date": time.strftime("%Y-%m-%d"), "environment": {}}
    env = report["environment"]
    props = torch.cuda.get_device_properties(0)
    env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
               multiprocessors=props.multi_processor_count, torch=torch.__version__,
               cuda=torch.version.cuda, triton=_dist_version("triton"),
               torchtitan=_dist_version("torchtitan"), python=sys.version.split()[0])
    env["titan_hybrid"] = import_titan_hybrid()
    ssd_kernel, env["mamba_ssm"] = load_mamba_ssm_ssd_kernel()
    gdn_kernel, env["fla"] = load_fla_gated_delta_kernel()
    conv_fn, env["causal_conv1d"] = load_causal_conv1d_kernel()
    for key, value in env.items():
        print(f"{key}: {value}")
    ok = True

    if not args.skip_kernels:
        # Our torch reference must run in true fp32 (no tf32 matmuls) to be a reference.
        tf32_flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        conv_kernel = causal_conv1d_channels_last(conv_fn) if conv_fn is not None else None
        start = time.perf_counter()
        cases = kernel_cases(torch.device("cuda"), ssd_kernel=ssd_kernel, gdn_kernel=gdn_kernel,
                             conv_kernel=conv_kernel)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32_flags
        report["kernel_cases"] = cases
        report["kernel_seconds"] = time.perf_counter() - start
        ok &= all(case["passed"] for case in cases if case["required"])
        ok &= ssd_kernel is not None and gdn_kernel is not None
        torch.cuda.empty_cache()

    if not args.skip_tests:
        report["unit_tests_exit_code"] = run_unit_tests()
        ok &= report["unit_tests_exit_code"] == 0

    if not args.skip_train:
        matmul_flops = measure_bf16_matmul_flops()
        print(f"\nmeasured bf16 matmul (8192^3, random data): {matmul_flops / 1e12:.0f} TFLOP/s")
        peaks = {"H100 SXM datasheet 989 TFLOP/s": H100_SXM_DENSE_BF16_FLOPS,
                 f"measured matmul {matmul_flops / 1e12:.0f} TFLOP/s": matmul_flops}
        report["measured_matmul_tflops"] = matmul_flops / 1e12
        report["training"] = training_runs(args.train_configs, batch=args.batch,
                                           seq_len=args.seq_len, warmup=args.warmup,
                                           steps=args.steps, compile_layers=False, peaks=peaks)
        if args.compile:
            report["training_compiled"] = training_runs(
                args.train_configs[:1], batch=args.batch, seq_len=args.seq_len,
                warmup=args.warmup, steps=args.steps, compile_layers=True, peaks=peaks)
        ok &= all("error" not in run or run["error"] == "OutOfMemoryError"
                  for run in report["training"])

    if "kernel_cases" in report:
        print("\nkernel parity summary:")
        for case in report["kernel_cases"]:
            status = "PASS" if case["passed"] else "FAIL" if case["required"] else "INFO"
            print(f"  {status}  {case['case']}"
                  + (f"  ({case['error'][:120]})" if "error" in case else ""))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    print(f"\ngpu_verify: {'all checks passed' if ok else 'SOME CHECKS FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

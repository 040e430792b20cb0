"""Tests for titan_hybrid.ops.ssd: chunked SSD scan vs the step-by-step recurrence, and mamba_ssm's
Triton kernel (through our op) vs the chunked torch path.

Tolerances: float64 chunked vs float64 recurrence, forward and gradients:
atol=rtol=1e-10. float32 chunked vs float64 recurrence: relative L2 error < 1e-5
(observed ~2e-7). bfloat16 inputs: relative L2 error < 3e-2.

Kernel (marker triton_interpreter, tests/triton_kernels.py) vs ssd_chunked_torch on the same
inputs, relative L2 error of y, the final states and every input gradient:
- float32 in Triton's interpreter: < 2e-5. Both compute in float32 (the interpreter's dots are
  numpy float32 matmuls), differing in chunking and summation order only; observed <= 2.4e-6.
- float32 on CUDA: < 5e-3. Triton runs float32 dots in tf32 (10-bit mantissa, 2**-11 = 4.9e-4
  relative per product), the torch path in full float32. Not measured here (no GPU).
- bfloat16 on CUDA only (the interpreter has no bf16 arithmetic): < 5e-2. Outputs and gradients
  round to bf16 (2**-8 = 3.9e-3), and the kernel keeps chunk states in the input dtype between
  its kernels. Not measured here.
"""

import contextlib
import importlib
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from tests.triton_kernels import (
    DEVICE,
    INTERPRETED,
    LOW_PRECISION,
    assert_close_rel,
    expect_custom_ops,
    kernels_on,
    outputs_and_grads,
)
from titan_hybrid.ops.ssd import (
    mamba_chunk_scan_combined,
    ssd_chunked_torch,
    ssd_recurrent_reference,
)

TIGHT = dict(atol=1e-10, rtol=1e-10)
# mamba_ssm's kernel vs ssd_chunked_torch on the same inputs (relative Frobenius error of every
# output and gradient), see the module docstring.
KERNEL_TOL = {torch.float32: 2e-5 if INTERPRETED else 5e-3, torch.bfloat16: 5e-2}


def make_inputs(b=2, l=37, h=4, p=8, g=2, n=16, dtype=torch.float64, D_shape="h", z=True,
                dt_bias=True, init=False, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    inp = dict(
        x=rnd(b, l, h, p),
        # raw dt around softplus^-1(~0.1..1); A in [-2, -0.5] so decays are non-trivial
        dt=rnd(b, l, h, scale=0.5) - 1.0,
        A=-torch.exp(rnd(h, scale=0.5)),
        B=rnd(b, l, g, n, scale=0.5),
        C=rnd(b, l, g, n, scale=0.5),
    )
    if D_shape == "h":
        inp["D"] = rnd(h)
    elif D_shape == "hp":
        inp["D"] = rnd(h, p)
    if z:
        inp["z"] = rnd(b, l, h, p)
    if dt_bias:
        inp["dt_bias"] = rnd(h, scale=0.5)
    if init:
        inp["initial_states"] = rnd(b, h, p, n)
    return inp


def run_both(inp, chunk_size=16, seq_idx=None, dt_softplus=True, dt_limit=(0.0, float("inf"))):
    """Forward + gradients (for every floating input) of chunked and recurrent paths."""
    leaves = {k: v.clone().requires_grad_(True) for k, v in inp.items()}
    gen = torch.Generator().manual_seed(123)
    out = {}
    for name in ("chunked", "ref"):
        args = {k: v for k, v in leaves.items()}
        if name == "chunked":
            y, s = ssd_chunked_torch(chunk_size=chunk_size, seq_idx=seq_idx, dt_softplus=dt_softplus,
                                     dt_limit=dt_limit, return_final_states=True, **args)
        else:
            y, s = ssd_recurrent_reference(seq_idx=seq_idx, dt_softplus=dt_softplus,
                                           dt_limit=dt_limit, **args)
        if name == "chunked":
            gy = torch.randn(y.shape, generator=gen, dtype=y.dtype)
            gs = torch.randn(s.shape, generator=gen, dtype=s.dtype)
        loss = (y * gy).sum() + (s * gs).sum()
        grads = torch.autograd.grad(loss, list(leaves.values()))
        out[name] = (y.detach(), s.detach(), dict(zip(leaves.keys(), grads)))
    return out


def assert_match(out):
    (y1, s1, g1), (y2, s2, g2) = out["chunked"], out["ref"]
    torch.testing.assert_close(y1, y2, **TIGHT)
    torch.testing.assert_close(s1, s2, **TIGHT)
    for k in g2:
        assert g2[k].abs().max() > 0, f"reference grad for {k} is zero; test would be vacuous"
        torch.testing.assert_close(g1[k], g2[k], **TIGHT, msg=lambda m: f"grad {k}: {m}")


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ---------------------------------------------------------------------------- reference sanity

def test_reference_matches_hand_computed_two_steps():
    """Checks the oracle itself (group mapping, decay, D, z) against the formula by hand."""
    inp = make_inputs(l=2, h=4, g=2, z=True, dt_bias=False)
    x, dt, A, B, C, D, z = (inp[k] for k in ("x", "dt", "A", "B", "C", "D", "z"))
    y, s = ssd_recurrent_reference(x, dt, A, B, C, D=D, z=z)
    r = 2
    for hh in range(4):
        gi = hh // r
        s0 = dt[:, 0, hh, None, None] * x[:, 0, hh, :, None] * B[:, 0, None, gi, :]
        s1 = (torch.exp(dt[:, 1, hh] * A[hh])[:, None, None] * s0
              + dt[:, 1, hh, None, None] * x[:, 1, hh, :, None] * B[:, 1, None, gi, :])
        for t, st in ((0, s0), (1, s1)):
            yt = (st @ C[:, t, gi, :, None])[..., 0] + D[hh] * x[:, t, hh]
            yt = yt * z[:, t, hh] * torch.sigmoid(z[:, t, hh])
            torch.testing.assert_close(y[:, t, hh], yt, **TIGHT)
        torch.testing.assert_close(s[:, hh], s1, **TIGHT)


# ---------------------------------------------------------------------------- chunked vs recurrence

@pytest.mark.parametrize("l", [37, 48, 100])
def test_chunked_matches_recurrence_fwd_bwd(l):
    # l=37, 100: not a multiple of 16 (padding); l=48: exact multiple
    inp = make_inputs(l=l, init=True)
    assert_match(run_both(inp))


def test_groups_and_D_hp_without_softplus():
    # g=1 < h (all heads share B/C) and g=h; D of shape [h, p]; raw dt (no softplus) kept positive
    for g in (1, 4):
        inp = make_inputs(l=41, g=g, D_shape="hp", z=False, dt_bias=False, seed=g)
        inp["dt"] = inp["dt"].abs() * 0.5
        assert_match(run_both(inp, dt_softplus=False))


def test_dt_limit_clamps():
    inp = make_inputs(l=45, init=True)
    limit = (0.3, 0.6)
    dt_eff = F.softplus(inp["dt"] + inp["dt_bias"])
    # both sides of the clamp are active, otherwise the test would not exercise it
    assert (dt_eff < limit[0]).any() and (dt_eff > limit[1]).any()
    out = run_both(inp, dt_limit=limit)
    assert_match(out)
    unclamped = run_both(inp)["ref"][0]
    assert not torch.allclose(out["ref"][0], unclamped)


def test_float32_close_to_float64_recurrence():
    inp64 = make_inputs(l=100, init=True)
    inp32 = {k: v.float() for k, v in inp64.items()}
    y64, s64 = ssd_recurrent_reference(dt_softplus=True, **inp64)
    y32, s32 = ssd_chunked_torch(chunk_size=16, dt_softplus=True, return_final_states=True, **inp32)
    assert y32.dtype == torch.float32 and s32.dtype == torch.float32
    assert rel_err(y32, y64) < 1e-5
    assert rel_err(s32, s64) < 1e-5


def test_float32_gradients_close_to_float64_recurrence():
    inp64 = make_inputs(l=100, init=True)
    weights = {"y": torch.randn(2, 100, 4, 8, dtype=torch.float64),
               "s": torch.randn(2, 4, 8, 16, dtype=torch.float64)}

    def grads(fn, inputs, **kwargs):
        leaves = {k: v.clone().requires_grad_(True) for k, v in inputs.items()}
        y, s = fn(dt_softplus=True, **kwargs, **leaves)
        loss = (y * weights["y"].to(y.dtype)).sum() + (s * weights["s"].to(s.dtype)).sum()
        return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))

    ref = grads(ssd_recurrent_reference, inp64)
    got = grads(ssd_chunked_torch, {k: v.float() for k, v in inp64.items()}, chunk_size=16,
                return_final_states=True)
    for name in ref:
        assert got[name].dtype == torch.float32
        assert rel_err(got[name], ref[name]) < 1e-5, name


def test_bfloat16_inputs_run_in_fp32():
    inp64 = make_inputs(l=64)
    inp16 = {k: v.bfloat16() for k, v in inp64.items()}
    y_ref, _ = ssd_recurrent_reference(dt_softplus=True, **{k: v.double() for k, v in inp16.items()})
    y16, s = ssd_chunked_torch(chunk_size=16, dt_softplus=True, return_final_states=True, **inp16)
    assert y16.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert rel_err(y16, y_ref) < 3e-2


# ---------------------------------------------------------------------------- final state / padding

def test_padding_does_not_change_final_state():
    # softplus + dt_bias + dt_limit min > 0: padding dt *before* processing would give
    # dt > 0 on padded steps and visibly decay the final state.
    inp = make_inputs(l=37, init=True)
    kw = dict(dt_softplus=True, dt_limit=(0.05, float("inf")), return_final_states=True)
    y_pad, s_pad = ssd_chunked_torch(chunk_size=16, **kw, **inp)  # 37 -> 48
    y_one, s_one = ssd_chunked_torch(chunk_size=37, **kw, **inp)  # no padding
    _, s_ref = ssd_recurrent_reference(dt_softplus=True, dt_limit=(0.05, float("inf")), **inp)
    torch.testing.assert_close(s_pad, s_ref, **TIGHT)
    torch.testing.assert_close(s_one, s_ref, **TIGHT)
    torch.testing.assert_close(y_pad, y_one, **TIGHT)
    assert y_pad.shape == inp["x"].shape


def test_final_state_only_when_requested_and_dispatch_on_cpu():
    inp = make_inputs(l=20)
    y = mamba_chunk_scan_combined(chunk_size=8, dt_softplus=True, **inp)
    assert isinstance(y, torch.Tensor) and y.shape == inp["x"].shape
    y2, s = mamba_chunk_scan_combined(chunk_size=8, dt_softplus=True, return_final_states=True, **inp)
    y_ref, s_ref = ssd_recurrent_reference(dt_softplus=True, **inp)
    torch.testing.assert_close(y, y_ref, **TIGHT)
    torch.testing.assert_close(y2, y_ref, **TIGHT)
    torch.testing.assert_close(s, s_ref, **TIGHT)


# ---------------------------------------------------------------------------- packed documents

def _seq_idx(b, bounds_per_row, l):
    seq = torch.zeros(b, l, dtype=torch.int32)
    for row, bounds in enumerate(bounds_per_row):
        for i, start in enumerate(bounds):
            seq[row, start:] = i + 1
    return seq


# l=80, chunk 16. Row 0: docs [0,20) [20,48) [48,80) -> boundary inside chunk 1 and
# exactly on the chunk-3 start. Row 1: docs [0,32) [32,39) [39,80).
PACKED_L = 80
PACKED_BOUNDS = [(20, 48), (32, 39)]


@pytest.mark.parametrize("init", [False, True])
def test_seq_idx_chunked_matches_recurrence(init):
    inp = make_inputs(l=PACKED_L, init=init)
    seq = _seq_idx(2, PACKED_BOUNDS, PACKED_L)
    assert_match(run_both(inp, seq_idx=seq))


def test_seq_idx_equals_separate_documents():
    inp = make_inputs(l=PACKED_L, init=True)
    seq = _seq_idx(2, PACKED_BOUNDS, PACKED_L)
    kw = dict(chunk_size=16, dt_softplus=True, return_final_states=True)
    y, s = ssd_chunked_torch(seq_idx=seq, **kw, **inp)
    seq_args = {k: v for k, v in inp.items() if k not in ("A", "D", "dt_bias", "initial_states")}
    shared = {k: inp[k] for k in ("A", "D", "dt_bias")}
    for row, bounds in enumerate(PACKED_BOUNDS):
        edges = [0, *bounds, PACKED_L]
        for d, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
            doc = {k: v[row:row + 1, lo:hi] for k, v in seq_args.items()}
            # initial_states belongs to the first document only; later ones start from zero
            init = inp["initial_states"][row:row + 1] if d == 0 else None
            y_doc, s_doc = ssd_chunked_torch(initial_states=init, **kw, **doc, **shared)
            torch.testing.assert_close(y[row:row + 1, lo:hi], y_doc, **TIGHT)
        torch.testing.assert_close(s[row:row + 1], s_doc, **TIGHT)  # state of the last document
    # without seq_idx the documents leak into each other: the check above is not vacuous
    y_leak = ssd_chunked_torch(**{**kw, "return_final_states": False}, **inp)
    assert not torch.allclose(y_leak[:, 20:], y[:, 20:])


def test_seq_idx_initial_state_needs_doc_zero():
    # mamba_ssm convention: the position before the sequence has seq_idx 0, so a row whose
    # first id is non-zero ignores initial_states.
    inp = make_inputs(l=40, init=True)
    seq = torch.full((2, 40), 3, dtype=torch.int32)
    seq[:, 25:] = 4
    y, s = ssd_chunked_torch(chunk_size=16, dt_softplus=True, seq_idx=seq, return_final_states=True, **inp)
    no_init = {k: v for k, v in inp.items() if k != "initial_states"}
    y0, s0 = ssd_chunked_torch(chunk_size=16, dt_softplus=True, seq_idx=seq, return_final_states=True, **no_init)
    y_ref, _ = ssd_recurrent_reference(dt_softplus=True, seq_idx=seq, **inp)
    torch.testing.assert_close(y, y0, **TIGHT)
    torch.testing.assert_close(y, y_ref, **TIGHT)


# ---------------------------------------------------------------------------- GPU kernel parity

def _kernel_inputs(case, device, dtype):
    """Inputs for one kernel case; x, B and C are views into one fused tensor, as the mixer
    passes them (non-contiguous, unit last stride)."""
    make, options = KERNEL_CASES[case]
    inp = make_inputs(**make)
    b, l, h, p = inp["x"].shape
    g, n = inp["B"].shape[-2:]
    fused = torch.cat([inp["x"].flatten(2), inp["B"].flatten(2), inp["C"].flatten(2)], -1)
    fused = fused.to(device, dtype)
    x, B, C = fused.split([h * p, g * n, g * n], -1)
    inp = {k: v.to(device, dtype if k in ("x", "z", "B", "C") else torch.float32)
           for k, v in inp.items()}
    inp.update(x=x.unflatten(-1, (h, p)), B=B.unflatten(-1, (g, n)), C=C.unflatten(-1, (g, n)))
    options = dict(options)
    if "seq_bounds" in options:  # int64 ids: the op converts them to the kernel's int32
        options["seq_idx"] = _seq_idx(b, options.pop("seq_bounds"), l).long().to(device)
    return inp, options


KERNEL_CASES = {  # name: (make_inputs arguments, op arguments)
    # documents [0, 20) [20, 32) [32, 64): a boundary inside a chunk and one on a chunk's start
    "seq_idx, initial_states, D [h], z, dt_bias": (
        dict(b=1, l=64, h=4, p=8, g=2, n=16, init=True, seed=1),
        dict(chunk_size=32, seq_bounds=[(20, 32)])),
    "length 40 (not a multiple of 32), D [h, p], no z, dt_limit": (
        dict(b=2, l=40, h=2, p=8, g=1, n=16, D_shape="hp", z=False, init=True, seed=2),
        dict(chunk_size=32, dt_limit=(0.05, 0.5))),
    "the mixer's call: D [h], dt_bias, no z, no initial or final state": (
        dict(b=1, l=64, h=2, p=16, g=2, n=8, z=False, seed=3),
        dict(chunk_size=16, return_final_states=False)),
}


# The last case runs under torch.compile below (one interpreter run per case keeps the marker
# near a minute).
@pytest.mark.triton_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, *LOW_PRECISION])
@pytest.mark.parametrize("case", list(KERNEL_CASES)[:2])
def test_mamba_ssm_kernel_matches_torch_path(case, dtype):
    inp, options = _kernel_inputs(case, DEVICE, dtype)
    kwargs = dict(dt_softplus=True, return_final_states=True) | options
    with kernels_on(), expect_custom_ops("mamba_ssd_fwd", "mamba_ssd_bwd"):
        got = outputs_and_grads(mamba_chunk_scan_combined, inp, **kwargs)
    want = outputs_and_grads(ssd_chunked_torch, inp, **kwargs)
    assert len(got[0]) == 1 + kwargs["return_final_states"]
    assert got[0][-1].dtype == (torch.float32 if kwargs["return_final_states"] else dtype)
    assert_close_rel(got, want, KERNEL_TOL[dtype], case)


@pytest.mark.triton_interpreter
def test_mamba_ssm_kernel_under_torch_compile_fullgraph():
    """The kernel path is one opaque custom op for forward and one for backward: dynamo and
    AOTAutograd trace it whole (fullgraph), with the ops' fake implementations."""
    case = list(KERNEL_CASES)[2]
    inp, options = _kernel_inputs(case, DEVICE, torch.float32)
    kwargs = dict(dt_softplus=True) | options
    compiled = torch.compile(mamba_chunk_scan_combined, backend="aot_eager", fullgraph=True)
    with kernels_on(), expect_custom_ops("mamba_ssd_fwd", "mamba_ssd_bwd"):
        got = outputs_and_grads(compiled, inp, **kwargs)
    assert type(got[0][0].grad_fn).__name__ == "CompiledFunctionBackward"
    want = outputs_and_grads(ssd_chunked_torch, inp, **kwargs)
    assert_close_rel(got, want, KERNEL_TOL[torch.float32], "compiled " + case)


@pytest.mark.triton_interpreter
def test_mamba_ssm_backward_reuses_the_forwards_states():
    """The backward runs on what the forward kept: mamba_ssm's forward steps (dt's softplus and
    chunked cumsum, the chunk states, their passing) run once, in the forward, and nothing in
    the backward clones dt (mamba_ssm's own backward recomputes all four, after a dt.clone()).
    The gradients stay the torch path's (test_mamba_ssm_kernel_matches_torch_path)."""
    case = list(KERNEL_CASES)[0]
    inp, options = _kernel_inputs(case, DEVICE, torch.float32)
    leaves = {name: value.detach().requires_grad_(value.is_floating_point())
              if isinstance(value, torch.Tensor) else value for name, value in inp.items()}
    steps = ("_chunk_cumsum_fwd", "_chunk_state_fwd", "_state_passing_fwd")
    with kernels_on(), contextlib.ExitStack() as stack:
        combined = importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
        calls = {step: stack.enter_context(mock.patch.object(
            combined, step, wraps=getattr(combined, step))) for step in steps}
        y, final = mamba_chunk_scan_combined(**leaves, dt_softplus=True, return_final_states=True,
                                             **options)
        assert {step: spy.call_count for step, spy in calls.items()} == dict.fromkeys(steps, 1)
        with torch.profiler.profile(record_shapes=True) as prof:
            torch.autograd.backward((y, final), (torch.randn_like(y), torch.randn_like(final)))
        assert {step: spy.call_count for step, spy in calls.items()} == dict.fromkeys(steps, 1)
    clones = [event.input_shapes for event in prof.events() if event.name == "aten::clone"]
    assert clones == [], clones
    assert all(leaf.grad is not None for leaf in leaves.values()
               if isinstance(leaf, torch.Tensor) and leaf.requires_grad)


def test_autocast_does_not_lower_precision():
    inp64 = make_inputs(l=64, init=True)
    inp32 = {k: v.float() for k, v in inp64.items()}
    y64, _ = ssd_recurrent_reference(dt_softplus=True, **inp64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y32 = ssd_chunked_torch(chunk_size=16, dt_softplus=True, **inp32)
    assert y32.dtype == torch.float32
    assert rel_err(y32, y64) < 1e-5

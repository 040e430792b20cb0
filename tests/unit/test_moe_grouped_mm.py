"""MoE experts on grouped GEMM (titan_hybrid.model.moe) against the per-expert loop they replaced
(bench/moe_layer.py's `moe_forward_loop`: the forward before issue 23, index_add_ combine).

- fp32 parity, forward and every gradient (input, fc1, fc2, router gate, shared expert), with one
  expert that gets no token: against the loop run in float64 at fp32 tolerances, and against
  the same loop in fp32. Measured (torch 2.13.0+cpu): bitwise equal to the fp32 loop (CPU's
  grouped_mm runs one mm per group, the combine's gather + sum adds the same two terms as the
  index_add_; also at the debug_moe job's sizes); vs float64, largest differences 3.3e-6 on the
  output and 1.6e-5 on gradients (tolerance atol = rtol = 1e-5).
- float64 and widths that are not a multiple of 16 bytes take the loop (grouped_mm refuses them).
- Matmul ops per layer forward + backward: the same number at 4 and 16 experts; no scatter-add,
  no zero-filled buffer of the tokens' size, and as many fills at 16 experts as at 4.
- Autocast bf16 on CPU (one GPU runs fp32 weights under autocast): grouped_mm gets bf16
  operands (autocast does not cast it) and the layer agrees with fp32 within bf16 rounding
  (measured: relative Frobenius error <= 8.1e-3 on the output and every gradient; tolerance
  2e-2).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import titan_hybrid.model.moe as moe_module
from bench.moe_layer import build_moe, compare, matmul_op_count, moe_forward_loop
from titan_hybrid.model.moe import MoE

DIM, HIDDEN, SHARED, EXPERTS, UNUSED = 32, 16, 24, 4, 3


@pytest.fixture
def grouped_mm_calls(monkeypatch):
    """The operand dtypes of every grouped_mm call the MoE makes."""
    calls = []
    real = moe_module.F.grouped_mm

    def spy(a, b, *, offs):
        calls.append((a.dtype, b.dtype))
        return real(a, b, offs=offs)

    monkeypatch.setattr(moe_module.F, "grouped_mm", spy)
    return calls


def routed_layer(*, dim=DIM, hidden=HIDDEN, score_func="softmax", seed=0):
    """A MoE with random weights, and an input it routes nothing to expert UNUSED: its gate row
    is -4 on feature 0, which is >= 1 for every token."""
    moe = build_moe(dim=dim, hidden=hidden, experts=EXPERTS, top_k=2, shared=SHARED, seed=seed)
    moe.args.score_func = score_func
    with torch.no_grad():
        for param in moe.parameters():
            param.copy_(torch.randn_like(param) * 0.3)
        moe.router.gate.weight[UNUSED, 0] = -4.0
    x_BTD = torch.randn(3, 11, dim, generator=torch.Generator().manual_seed(seed + 1))
    x_BTD[..., 0] = x_BTD[..., 0].abs() + 1
    return moe, x_BTD


def run(forward, moe, x_BTD):
    """Output, aux loss and the gradients of a probe loss w.r.t. the input and every parameter."""
    moe.zero_grad(set_to_none=True)
    x_BTD = x_BTD.detach().clone().requires_grad_()
    out, aux = forward(moe, x_BTD)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype)
    ((out * probe).sum() + aux).backward()
    grads = {"x": x_BTD.grad, **{name: p.grad for name, p in moe.named_parameters()}}
    return {"out": out.detach(), "aux": aux.detach(), **grads}


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_grouped_experts_match_the_loop_in_fp32(score_func, grouped_mm_calls):
    moe, x_BTD = routed_layer(score_func=score_func)
    got = run(MoE.forward, moe, x_BTD)
    assert len(grouped_mm_calls) == 2, "fp32 at these widths must take the grouped path"
    assert moe.routed_tokens[UNUSED] == 0 and moe.routed_tokens.sum() == 2 * x_BTD[..., 0].numel()
    loop_fp32 = run(moe_forward_loop, moe, x_BTD)
    reference = run(moe_forward_loop, copy.deepcopy(moe).double(), x_BTD.double())
    assert set(got) == {"out", "aux", "x", "router.gate.weight", "experts.fc1", "experts.fc2",
                        "shared_expert.fc1.weight", "shared_expert.fc2.weight"}
    for name, value in got.items():
        assert value.dtype == torch.float32, name
        torch.testing.assert_close(value.double(), reference[name], atol=1e-5, rtol=1e-5,
                                   msg=name)
        assert torch.equal(value, loop_fp32[name]), f"{name}: not bitwise equal to the fp32 loop"
    for name in ("experts.fc1", "experts.fc2"):
        assert got[name][UNUSED].abs().max() == 0, f"{name}: the unused expert got a gradient"
        assert (got[name][:UNUSED].flatten(1).abs().sum(1) > 0).all(), name


@pytest.mark.parametrize("dtype, hidden", [(torch.float64, HIDDEN), (torch.float32, 10)])
def test_float64_and_odd_widths_take_the_loop(dtype, hidden, grouped_mm_calls):
    # hidden 10: 40-byte fp32 rows, not a multiple of 16 bytes.
    moe, x_BTD = routed_layer(hidden=hidden)
    moe, x_BTD = moe.to(dtype), x_BTD.to(dtype)
    got = run(MoE.forward, moe, x_BTD)
    assert not grouped_mm_calls
    want = run(moe_forward_loop, moe, x_BTD)
    for name, value in got.items():
        assert torch.equal(value, want[name]), name


def test_matmul_ops_per_layer_do_not_grow_with_experts():
    counts, loop_counts = {}, {}
    for experts in (4, 16):
        moe = build_moe(dim=64, hidden=32, experts=experts, top_k=2, shared=32)
        x_BTD = torch.randn(2, 64, 64, requires_grad=True)
        counts[experts] = matmul_op_count(MoE.forward, moe, x_BTD)
        loop_counts[experts] = matmul_op_count(moe_forward_loop, moe, x_BTD)
    # Forward: router gate, shared fc1 / fc2, two grouped GEMMs; backward: two of each.
    assert counts == {4: 15, 16: 15}
    # The counter sees per-expert matmuls: the loop's 9 + 6 per expert.
    assert loop_counts == {4: 33, 16: 105}


BUFFER_OPS = ("aten::zeros", "aten::zero_", "aten::fill_", "aten::index_add_",
              "aten::index_put_", "aten::_index_put_impl_", "aten::index_copy_",
              "aten::new_zeros")


def _inside(event, names) -> bool:
    parent = event.cpu_parent
    while parent is not None and parent.name not in names:
        parent = parent.cpu_parent
    return parent is not None


def buffer_ops(moe, x_BTD):
    """(name, tensor size) of every fill / scatter-add in one forward + backward, leaving out
    the fills reduction kernels do to start their outputs."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        out, aux = moe(x_BTD)
        (out.square().sum() + aux).backward()
    found = []
    for event in prof.events():
        if event.name in BUFFER_OPS and not _inside(event, ("aten::sum", "aten::mean")):
            shapes = [shape for shape in event.input_shapes if shape]
            found.append((event.name, torch.Size(shapes[0]).numel() if shapes else 0))
    return found


def test_no_zero_filled_buffer_and_no_scatter_add():
    tokens, dim = 128, 64
    found = {}
    for experts in (4, 16):
        moe = build_moe(dim=dim, hidden=32, experts=experts, top_k=2, shared=32)
        found[experts] = buffer_ops(moe, torch.randn(2, tokens // 2, dim, requires_grad=True))
    for experts, ops in found.items():
        names = {name for name, _ in ops}
        assert not names & {"aten::index_add_", "aten::index_put_", "aten::_index_put_impl_"}, \
            names
        # What is left: the counts (E), the router's top-k backward (X x E), ones to count.
        assert max(size for _, size in ops) < tokens * dim, ops
    assert len(found[4]) == len(found[16]), found


@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
def test_autocast_bf16_runs_grouped_mm_in_bf16(input_dtype, grouped_mm_calls):
    moe, x_BTD = routed_layer(dim=64, hidden=32)
    want = run(MoE.forward, moe, x_BTD)
    grouped_mm_calls.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = run(MoE.forward, moe, x_BTD.to(input_dtype))
    assert grouped_mm_calls == [(torch.bfloat16, torch.bfloat16)] * 2
    for name, value in got.items():
        assert torch.isfinite(value).all(), name
        error = (value.double() - want[name].double()).norm() / want[name].double().norm()
        assert error < 2e-2, (name, error.item())


def test_bench_runs_small():
    row = compare(experts=4, tokens=64, dim=32, hidden=16, top_k=2, repeats=1)
    assert row["grouped_matmuls"] == 9 and row["loop_matmuls"] == 27, row
    assert row["grouped_ms"] > 0 and row["loop_ms"] > 0

"""fla on a runtime that refuses its gated delta rule backward alone: a Hopper GPU with triton
3.6.0 (>= 3.4.0, < 3.7.1: titan_hybrid.ops.kernels.fla_gated_delta_bwd_refusal), simulated with
`simulate_gpu_runtime`. GDN's forward still runs fla's kernel (l2norm included) and its backward
differentiates the torch path, without calling fla's backward, eagerly and under
torch.compile(fullgraph); KDA runs fla's kernels whole, l2norm's backward included.

In Triton's interpreter on CPU (marker triton_interpreter, tests/triton_kernels.py), on CUDA
where there is a GPU. Tolerances are the float32 kernel-parity ones of test_gated_delta.py and
test_kda.py: relative Frobenius error of every output and input gradient against the torch path
below 2e-5 in the interpreter (observed 1.5e-6 for GDN, 1.8e-6 for KDA); GDN's gradients in the
interpreter are the torch path's bit for bit (its backward is the torch path's arithmetic).
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch

from tests.triton_kernels import (
    DEVICE,
    INTERPRETED,
    assert_close_rel,
    expect_custom_ops,
    kernels_on,
    outputs_and_grads,
)
from tests.unit import test_kda
from tests.unit.test_gated_delta import KERNEL_TOL, _kernel_inputs
from titan_hybrid.compat import kernel_packages
from titan_hybrid.ops.gated_delta import chunk_gated_delta_rule, chunk_gated_delta_rule_torch
from titan_hybrid.ops.kda import chunk_kda, chunk_kda_torch
from titan_hybrid.ops.kernels import kernel_op_refused, simulate_gpu_runtime

pytestmark = pytest.mark.triton_interpreter

HOPPER_WITH_TRITON_3_6 = ((9, 0), "3.6.0")
# Two rows of 100 tokens (a chunk and a partial one): starts inside a chunk and at its edge.
ROWS = [[0] * 30 + [1] * 34 + [2] * 36, [7] * 64 + [8] * 36]
GDN_LAUNCHERS = ("gated_delta_rule_fwd", "gated_delta_rule_bwd", "l2norm_fwd", "l2norm_bwd")


@contextlib.contextmanager
def launcher_calls(*names: str):
    """{name: the number of calls} of kernel_packages' launchers `names`, each still run."""
    with contextlib.ExitStack() as stack:
        spies = {name: stack.enter_context(mock.patch.object(
            kernel_packages, name, wraps=getattr(kernel_packages, name))) for name in names}
        calls = {}
        yield calls
        calls.update({name: spy.call_count for name, spy in spies.items()})


@pytest.fixture
def fresh_dynamo():
    """Dynamo keeps compiled code per function across torch.compile wrappers, and the backward
    chosen at compile time is not guarded: other tests' kernel backward must not be reused."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _gdn_inputs(seed):
    inputs, kwargs = _kernel_inputs(len(ROWS), [len(ROWS[0])], torch.float32, l2norm=True,
                                    seed=seed)
    inputs["initial_state"] = torch.randn(len(ROWS), 2, 16, 16, device=DEVICE)
    kwargs.update(seq_idx=torch.tensor(ROWS, device=DEVICE), output_final_state=True)
    return inputs, kwargs


@pytest.mark.parametrize("compiled", [False, True])
def test_gdn_forward_runs_fla_and_backward_differentiates_the_torch_path(compiled, fresh_dynamo):
    """Packed documents (seq_idx), an initial state per row, final states, l2norm in the kernel:
    the forward op and fla's forward and l2norm launchers run, fla's backward does not, and
    every gradient is the torch path's."""
    inputs, kwargs = _gdn_inputs(seed=21)
    op = chunk_gated_delta_rule
    if compiled:
        op = torch.compile(chunk_gated_delta_rule, backend="aot_eager", fullgraph=True)
    with kernels_on(), simulate_gpu_runtime(*HOPPER_WITH_TRITON_3_6):
        assert kernel_op_refused("fla_gated_delta_bwd")
        with launcher_calls(*GDN_LAUNCHERS) as calls, expect_custom_ops(
                "fla_gated_delta_fwd", not_run=("fla_gated_delta_bwd",)):
            got = outputs_and_grads(op, inputs, **kwargs)
    assert calls == {"gated_delta_rule_fwd": 1, "gated_delta_rule_bwd": 0, "l2norm_fwd": 2,
                     "l2norm_bwd": 0}
    if compiled:
        assert type(got[0][0].grad_fn).__name__ == "CompiledFunctionBackward"
    want = outputs_and_grads(chunk_gated_delta_rule_torch, inputs, **kwargs)
    assert set(got[1]) == {"q", "k", "v", "g", "beta", "initial_state"}
    assert_close_rel(got, want, KERNEL_TOL[torch.float32],
                     f"fla forward, torch backward{', compiled' if compiled else ''}")
    if INTERPRETED:  # on a GPU the compiled backward may sum in another order
        assert all(torch.equal(got[1][name], want[1][name]) for name in want[1])


def test_kda_and_l2norm_run_fla_whole():
    """KDA's backward never calls the refused kernel: both KDA ops and fla's l2norm forward
    and backward run, and match the torch path."""
    inputs = test_kda.kernel_inputs(1, 64, torch.float32, seed=22)  # one chunk: KDA is slow
    kwargs = dict(output_final_state=True, use_qk_l2norm_in_kernel=True,
                  seq_idx=torch.tensor(ROWS[:1], device=DEVICE)[:, :64])
    with kernels_on(), simulate_gpu_runtime(*HOPPER_WITH_TRITON_3_6):
        with launcher_calls("kda_fwd", "kda_bwd", "l2norm_fwd", "l2norm_bwd") as calls, \
                expect_custom_ops(*test_kda.KERNEL_OPS):
            got = outputs_and_grads(chunk_kda, inputs, **kwargs)
    assert calls == {"kda_fwd": 1, "kda_bwd": 1, "l2norm_fwd": 2, "l2norm_bwd": 2}
    want = outputs_and_grads(chunk_kda_torch, inputs, **kwargs)
    assert_close_rel(got, want, test_kda.KERNEL_TOL[torch.float32], "fla kda on old Hopper")

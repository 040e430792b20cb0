"""mamba_ssm 2.3.2.post1's Mamba-3 module and its SISO Triton kernels against our layer: its state
dict loads into ours as it is, and its forward (the kernels, in Triton's interpreter on CPU)
gives our torch path's output, for its options we compute (groups, rope fraction, the output
norm), and per document what our packed rows give.

On CPU two things differ from a GPU run, both in tests/triton_kernels.py: the kernels' PTX
approximations of cos / sin / tanh are the exact functions (mamba3_kernels_on), and the module's
wrapper, which casts q, k, x, z and the angles to bfloat16 (the interpreter multiplies bf16 bit
patterns), is called past that cast, in float32. The SISO backward asserts CUDA tensors: it is
checked only on a GPU (bench/kernel_check.py)."""

from __future__ import annotations

import contextlib
import importlib
from unittest import mock

import pytest
import torch

from tests.triton_kernels import (
    assert_close_to_scale,
    expect_custom_ops,
    layer_outputs_and_grads,
    mamba3_kernels_on,
)
from titan_hybrid.model.layout import TokenLayout
from titan_hybrid.model.mamba3 import Mamba3Args, Mamba3Mixer

pytestmark = pytest.mark.triton_interpreter

DIM, LENGTH = 32, 37
OPTIONS = {  # mamba_ssm's Mamba3 options: ours
    "plain": (dict(), dict()),
    "groups-rope1-norm": (dict(ngroups=2, rope_fraction=1.0, is_outproj_norm=True),
                          dict(n_groups=2, rope_fraction=1.0, outproj_norm=True)),
}


@contextlib.contextmanager
def their_module_in_float32():
    """mamba_ssm's modules.mamba3, its SISO entry point called past its bfloat16 casts."""
    with mamba3_kernels_on():
        module = importlib.import_module("mamba_ssm.modules.mamba3")
        combined = importlib.import_module("mamba_ssm.ops.triton.mamba3.mamba3_siso_combined")

        def without_casts(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D=None, Z=None,
                          Input_States=None, chunk_size=64, return_final_states=False,
                          cu_seqlens=None):
            states = Input_States if Input_States is not None else (None,) * 4
            return combined._Mamba3Function.apply(Q, K, V, ADT, DT, Trap, Q_bias, K_bias,
                                                  Angles, D, Z, *states, cu_seqlens,
                                                  chunk_size, return_final_states)

        with mock.patch.object(module, "mamba3_siso_combined", without_casts):
            yield module


def theirs_and_ours(options: str):
    theirs_options, ours_options = OPTIONS[options]
    with their_module_in_float32() as module:
        torch.manual_seed(0)
        theirs = module.Mamba3(d_model=DIM, d_state=16, headdim=16, chunk_size=16,
                               **theirs_options)
    with torch.no_grad():
        for parameter in theirs.parameters():  # every parameter away from its init
            parameter.add_(0.2 * torch.randn_like(parameter))
    ours = Mamba3Mixer(dim=DIM, args=Mamba3Args(d_state=16, head_dim=16, chunk_size=16,
                                                **ours_options))
    ours.load_state_dict(theirs.state_dict())  # strict: the same names and shapes
    return theirs, ours


@pytest.mark.parametrize("options", list(OPTIONS))
def test_their_state_dict_loads_and_their_kernels_give_our_output(options):
    theirs, ours = theirs_and_ours(options)
    u = torch.randn(2, LENGTH, DIM)
    with their_module_in_float32():
        want = theirs(u)
    got = ours(u)
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * scale)


def test_our_packed_documents_are_their_documents_one_by_one():
    theirs, ours = theirs_and_ours("plain")
    lengths = (9, 1, 19, 8)
    u = torch.randn(1, sum(lengths), DIM)
    with their_module_in_float32():
        want = torch.cat([theirs(part) for part in u.split(lengths, 1)], 1)
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    got = ours(u, TokenLayout(positions=None, seq_idx=seq_idx))
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * scale)


# mamba_ssm's SISO forward keeps the chunks' states in bfloat16, and its backward reads them
# for q's gradient: what flows through q (C, its bias and norm, the angles and dt, so both
# projections and the input) is as good as bfloat16 (relative errors up to 1.1e-2 measured);
# the rest agrees to 1e-4 (measured 5e-7). A backward that is wrong is off by O(1).
READ_THE_STATES = {"input", "dt_bias", "C_bias", "C_norm.weight", "in_proj.weight",
                   "bc_proj.weight"}
THROUGH_THE_STATES = 3e-2


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("documents", [False, True], ids=["rows", "documents"])
def test_our_layer_on_their_kernels_gives_the_torch_paths_output_and_gradients(options,
                                                                             documents):
    """Our dispatch to mamba_ssm's kernels (ops/mamba3_kernel.py: its biases, angles, rotation
    and gate inside the kernels; packed documents as its cu_seqlens), forward and backward:
    the output and every parameter's and the input's gradient."""
    _, ours = theirs_and_ours(options)
    u = torch.randn(2, LENGTH, DIM, requires_grad=True)
    layout = None
    if documents:
        seq_idx = torch.zeros(2, LENGTH, dtype=torch.long)
        seq_idx[:, 7:], seq_idx[1:, 8:], seq_idx[:, 30:] = 1, 2, 3
        layout = TokenLayout(positions=None, seq_idx=seq_idx)
    want = layer_outputs_and_grads(ours, u, layout)
    with mamba3_kernels_on(), expect_custom_ops("mamba3_siso_fwd", "mamba3_siso_bwd"):
        assert ours.core.runs_kernel(u)
        got = layer_outputs_and_grads(ours, u, layout)
    assert_close_to_scale(got, want, lambda name: THROUGH_THE_STATES
                          if name in READ_THE_STATES else 1e-4)


def test_their_kernels_compile_into_one_graph_with_documents_and_without():
    """Under torch.compile(fullgraph=True) the forward custom op's fake outputs stand in for
    mamba_ssm's residuals, whose chunk count with packed documents depends on the data."""
    _, ours = theirs_and_ours("plain")
    u = torch.randn(2, LENGTH, DIM)
    seq_idx = torch.zeros(2, LENGTH, dtype=torch.long)
    seq_idx[:, 7:], seq_idx[1:, 8:] = 1, 2
    layout = TokenLayout(positions=None, seq_idx=seq_idx)
    want = (ours(u, layout), ours(u))
    with torch.no_grad(), mamba3_kernels_on(), expect_custom_ops("mamba3_siso_fwd"):
        compiled = torch.compile(ours, fullgraph=True)
        got = (compiled(u, layout), compiled(u, None))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())

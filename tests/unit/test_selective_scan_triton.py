"""Mamba1's selective scan through our Triton kernels (ops/selective_scan_triton.py): outputs,
final states and every gradient against the torch path (checked itself against a float64
recurrence in tests/unit/test_selective_scan.py), with packed documents, initial states, the
gate and dt's bias and softplus; several chunks and channel blocks, strided inputs, and the
custom ops' run. On CPU the kernels run in Triton's interpreter (tests/triton_kernels.py)."""

import pytest
import torch

from tests.triton_kernels import DEVICE, assert_close_rel, expect_custom_ops, outputs_and_grads
from titan_hybrid.ops import selective_scan_triton as kernels
from titan_hybrid.ops.selective_scan import selective_scan_torch
from titan_hybrid.ops.selective_scan_triton import selective_scan_triton

pytestmark = pytest.mark.triton_interpreter

# Smaller tiles than the GPU's (the interpreter runs each token's step as Python): two rows;
# channels over two blocks (the second partial), tokens over three chunks (the last partial),
# a state size that is not a power of two.
CHUNK, BLOCK_D = 8, 8
BATCH, LENGTH, CHANNELS, STATE = 2, 2 * CHUNK + 3, BLOCK_D + 5, 5


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(kernels, "CHUNK", CHUNK)
    monkeypatch.setattr(kernels, "BLOCK_D", BLOCK_D)


def _inputs(documents: bool, initial: bool, gate: bool = True) -> dict:
    gen = torch.Generator().manual_seed(7)

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(DEVICE)

    inputs = dict(u_BTD=rnd(BATCH, LENGTH, CHANNELS), dt_BTD=rnd(BATCH, LENGTH, CHANNELS),
                  A_DN=-torch.exp(rnd(CHANNELS, STATE, scale=0.5)),
                  B_BTN=rnd(BATCH, LENGTH, STATE), C_BTN=rnd(BATCH, LENGTH, STATE),
                  D=rnd(CHANNELS), dt_bias=rnd(CHANNELS, scale=0.5),
                  z_BTD=rnd(BATCH, LENGTH, CHANNELS) if gate else None,
                  initial_state=rnd(BATCH, CHANNELS, STATE) if initial else None)
    if documents:
        # row 0: a start inside the first chunk, one on the second chunk's first token and
        # one inside it; row 1 starts in document 2, so its initial state is dropped
        starts = torch.zeros(LENGTH, dtype=torch.long)
        starts[[5, CHUNK, CHUNK + 4]] = 1
        inputs["seq_idx"] = torch.stack((starts.cumsum(0), torch.full((LENGTH,), 2))).to(DEVICE)
    return inputs


@pytest.mark.parametrize("documents, initial", [(False, False), (True, True)],
                         ids=["one-document", "packed-with-initial-state"])
def test_the_kernels_are_the_torch_path_with_every_gradient(documents, initial):
    inputs = _inputs(documents, initial)
    kwargs = dict(dt_softplus=True, return_final_state=True)
    want = outputs_and_grads(selective_scan_torch, inputs, **kwargs)
    with expect_custom_ops("triton_selective_scan_fwd", "triton_selective_scan_bwd"):
        got = outputs_and_grads(selective_scan_triton, inputs, **kwargs)
    assert_close_rel(got, want, 1e-5, f"documents {documents}, initial state {initial}")
    if documents and initial:  # row 1 starts a new document: its initial state has no effect
        assert got[1]["initial_state"][1].abs().max() == 0
        assert got[1]["initial_state"][0].abs().max() > 0


def test_without_gate_skip_bias_or_softplus_and_on_strided_slices():
    """The plain recurrence (no z, D, dt_bias or softplus), with B and C read in place from a
    slice of a wider projection, as the mixer passes them."""
    inputs = _inputs(documents=True, initial=False, gate=False)
    for name in ("D", "dt_bias"):
        inputs[name] = None
    inputs["dt_BTD"] = inputs["dt_BTD"].abs() * 0.1  # a positive step without softplus
    projection = torch.randn(BATCH, LENGTH, 3 * STATE, device=DEVICE)
    inputs["B_BTN"], inputs["C_BTN"] = projection[..., STATE:2 * STATE], projection[..., 2 * STATE:]
    want = outputs_and_grads(selective_scan_torch, inputs)
    got = outputs_and_grads(selective_scan_triton, inputs)
    assert_close_rel(got, want, 1e-5, "plain")


def test_the_same_inputs_give_the_same_gradients_bit_for_bit():
    inputs = _inputs(documents=True, initial=True)
    first = outputs_and_grads(selective_scan_triton, inputs, dt_softplus=True)
    second = outputs_and_grads(selective_scan_triton, inputs, dt_softplus=True)
    for a, b in zip(first[0] + list(first[1].values()), second[0] + list(second[1].values())):
        assert torch.equal(a, b)

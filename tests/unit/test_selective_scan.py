"""Mamba1's selective scan (ops/selective_scan.py): the chunked torch path (selective_scan_torch)
against a per-token recurrence in float64, outputs, final states and every gradient, with packed
documents and initial states; and the inputs' sensitivity to what a broken scan gets wrong (a
decay per head instead of per channel and state entry, a document start missed)."""

from __future__ import annotations

import pytest
import torch

from titan_hybrid.ops.selective_scan import selective_scan_reference, selective_scan_torch

BATCH, LENGTH, CHANNELS, STATE = 2, 37, 6, 4  # 37: not a multiple of the chunk


def inputs(seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=generator, dtype=torch.float64))

    return dict(u_BTD=rnd(BATCH, LENGTH, CHANNELS), dt_BTD=rnd(BATCH, LENGTH, CHANNELS),
                A_DN=-torch.exp(rnd(CHANNELS, STATE, scale=0.5)), B_BTN=rnd(BATCH, LENGTH, STATE),
                C_BTN=rnd(BATCH, LENGTH, STATE), D=rnd(CHANNELS), z_BTD=rnd(BATCH, LENGTH, CHANNELS),
                dt_bias=rnd(CHANNELS, scale=0.5), initial_state=rnd(BATCH, CHANNELS, STATE))


def documents() -> torch.Tensor:
    """Row 0: documents of 5, 20 and 12 tokens (a start inside a chunk and one on a chunk's
    first token); row 1: one document."""
    row0 = torch.repeat_interleave(torch.arange(3), torch.tensor([5, 20, 12]))
    return torch.stack((row0, torch.zeros(LENGTH, dtype=torch.long)))


def both(seq_idx, **overrides):
    """(chunked, reference) outputs and final states, and their gradients of every input."""
    results = []
    for scan in (selective_scan_torch, selective_scan_reference):
        tensors = {name: value.clone().requires_grad_() for name, value in inputs().items()}
        tensors.update(overrides)
        kwargs = dict(dt_softplus=True, seq_idx=seq_idx)
        if scan is selective_scan_torch:
            kwargs["return_final_state"] = True
        y, state = scan(**tensors, **kwargs)
        cotangent = torch.randn(y.shape, generator=torch.Generator().manual_seed(1),
                                dtype=y.dtype)
        leaves = [value for value in tensors.values() if value.requires_grad]
        grads = torch.autograd.grad((y * cotangent).sum() + state.square().sum(), leaves)
        results.append((y, state, grads))
    return results


@pytest.mark.parametrize("packed", [False, True], ids=["one-document", "packed"])
def test_the_chunked_scan_is_the_recurrence(packed):
    (y, state, grads), (y_ref, state_ref, grads_ref) = both(documents() if packed else None)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, state_ref, rtol=1e-10, atol=1e-10)
    for grad, expected in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-9)


def test_float32_inputs_compute_in_float32_and_keep_their_dtype():
    floats = {name: value.float() for name, value in inputs().items()}
    y, state = selective_scan_torch(**floats, dt_softplus=True, seq_idx=documents(),
                              return_final_state=True)
    assert y.dtype == torch.float32 and state.dtype == torch.float32
    y_ref, _ = selective_scan_reference(**inputs(), dt_softplus=True, seq_idx=documents())
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-4, atol=1e-4)


def test_a_broken_scan_would_fail_these_tests():
    """The test inputs tell a decay per channel and state entry from one per head, and a
    document reset from none: either change moves the outputs far beyond the tolerances."""
    reference, _ = selective_scan_reference(**inputs(), dt_softplus=True, seq_idx=documents())
    per_head = inputs()
    per_head["A_DN"] = per_head["A_DN"].view(2, 3, STATE).mean(1, keepdim=True).expand(
        2, 3, STATE).reshape(CHANNELS, STATE)
    broken, _ = selective_scan_reference(**per_head, dt_softplus=True, seq_idx=documents())
    assert (broken - reference).abs().max() > 1e-3
    no_reset, _ = selective_scan_reference(**inputs(), dt_softplus=True, seq_idx=None)
    assert (no_reset - reference).abs().max() > 1e-3


def test_backward_keeps_no_states():
    """What autograd keeps for backward is smaller than a chunk's states [b, q, d, n]: each
    chunk is recomputed in backward from its inputs and entering state. Kept, the states of
    every token cost T x d x n floats a row (1 GB a layer at t 2048, d 1024, n 16, b 2)."""
    kept = []

    def pack(tensor):
        kept.append(tensor.numel())
        return tensor

    tensors = {name: value.float().requires_grad_() for name, value in inputs().items()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        y = selective_scan_torch(**tensors, dt_softplus=True, seq_idx=documents(),
                                 chunk_size=16)
    y.sum().backward()
    assert kept, "autograd kept nothing: the hook saw no saved tensor"
    assert max(kept) < BATCH * 16 * CHANNELS * STATE, max(kept)
    assert tensors["A_DN"].grad is not None and tensors["u_BTD"].grad.abs().sum() > 0

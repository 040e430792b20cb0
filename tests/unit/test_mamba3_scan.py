"""Mamba-3's chunked scan (titan_hybrid/ops/mamba3_scan.py) against the per-token recurrence
of the paper (arXiv 2603.15569, its exponential-trapezoidal rule; read against mamba_ssm
2.3.2.post1's step kernel), in float64: outputs, final states and every gradient, with packed
documents, an entering state, SISO and MIMO; and the two ways it could go wrong that a loose
check would miss (the previous token's term dropped, a document's restart missed)."""

from __future__ import annotations

import pytest
import torch

from titan_hybrid.ops.mamba3_scan import mamba3_scan


def recurrence(x, q, k, dt, log_decay, lam, D, seq_idx=None, initial_state=None,
               previous_token_term=True):
    """h_t = exp(a_t) h_{t-1} + (1 - lam_t) dt_t exp(a_t) sum_r x_{t-1,r} k_{t-1,r}^T
    + lam_t dt_t sum_r x_{t,r} k_{t,r}^T; o_t,r = h_t q_t,r + D x_t,r; a document's first
    token restarts h and has no previous token. Returns (o, (h, k, x) after the last token)."""
    b, t, r, h, p = x.shape
    n = q.shape[-1]
    if initial_state is None:
        state = x.new_zeros(b, h, p, n)
        k_prev, x_prev = q.new_zeros(b, r, h, n), x.new_zeros(b, r, h, p)
    else:
        state, k_prev, x_prev = initial_state
    document = torch.zeros(b, dtype=torch.long)  # the position before counts as document 0
    outputs = []
    for step in range(t):
        if seq_idx is not None:
            same = (seq_idx[:, step] == document)[:, None, None, None].to(x.dtype)
            state, k_prev, x_prev = state * same, k_prev * same, x_prev * same
            document = seq_idx[:, step]
        decay = log_decay[:, step].exp()[..., None, None]  # [b, h, 1, 1]
        previous = torch.einsum("brhp,brhn->bhpn", x_prev, k_prev)
        current = torch.einsum("brhp,brhn->bhpn", x[:, step], k[:, step])
        state = (decay * state
                 + (1 - lam[:, step]) [..., None, None] * dt[:, step][..., None, None] * decay
                 * previous * previous_token_term
                 + lam[:, step][..., None, None] * dt[:, step][..., None, None] * current)
        outputs.append(torch.einsum("bhpn,brhn->brhp", state, q[:, step])
                       + D[:, None] * x[:, step])
        k_prev, x_prev = k[:, step], x[:, step]
    return torch.stack(outputs, 1), (state, k_prev, x_prev)


def inputs(b=2, t=19, r=1, h=3, p=4, n=6, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator, dtype=dtype) * scale)

    dt = torch.nn.functional.softplus(rand(b, t, h) - 1)
    A = -torch.nn.functional.softplus(rand(b, t, h)).clamp(min=1e-4)
    return dict(x_BTRHP=rand(b, t, r, h, p), q_BTRHN=rand(b, t, r, h, n),
                k_BTRHN=rand(b, t, r, h, n), dt_BTH=dt, log_decay_BTH=A * dt,
                lam_BTH=torch.sigmoid(rand(b, t, h)), D_H=rand(h))


def packed(b, t, seed=1):
    """Each row's document ids: 0 first, several documents, one of a single token."""
    seq_idx = torch.zeros(b, t, dtype=torch.long)
    seq_idx[:, 5:] = 1
    seq_idx[:, 6:] = 2
    seq_idx[1:, 13:] = 3
    return seq_idx


def entering(b, r, h, p, n, seed=2):
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=generator, dtype=torch.float64)
                 for shape in ((b, h, p, n), (b, r, h, n), (b, r, h, p)))


def reference_of(named, seq_idx=None, initial_state=None, **options):
    return recurrence(named["x_BTRHP"], named["q_BTRHN"], named["k_BTRHN"], named["dt_BTH"],
                      named["log_decay_BTH"], named["lam_BTH"], named["D_H"], seq_idx,
                      initial_state, **options)


@pytest.mark.parametrize("rank", [1, 4], ids=["siso", "mimo"])
@pytest.mark.parametrize("documents", [False, True], ids=["one-document", "documents"])
@pytest.mark.parametrize("chunk_size", [4, 8, 32])
def test_chunks_give_the_recurrences_outputs_states_and_gradients(rank, documents, chunk_size):
    named = inputs(r=rank)
    b, t, _, h, p = named["x_BTRHP"].shape
    n = named["q_BTRHN"].shape[-1]
    seq_idx = packed(b, t) if documents else None
    start = entering(b, rank, h, p, n)
    leaves = {**named, **{f"start{i}": v for i, v in enumerate(start)}}
    for tensor in leaves.values():
        tensor.requires_grad_(True)
    start = tuple(leaves[f"start{i}"] for i in range(3))

    want, want_final = reference_of(named, seq_idx, start)
    got, got_final = mamba3_scan(**named, chunk_size=chunk_size, seq_idx_BT=seq_idx,
                                 initial_state=start, return_final_state=True)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for a, b_ in zip(got_final, want_final, strict=True):
        torch.testing.assert_close(a, b_, rtol=1e-10, atol=1e-10)

    generator = torch.Generator().manual_seed(3)
    probes = [torch.randn(v.shape, generator=generator, dtype=v.dtype)
              for v in (want, *want_final)]

    def loss(out, final):
        return sum((v * w).sum() for v, w in zip((out, *final), probes, strict=True))

    want_grads = torch.autograd.grad(loss(want, want_final), list(leaves.values()))
    got_grads = torch.autograd.grad(loss(got, got_final), list(leaves.values()))
    for name, a, b_ in zip(leaves, got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b_, rtol=1e-9, atol=1e-9, msg=name)


def test_the_previous_tokens_term_and_document_restarts_matter():
    """The check above would catch either mistake: without the trapezoid's previous-token term,
    or reading a state across a document start, the recurrence gives other outputs."""
    named = inputs(r=2)
    b, t = named["dt_BTH"].shape[:2]
    seq_idx = packed(b, t)
    got = mamba3_scan(**named, chunk_size=8, seq_idx_BT=seq_idx)
    without_previous, _ = reference_of(named, seq_idx, previous_token_term=False)
    one_document, _ = reference_of(named, None)
    for wrong in (without_previous, one_document):
        assert (got - wrong).abs().max() > 1e-3


def test_a_row_split_in_two_resumes_from_the_first_halfs_final_state():
    """What chunkwise context parallelism relies on: the second half of a row, given the first
    half's final state (h, its last token's k and x), gives the whole row's outputs."""
    named = inputs(r=2, t=21)
    whole = mamba3_scan(**named, chunk_size=4)
    first = {key: value[:, :10] if value.dim() > 1 else value for key, value in named.items()}
    second = {key: value[:, 10:] if value.dim() > 1 else value for key, value in named.items()}
    head, state = mamba3_scan(**first, chunk_size=4, return_final_state=True)
    tail = mamba3_scan(**second, chunk_size=4, initial_state=state)
    torch.testing.assert_close(torch.cat([head, tail], 1), whole, rtol=1e-10, atol=1e-10)


def test_float32_inputs_give_float32_outputs_close_to_float64():
    named = inputs(r=1)
    want = mamba3_scan(**named, chunk_size=8)
    got = mamba3_scan(**{k: v.float() for k, v in named.items()}, chunk_size=8)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)

"""Chunked gated delta rule (titan_hybrid.ops.gated_delta) against the step-by-step recurrence.

Tolerances: float64 chunked vs float64 recurrence, forward and every gradient, atol = rtol =
1e-9 (observed errors ~1e-14). float32 chunked vs float64 recurrence: relative Frobenius error
below 1e-5 for outputs, final states and gradients (observed <= 1.2e-6). Packed documents as
seq_idx: the same tolerances, against the recurrence run on each document alone and against the
cu_seqlens path on the same documents.

fla's kernel (marker triton_interpreter, tests/triton_kernels.py) vs
chunk_gated_delta_rule_torch on the same inputs, relative Frobenius error of o, the final states
and every input gradient:
- float32 in Triton's interpreter: < 2e-5. Both compute in float32 (numpy float32 dots), but the
  kernel inverts (I + A) by blocked forward substitution and keeps decays in base 2, the torch
  path uses a triangular solve; observed 1.7e-6 to 3.1e-6 (seq_idx: 1.4e-6 to 1.9e-6).
- float32 on CUDA: < 5e-3 (tf32 dots, 2**-11 relative per product). Not measured here (no GPU).
- bfloat16 on CUDA only (the interpreter has no bf16 arithmetic): < 5e-2 (bf16 rounding of
  inputs to every dot and of the outputs, 2**-8 each). Not measured here.
"""

import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.triton_kernels import (
    DEVICE,
    INTERPRETED,
    LOW_PRECISION,
    assert_close_rel,
    expect_custom_ops,
    kernels_on,
    outputs_and_grads,
)
from titan_hybrid.ops.gated_delta import (
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_torch,
    recurrent_gated_delta_rule_reference,
)
from titan_hybrid.ops.kernels import kernel_op_refused

F64 = dict(atol=1e-9, rtol=1e-9)
FP32_REL_TOL = 1e-5
# fla's kernel vs chunk_gated_delta_rule_torch on the same inputs (relative Frobenius error of
# every output and gradient), see the module docstring.
KERNEL_TOL = {torch.float32: 2e-5 if INTERPRETED else 5e-3, torch.bfloat16: 5e-2}


def make_inputs(B, T, H, K, V, dtype=torch.float64, normalize=True, g_scale=1.0):
    """q, k, v, g, beta, h0. Unit keys (or l2norm in the kernel) keep the recurrence stable."""
    q = torch.randn(B, T, H, K, dtype=dtype)
    k = torch.randn(B, T, H, K, dtype=dtype)
    if normalize:
        k = F.normalize(k, dim=-1)
    else:  # deliberately far from unit norm, for use_qk_l2norm_in_kernel=True
        q, k = 3 * q, 2.5 * k
    v = torch.randn(B, T, H, V, dtype=dtype)
    g = -F.softplus(torch.randn(B, T, H, dtype=dtype)) * g_scale
    beta = torch.rand(B, T, H, dtype=dtype) * 0.9 + 0.05
    h0 = torch.randn(B, H, K, V, dtype=dtype)
    return [q, k, v, g, beta], h0


def forward_backward(fn, inputs, h0, **kwargs):
    """Output, final state and gradients of a fixed random projection of both."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    h0_leaf = None if h0 is None else h0.detach().clone().requires_grad_()
    o, final = fn(*leaves, initial_state=h0_leaf, output_final_state=True, **kwargs)
    gen = torch.Generator().manual_seed(1234)
    w_o = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    w_final = torch.randn(final.shape, generator=gen, dtype=torch.float64)
    loss = (o * w_o.to(o.dtype)).sum() + (final * w_final.to(final.dtype)).sum()
    grads = torch.autograd.grad(loss, leaves + ([] if h0 is None else [h0_leaf]))
    return o, final, grads


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("T", [150, 37, 128])
@pytest.mark.parametrize("l2norm", [False, True])
def test_chunked_matches_recurrence_float64(T, l2norm):
    torch.manual_seed(0)
    inputs, h0 = make_inputs(2, T, 3, 16, 8, normalize=not l2norm)
    o, final, grads = forward_backward(chunk_gated_delta_rule_torch, inputs, h0,
                                       use_qk_l2norm_in_kernel=l2norm)
    o_ref, final_ref, grads_ref = forward_backward(recurrent_gated_delta_rule_reference, inputs,
                                                   h0, use_qk_l2norm_in_kernel=l2norm)
    torch.testing.assert_close(o, o_ref, **F64)
    torch.testing.assert_close(final, final_ref, **F64)
    for name, grad, grad_ref in zip("q k v g beta initial_state".split(), grads, grads_ref):
        torch.testing.assert_close(grad, grad_ref, **F64, msg=lambda m: f"d{name}: {m}")


def test_small_chunk_size_and_no_initial_state():
    torch.manual_seed(1)
    inputs, _ = make_inputs(1, 70, 2, 8, 8)
    o, final, grads = forward_backward(chunk_gated_delta_rule_torch, inputs, None, chunk_size=16)
    o_ref, final_ref, grads_ref = forward_backward(recurrent_gated_delta_rule_reference, inputs,
                                                   None)
    torch.testing.assert_close(o, o_ref, **F64)
    torch.testing.assert_close(final, final_ref, **F64)
    for grad, grad_ref in zip(grads, grads_ref):
        torch.testing.assert_close(grad, grad_ref, **F64)
    o_only, no_state = chunk_gated_delta_rule_torch(*inputs)
    assert no_state is None
    torch.testing.assert_close(o_only, o_ref, **F64)


def test_float32_matches_float64_recurrence():
    torch.manual_seed(2)
    inputs, h0 = make_inputs(2, 150, 4, 16, 16)
    o, final, grads = forward_backward(chunk_gated_delta_rule_torch,
                                       [x.float() for x in inputs], h0.float())
    o_ref, final_ref, grads_ref = forward_backward(recurrent_gated_delta_rule_reference, inputs,
                                                   h0)
    assert o.dtype == torch.float32 and final.dtype == torch.float32
    assert rel_err(o, o_ref) < FP32_REL_TOL
    assert rel_err(final, final_ref) < FP32_REL_TOL
    for grad, grad_ref in zip(grads, grads_ref):
        assert rel_err(grad, grad_ref) < FP32_REL_TOL


def test_bfloat16_output_dtype_and_fp32_state():
    torch.manual_seed(3)
    inputs, h0 = make_inputs(1, 40, 2, 8, 8, dtype=torch.bfloat16)
    o, final = chunk_gated_delta_rule_torch(*inputs, initial_state=h0.float(),
                                            output_final_state=True)
    assert o.dtype == torch.bfloat16 and final.dtype == torch.float32
    o_ref, _ = recurrent_gated_delta_rule_reference(*[x.double() for x in inputs],
                                                    initial_state=h0.double())
    assert rel_err(o, o_ref) < 1e-2  # bf16 output rounding


def test_strong_decay_stays_finite():
    """Cumulative log-decays of ~-1000 in a chunk: exp(G_i - G_j) for i < j would overflow."""
    torch.manual_seed(4)
    inputs, h0 = make_inputs(1, 128, 2, 8, 8, g_scale=20.0)
    inputs[3][:, ::7] = 0.0  # mix in a few non-decaying steps
    for dtype in (torch.float32, torch.float64):
        o, final, grads = forward_backward(chunk_gated_delta_rule_torch,
                                           [x.to(dtype) for x in inputs], h0.to(dtype))
        assert all(t.isfinite().all() for t in (o, final, *grads))
    o_ref, final_ref, grads_ref = forward_backward(recurrent_gated_delta_rule_reference, inputs,
                                                   h0)
    torch.testing.assert_close(o.double(), o_ref, **F64)
    for grad, grad_ref in zip(grads, grads_ref):
        torch.testing.assert_close(grad, grad_ref, **F64)


def test_reference_single_step_closed_form():
    """Pins the oracle itself to the stated recurrence (T = 1, explicit scale)."""
    torch.manual_seed(5)
    (q, k, v, g, beta), h0 = make_inputs(1, 1, 2, 4, 3)
    o, final = recurrent_gated_delta_rule_reference(q, k, v, g, beta, scale=0.7, initial_state=h0,
                                                    output_final_state=True)
    for h in range(2):
        S = torch.exp(g[0, 0, h]) * h0[0, h]
        v_new = beta[0, 0, h] * (v[0, 0, h] - S.T @ k[0, 0, h])
        S = S + torch.outer(k[0, 0, h], v_new)
        torch.testing.assert_close(final[0, h], S, **F64)
        torch.testing.assert_close(o[0, 0, h], S.T @ (0.7 * q[0, 0, h]), **F64)


def test_default_scale_and_l2norm():
    torch.manual_seed(6)
    inputs, h0 = make_inputs(1, 50, 2, 16, 8, normalize=False)
    q, k = inputs[:2]
    o_default, _ = chunk_gated_delta_rule_torch(*inputs, initial_state=h0,
                                                use_qk_l2norm_in_kernel=True)
    o_scaled, _ = chunk_gated_delta_rule_torch(*inputs, initial_state=h0, scale=0.3,
                                               use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o_scaled, o_default * 0.3 * 16 ** 0.5, **F64)  # default K**-0.5
    o_prenormed, _ = chunk_gated_delta_rule_torch(F.normalize(q, dim=-1), F.normalize(k, dim=-1),
                                                  *inputs[2:], initial_state=h0)
    torch.testing.assert_close(o_default, o_prenormed, atol=1e-6, rtol=1e-6)


def test_grouped_value_heads_read_their_key_head():
    """Fewer query / key heads than value heads (fla's GVA): value head h reads key head
    h // (H / Hk), the same as repeating each key head in place; gradients sum over the group."""
    (q, k, v, g, beta), h0 = make_inputs(2, 70, 4, 8, 6)
    q_shared, k_shared = q[:, :, ::2], k[:, :, ::2]  # 2 key heads for 4 value heads
    got = forward_backward(chunk_gated_delta_rule, [q_shared, k_shared, v, g, beta], h0,
                           use_qk_l2norm_in_kernel=True)
    repeated = [q_shared.repeat_interleave(2, 2), k_shared.repeat_interleave(2, 2), v, g, beta]
    want = forward_backward(recurrent_gated_delta_rule_reference, repeated, h0,
                            use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(got[0], want[0], **F64)
    torch.testing.assert_close(got[1], want[1], **F64)
    for grad_got, grad_want in zip(got[2][:2], want[2][:2]):
        torch.testing.assert_close(grad_got, grad_want.unflatten(2, (2, 2)).sum(3), **F64)
    for grad_got, grad_want in zip(got[2][2:], want[2][2:]):
        torch.testing.assert_close(grad_got, grad_want, **F64)
    with pytest.raises(ValueError, match="4 value heads are not a multiple of 3"):
        chunk_gated_delta_rule(q[:, :, :3], k[:, :, :3], v, g, beta)


def _pack(inputs, lens):
    cu = torch.tensor([0] + lens).cumsum(0)
    return [x[:1, :sum(lens)] for x in inputs], cu


@pytest.mark.parametrize("lens", [[37, 91, 22], [64, 27, 59]])  # boundaries inside/at chunk edges
@pytest.mark.parametrize("with_h0", [False, True])
def test_cu_seqlens_equals_separate_documents(lens, with_h0):
    torch.manual_seed(7)
    inputs, _ = make_inputs(1, sum(lens), 2, 16, 8)
    (q, k, v, g, beta), cu = _pack(inputs, lens)
    h0 = torch.randn(len(lens), 2, 16, 8, dtype=torch.float64) if with_h0 else None
    o, final = chunk_gated_delta_rule_torch(q, k, v, g, beta, initial_state=h0,
                                            output_final_state=True, cu_seqlens=cu)
    assert o.shape == v.shape and final.shape == (len(lens), 2, 16, 8)
    for i, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        doc = [x[:, start:end] for x in (q, k, v, g, beta)]
        o_doc, final_doc = chunk_gated_delta_rule_torch(
            *doc, initial_state=None if h0 is None else h0[i:i + 1], output_final_state=True)
        torch.testing.assert_close(o[:, start:end], o_doc, **F64)
        torch.testing.assert_close(final[i:i + 1], final_doc, **F64)
        o_doc_ref, final_doc_ref = recurrent_gated_delta_rule_reference(
            *doc, initial_state=None if h0 is None else h0[i:i + 1], output_final_state=True)
        torch.testing.assert_close(o_doc, o_doc_ref, **F64)
        torch.testing.assert_close(final_doc, final_doc_ref, **F64)


def test_cu_seqlens_gradients_match_recurrence():
    torch.manual_seed(8)
    lens = [37, 91, 22]
    inputs, _ = make_inputs(1, sum(lens), 2, 8, 8, normalize=False)
    inputs, cu = _pack(inputs, lens)
    h0 = torch.randn(len(lens), 2, 8, 8, dtype=torch.float64)
    kwargs = dict(cu_seqlens=cu.to(torch.int32), use_qk_l2norm_in_kernel=True)
    o, final, grads = forward_backward(chunk_gated_delta_rule_torch, inputs, h0, **kwargs)
    o_ref, final_ref, grads_ref = forward_backward(recurrent_gated_delta_rule_reference, inputs,
                                                   h0, **kwargs)
    torch.testing.assert_close(o, o_ref, **F64)
    torch.testing.assert_close(final, final_ref, **F64)
    for grad, grad_ref in zip(grads, grads_ref):
        torch.testing.assert_close(grad, grad_ref, **F64)


def test_cu_seqlens_rejects_batch_and_bad_states():
    torch.manual_seed(9)
    inputs, _ = make_inputs(2, 20, 2, 8, 8)
    cu = torch.tensor([0, 5, 20])
    for fn in (chunk_gated_delta_rule, chunk_gated_delta_rule_torch,
               recurrent_gated_delta_rule_reference):
        with pytest.raises(ValueError, match="batch size 1"):
            fn(*inputs, cu_seqlens=cu)
        with pytest.raises(ValueError, match="initial_state"):
            fn(*[x[:1] for x in inputs], cu_seqlens=cu,
               initial_state=torch.zeros(3, 2, 8, 8, dtype=torch.float64))


# ------------------------------------------------------------------ seq_idx: documents per row

# T = 150 (not a multiple of the 64-token chunk): 3 chunks, the last one 22 tokens long.
PACKED_ROWS = [
    # starts at 30, at 64 (exactly a chunk start) and at 134; the third document crosses 128
    [0] * 30 + [1] * 34 + [2] * 70 + [3] * 16,
    [7] * 150,  # one document, ids need not start at 0
    # a document from 5 to 145 spans a whole chunk; one-token documents at 145 and 146
    [2] * 5 + [3] * 140 + [4] + [5] + [6] * 3,
    # a start at 128 (a chunk start), documents of one and two tokens inside a chunk
    [0] * 10 + [1] + [2] * 2 + [3] * 115 + [4] * 22,
]


def _documents_of_row(ids):
    """(start, end) of each document of one row of seq_idx."""
    starts = [0] + [t for t in range(1, len(ids)) if ids[t] != ids[t - 1]]
    return list(zip(starts, starts[1:] + [len(ids)]))


def per_document_reference(q, k, v, g, beta, scale=None, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=False, *,
                           seq_idx):
    """The step-by-step recurrence run on each document alone: a row's initial state enters
    its first document only, its final state is its last document's."""
    outs, finals = [], []
    for row, ids in enumerate(seq_idx.tolist()):
        state = None if initial_state is None else initial_state[row:row + 1]
        row_outs = []
        for start, end in _documents_of_row(ids):
            o, state = recurrent_gated_delta_rule_reference(
                *(x[row:row + 1, start:end] for x in (q, k, v, g, beta)), scale=scale,
                initial_state=state if start == 0 else None, output_final_state=True,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
            row_outs.append(o)
        outs.append(torch.cat(row_outs, 1))
        finals.append(state)
    return torch.cat(outs), (torch.cat(finals) if output_final_state else None)


def as_cu_seqlens(fn):
    """`fn` with seq_idx turned into fla's cu_seqlens: rows laid end to end as one packed row,
    each row's initial state given to its first document and its final state taken from its
    last."""
    def packed(q, k, v, g, beta, initial_state=None, output_final_state=False, *, seq_idx,
               **kwargs):
        B, T = seq_idx.shape
        bounds = [(row * T + start, row * T + end) for row, ids in enumerate(seq_idx.tolist())
                  for start, end in _documents_of_row(ids)]
        cu = torch.tensor([0] + [end for _, end in bounds])
        first = torch.tensor([i for i, (start, _) in enumerate(bounds) if start % T == 0])
        last = torch.cat((first[1:] - 1, torch.tensor([len(bounds) - 1])))
        h0 = None
        if initial_state is not None:
            h0 = initial_state.new_zeros((len(bounds),) + initial_state.shape[1:])
            h0 = h0.index_copy(0, first, initial_state)
        o, final = fn(*(x.flatten(0, 1)[None] for x in (q, k, v, g, beta)), initial_state=h0,
                      output_final_state=output_final_state, cu_seqlens=cu, **kwargs)
        return o.view(v.shape), (None if final is None else final[last])
    return packed


def _assert_all_close(got, want, **tolerance):
    (o, final, grads), (o_want, final_want, grads_want) = got, want
    torch.testing.assert_close(o, o_want, **tolerance)
    torch.testing.assert_close(final, final_want, **tolerance)
    for name, grad, grad_want in zip("q k v g beta initial_state".split(), grads, grads_want):
        assert grad_want.abs().max() > 0, name  # no vacuous comparison
        torch.testing.assert_close(grad, grad_want, **tolerance, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("chunk_size", [64, 16])
@pytest.mark.parametrize("l2norm", [False, True])
def test_seq_idx_equals_documents_run_alone(chunk_size, l2norm):
    """Rows of different layouts in one batch against the recurrence per document, forward and
    every gradient; and against the cu_seqlens path on the same documents."""
    torch.manual_seed(20)
    seq_idx = torch.tensor(PACKED_ROWS)
    inputs, h0 = make_inputs(len(PACKED_ROWS), seq_idx.shape[1], 2, 16, 8, normalize=not l2norm)
    kwargs = dict(seq_idx=seq_idx, use_qk_l2norm_in_kernel=l2norm)
    got = forward_backward(chunk_gated_delta_rule_torch, inputs, h0, chunk_size=chunk_size,
                           **kwargs)
    _assert_all_close(got, forward_backward(per_document_reference, inputs, h0, **kwargs), **F64)
    via_cu_seqlens = forward_backward(as_cu_seqlens(chunk_gated_delta_rule_torch), inputs, h0,
                                      chunk_size=chunk_size, **kwargs)
    _assert_all_close(got, via_cu_seqlens, **F64)
    # The documents matter: the same rows without them differ.
    o_whole_rows, _ = chunk_gated_delta_rule_torch(*inputs, initial_state=h0)
    assert not torch.allclose(got[0], o_whole_rows)


def test_seq_idx_dispatcher_without_initial_state_and_float32():
    """Through chunk_gated_delta_rule, no initial state; and float32 (fp32 math) against the
    float64 recurrence."""
    torch.manual_seed(21)
    seq_idx = torch.tensor(PACKED_ROWS, dtype=torch.int32)
    inputs, _ = make_inputs(len(PACKED_ROWS), seq_idx.shape[1], 2, 16, 8)
    want = forward_backward(per_document_reference, inputs, None, seq_idx=seq_idx)
    o, final, grads = forward_backward(chunk_gated_delta_rule, inputs, None, seq_idx=seq_idx)
    torch.testing.assert_close(o, want[0], **F64)
    torch.testing.assert_close(final, want[1], **F64)
    for grad, grad_want in zip(grads, want[2]):
        torch.testing.assert_close(grad, grad_want, **F64)
    o, final, grads = forward_backward(chunk_gated_delta_rule, [x.float() for x in inputs], None,
                                       seq_idx=seq_idx)
    assert o.dtype == final.dtype == torch.float32
    assert rel_err(o, want[0]) < FP32_REL_TOL and rel_err(final, want[1]) < FP32_REL_TOL
    for grad, grad_want in zip(grads, want[2]):
        assert rel_err(grad, grad_want) < FP32_REL_TOL


def test_seq_idx_of_one_document_per_row_changes_nothing():
    """A row without a start inside is the unmasked computation: the same numbers, bit for bit
    (every mask keeps everything)."""
    torch.manual_seed(22)
    inputs, h0 = make_inputs(2, 150, 2, 16, 8, dtype=torch.float32)
    seq_idx = torch.tensor([[0] * 150, [3] * 150])
    got = forward_backward(chunk_gated_delta_rule_torch, inputs, h0, seq_idx=seq_idx)
    want = forward_backward(chunk_gated_delta_rule_torch, inputs, h0)
    for a, b in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]]):
        assert torch.equal(a, b)


def test_seq_idx_strong_decay_stays_finite():
    """Cumulative log-decays of ~-1000 across documents in a chunk: exp(G_i - G_j) between
    documents or above the diagonal would overflow; they are masked before exp."""
    torch.manual_seed(23)
    seq_idx = torch.tensor(PACKED_ROWS)
    inputs, h0 = make_inputs(len(PACKED_ROWS), seq_idx.shape[1], 2, 8, 8, g_scale=20.0)
    inputs[3][:, ::7] = 0.0
    for dtype in (torch.float32, torch.float64):
        o, final, grads = forward_backward(chunk_gated_delta_rule_torch,
                                           [x.to(dtype) for x in inputs], h0.to(dtype),
                                           seq_idx=seq_idx)
        assert all(t.isfinite().all() for t in (o, final, *grads))
    want = forward_backward(per_document_reference, inputs, h0, seq_idx=seq_idx)
    _assert_all_close((o, final, grads), want, **F64)


def test_seq_idx_compiles_whole_and_once():
    """No data-dependent shape or host sync: dynamo captures the seq_idx path in one graph
    (fullgraph), equal to eager bit for bit under aot_eager, and a different document layout
    of the same shape reuses that graph."""
    torch.manual_seed(24)
    inputs, h0 = make_inputs(len(PACKED_ROWS), 150, 2, 8, 8, dtype=torch.float32)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(chunk_gated_delta_rule_torch, backend="aot_eager", fullgraph=True)
    for layout in (PACKED_ROWS, PACKED_ROWS[::-1]):
        seq_idx = torch.tensor(layout)
        got = forward_backward(compiled, inputs, h0, seq_idx=seq_idx,
                               use_qk_l2norm_in_kernel=True)
        want = forward_backward(chunk_gated_delta_rule_torch, inputs, h0, seq_idx=seq_idx,
                                use_qk_l2norm_in_kernel=True)
        for a, b in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]]):
            assert torch.equal(a, b)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


def test_seq_idx_rejects_cu_seqlens_and_bad_shapes():
    torch.manual_seed(25)
    inputs, h0 = make_inputs(2, 20, 2, 8, 8)
    seq_idx = torch.zeros(2, 20, dtype=torch.long)
    for fn in (chunk_gated_delta_rule, chunk_gated_delta_rule_torch):
        with pytest.raises(ValueError, match="cu_seqlens and seq_idx both given"):
            fn(*[x[:1] for x in inputs], seq_idx=seq_idx[:1], cu_seqlens=torch.tensor([0, 20]))
        with pytest.raises(ValueError, match=r"seq_idx has shape \(2, 19\), expected \[B, T\]"):
            fn(*inputs, seq_idx=seq_idx[:, 1:])
        with pytest.raises(ValueError, match="initial_state has 1 states, expected 2"):
            fn(*inputs, seq_idx=seq_idx, initial_state=h0[:1])


def test_cpu_dispatch_uses_torch_path(monkeypatch):
    """A CPU call must not reach fla, even when fla is importable."""
    def fla_chunk(*args, **kwargs):
        raise AssertionError("fla called for CPU tensors")

    fake = types.ModuleType("fla.ops.gated_delta_rule")
    fake.chunk_gated_delta_rule = fla_chunk
    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", fake)
    torch.manual_seed(10)
    inputs, h0 = make_inputs(1, 30, 2, 8, 8)
    o, final = chunk_gated_delta_rule(*inputs, initial_state=h0, output_final_state=True)
    o_torch, final_torch = chunk_gated_delta_rule_torch(*inputs, initial_state=h0,
                                                        output_final_state=True)
    torch.testing.assert_close(o, o_torch, atol=0, rtol=0)
    torch.testing.assert_close(final, final_torch, atol=0, rtol=0)


# ---------------------------------------------------------------------------- GPU kernel parity

def _kernel_inputs(B, lens, dtype, *, l2norm, seed, key_heads=2):
    """q, k, v as views into one fused projection (non-contiguous, as the mixer passes them),
    g in float32 as the mixer computes it; packed documents when `lens` has several entries;
    `key_heads` < 2: query / key heads shared by the 2 value heads."""
    gen = torch.Generator().manual_seed(seed)
    T, H, K, V = sum(lens), 2, 16, 16
    fused = torch.randn(B, T, H, 2 * K + V, generator=gen)
    q, k, v = fused.to(DEVICE, dtype).split([K, K, V], -1)
    q, k = q[:, :, :key_heads], k[:, :, :key_heads]
    if l2norm:
        q, k = 3 * q, 2.5 * k  # far from unit norm: the kernel's l2norm matters
    else:
        k = F.normalize(k.float(), dim=-1).to(dtype)
    inputs = dict(q=q, k=k, v=v,
                  g=-F.softplus(torch.randn(B, T, H, generator=gen)).to(DEVICE),
                  beta=(torch.rand(B, T, H, generator=gen) * 0.9 + 0.05).to(DEVICE, dtype))
    kwargs = dict(use_qk_l2norm_in_kernel=l2norm)
    if len(lens) > 1:
        kwargs["cu_seqlens"] = torch.tensor([0, *lens], device=DEVICE).cumsum(0).to(torch.int32)
    return inputs, kwargs


def gdn_kernel_ops() -> tuple[str, ...]:
    """The custom ops that show GDN ran fla's kernels (inside kernels_on()): the backward's
    too, unless this runtime refuses it (a Hopper GPU with triton < 3.7.1, where the backward
    is the torch path's: test_fla_refused_backward.py)."""
    refused = kernel_op_refused("fla_gated_delta_bwd")
    return ("fla_gated_delta_fwd",) + (() if refused else ("fla_gated_delta_bwd",))


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, *LOW_PRECISION])
def test_fla_kernel_matches_torch_path_packed_documents(dtype):
    """cu_seqlens (document boundaries inside and at the end of 64-token chunks), one initial
    state per document, final states, l2norm of q and k in the kernel."""
    lens = [37, 91, 22]
    inputs, kwargs = _kernel_inputs(1, lens, dtype, l2norm=True, seed=11)
    inputs["initial_state"] = torch.randn(len(lens), 2, 16, 16, device=DEVICE)
    kwargs["output_final_state"] = True
    with kernels_on(), expect_custom_ops(*gdn_kernel_ops()):
        got = outputs_and_grads(chunk_gated_delta_rule, inputs, **kwargs)
    want = outputs_and_grads(chunk_gated_delta_rule_torch, inputs, **kwargs)
    assert got[0][1].dtype == torch.float32  # final states, as on the torch path
    assert_close_rel(got, want, KERNEL_TOL[dtype], f"fla {dtype}")


@pytest.mark.triton_interpreter
def test_fla_kernel_grouped_value_heads():
    """One query / key head read by two value heads: the kernel's GVA against the torch path's
    repeat (gradients of the shared head summed over its value heads)."""
    inputs, kwargs = _kernel_inputs(1, [37, 60], torch.float32, l2norm=True, seed=13,
                                    key_heads=1)
    with kernels_on(), expect_custom_ops(*gdn_kernel_ops()):
        got = outputs_and_grads(chunk_gated_delta_rule, inputs, **kwargs)
    want = outputs_and_grads(chunk_gated_delta_rule_torch, inputs, **kwargs)
    assert got[1]["q"].shape == inputs["q"].shape
    assert_close_rel(got, want, KERNEL_TOL[torch.float32], "fla grouped value heads")


@pytest.mark.triton_interpreter
def test_fla_kernel_under_torch_compile_fullgraph():
    """fla's entry point is torch.compiler.disable'd; through our custom ops dynamo and
    AOTAutograd trace the kernel path whole (fullgraph). Also the other case: a batch of 2
    without cu_seqlens, no initial or final state, keys pre-normalised."""
    inputs, kwargs = _kernel_inputs(2, [100], torch.float32, l2norm=False, seed=12)
    compiled = torch.compile(chunk_gated_delta_rule, backend="aot_eager", fullgraph=True)
    with kernels_on(), expect_custom_ops(*gdn_kernel_ops()):
        got = outputs_and_grads(compiled, inputs, **kwargs)
    assert len(got[0]) == 1  # the final state is None when not asked for
    assert type(got[0][0].grad_fn).__name__ == "CompiledFunctionBackward"
    want = outputs_and_grads(chunk_gated_delta_rule_torch, inputs, **kwargs)
    assert_close_rel(got, want, KERNEL_TOL[torch.float32], "compiled fla batch")


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, *LOW_PRECISION])
def test_fla_kernel_matches_torch_path_seq_idx(dtype):
    """seq_idx on the kernel path: the custom ops lay the rows end to end as fla's packed
    documents, give each row's initial state to its first document and take its final state from
    its last (PACKED_ROWS: starts inside and at chunk edges, one-token documents)."""
    inputs, kwargs = _kernel_inputs(len(PACKED_ROWS), [150], dtype, l2norm=True, seed=14)
    inputs["initial_state"] = torch.randn(len(PACKED_ROWS), 2, 16, 16, device=DEVICE)
    kwargs.update(seq_idx=torch.tensor(PACKED_ROWS, device=DEVICE), output_final_state=True)
    with kernels_on(), expect_custom_ops(*gdn_kernel_ops()):
        got = outputs_and_grads(chunk_gated_delta_rule, inputs, **kwargs)
    want = outputs_and_grads(chunk_gated_delta_rule_torch, inputs, **kwargs)
    assert got[0][1].shape == (len(PACKED_ROWS), 2, 16, 16)
    assert_close_rel(got, want, KERNEL_TOL[dtype], f"fla seq_idx {dtype}")


@pytest.mark.triton_interpreter
def test_fla_kernel_seq_idx_under_torch_compile_fullgraph():
    """The cu_seqlens derived from seq_idx have a data-dependent length; they live inside the
    custom ops, so dynamo still captures the kernel path whole (what GDN with packed documents
    needs under compile on CUDA)."""
    inputs, kwargs = _kernel_inputs(len(PACKED_ROWS), [150], torch.float32, l2norm=True,
                                    seed=15)
    kwargs.update(seq_idx=torch.tensor(PACKED_ROWS, device=DEVICE), output_final_state=True)
    compiled = torch.compile(chunk_gated_delta_rule, backend="aot_eager", fullgraph=True)
    with kernels_on(), expect_custom_ops(*gdn_kernel_ops()):
        got = outputs_and_grads(compiled, inputs, **kwargs)
    assert type(got[0][0].grad_fn).__name__ == "CompiledFunctionBackward"
    want = outputs_and_grads(chunk_gated_delta_rule_torch, inputs, **kwargs)
    assert_close_rel(got, want, KERNEL_TOL[torch.float32], "compiled fla seq_idx")

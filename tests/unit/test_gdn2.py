"""GDN2's core (ops/gdn2.py) against a float64 step-by-step reference written from the
recurrence (Megatron's GatedDeltaNet2, fla's naive GDN2):

    S_t = (I - k_t (b_t * k_t)^T) Diag(exp(g_t)) S_{t-1} + k_t (w_t * v_t)^T
    o_t = S_t^T (scale * q_t)

with L2-normed queries and keys, strong decays (a chunk's cumulative decay far past e^-88, which
the sub-chunks keep from overflowing), packed documents and an initial state: the output, the
final state and every input gradient. With b = w = beta it is KDA's op.
"""

from __future__ import annotations

import pytest
import torch

from titan_hybrid.ops.gdn2 import chunk_gdn2
from titan_hybrid.ops.kda import chunk_kda_torch

B, T, H, K, V = 2, 150, 2, 8, 6


def reference(q, k, v, g, b, w, initial_state, seq_idx):
    q, k = (x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6) for x in (q, k))  # fla's
    state, outputs = initial_state, []
    for t in range(T):
        if t:
            starts = (seq_idx[:, t] != seq_idx[:, t - 1]).to(state.dtype)
            state = state * (1 - starts)[:, None, None, None]  # a document starts
        state = torch.exp(g[:, t])[..., None] * state
        erased = torch.einsum("bhk,bhkv->bhv", b[:, t] * k[:, t], state)
        state = state + k[:, t, ..., None] * (w[:, t] * v[:, t] - erased)[..., None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t] * K ** -0.5))
    return torch.stack(outputs, 1), state


def inputs(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    q, k, v = rand(B, T, H, K), rand(B, T, H, K), rand(B, T, H, V)
    g = -2 * torch.rand(B, T, H, K, generator=generator, dtype=torch.float64)  # ~e^-64 a chunk
    b = 2 * torch.rand(B, T, H, K, generator=generator, dtype=torch.float64)
    w = torch.rand(B, T, H, V, generator=generator, dtype=torch.float64)
    seq_idx = torch.tensor([[0] * 70 + [1] * 80, [0] * 3 + [1] * 147])
    return (q, k, v, g, b, w, rand(B, H, K, V)), seq_idx


def test_forward_final_state_and_every_gradient_match_the_float64_recurrence():
    tensors, seq_idx = inputs()
    ours = [x.clone().requires_grad_() for x in tensors]
    theirs = [x.clone().requires_grad_() for x in tensors]
    o, final = chunk_gdn2(*ours[:6], initial_state=ours[6], output_final_state=True,
                          use_qk_l2norm_in_kernel=True, seq_idx=seq_idx)
    o_ref, final_ref = reference(*theirs[:6], theirs[6], seq_idx)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, final_ref, rtol=1e-10, atol=1e-10)
    weights = torch.randn_like(o_ref), torch.randn_like(final_ref)
    ((o * weights[0]).sum() + (final * weights[1]).sum()).backward()
    ((o_ref * weights[0]).sum() + (final_ref * weights[1]).sum()).backward()
    for name, mine, expected in zip("q k v g b w initial".split(), ours, theirs, strict=True):
        torch.testing.assert_close(mine.grad, expected.grad, rtol=1e-9, atol=1e-9, msg=name)


def test_equal_erase_and_write_gates_are_kda():
    (q, k, v, g, _, _, initial), seq_idx = inputs(seed=1)
    beta = torch.rand(B, T, H, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    gdn2 = chunk_gdn2(q, k, v, g, beta[..., None].expand(-1, -1, -1, K),
                      beta[..., None].expand(-1, -1, -1, V), initial_state=initial,
                      output_final_state=True, use_qk_l2norm_in_kernel=True, seq_idx=seq_idx)
    kda = chunk_kda_torch(q, k, v, g, beta, initial_state=initial, output_final_state=True,
                          use_qk_l2norm_in_kernel=True, seq_idx=seq_idx)
    torch.testing.assert_close(gdn2, kda, rtol=1e-12, atol=1e-12)


def test_gates_of_the_wrong_shape_are_named():
    (q, k, v, g, b, w, _), _ = inputs()
    with pytest.raises(ValueError, match=r"GDN2's decay and erase gate are per key channel"):
        chunk_gdn2(q, k, v, g, b[..., :1], w)
    with pytest.raises(ValueError, match=r"must both be \[B, T, H, V\]"):
        chunk_gdn2(q, k, v, g, b, w[..., :1])


def test_packed_documents_compile_with_fullgraph():
    tensors, seq_idx = inputs(seed=3)
    tensors = [x.float() for x in tensors[:6]]

    def run(q, k, v, g, b, w, seq_idx):
        return chunk_gdn2(q, k, v, g, b, w, use_qk_l2norm_in_kernel=True, seq_idx=seq_idx)[0]

    compiled = torch.compile(run, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(*tensors, seq_idx), run(*tensors, seq_idx))

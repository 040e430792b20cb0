"""Gated DeltaProduct's op (ops/gated_delta_product.py) against a float64 step-by-step
reference written from the recurrence (DeltaProduct's paper, Megatron's GDP mixer):

    H_0 = exp(g_t) S_{t-1};  H_j = (I - beta_tj k_tj k_tj^T) H_{j-1} + beta_tj k_tj v_tj^T;
    S_t = H_n;  o_t = S_t^T (scale * q_t)

with L2-normed queries and keys, key heads shared by value heads, packed documents (the state
restarts at each) and an initial state for each row's first document: the output, the final
state and every input gradient. With n = 1 the op is GDN's.
"""

from __future__ import annotations

import pytest
import torch

from titan_hybrid.ops.gated_delta import chunk_gated_delta_rule
from titan_hybrid.ops.gated_delta_product import chunk_gated_delta_product

B, T, HK, H, K, V = 2, 21, 1, 2, 8, 6


def reference(q, k, v, g, beta, n, initial_state, seq_idx):
    """The recurrence, token by token and step by step, in float64."""
    q, k = (x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6) for x in (q, k))  # fla's
    outputs = torch.zeros(B, T, H, V, dtype=torch.float64)
    finals = []
    for b in range(B):
        heads = []
        for h in range(H):
            kh = h // (H // HK)
            state = initial_state[b, h]
            for t in range(T):
                if t and seq_idx[b, t] != seq_idx[b, t - 1]:
                    state = torch.zeros_like(state)  # a document starts: no state enters
                state = torch.exp(g[b, t, h]) * state
                for j in range(n):
                    key, value, gate = k[b, t * n + j, kh], v[b, t * n + j, h], beta[b, t * n + j, h]
                    state = state - gate * torch.outer(key, key @ state) + gate * torch.outer(
                        key, value)
                outputs[b, t, h] = state.T @ (q[b, t, kh] * K ** -0.5)
            heads.append(state)
        finals.append(torch.stack(heads))
    return outputs, torch.stack(finals)


def inputs(n: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    q, k, v = rand(B, T, HK, K), rand(B, T * n, HK, K), rand(B, T * n, H, V)
    g = -torch.rand(B, T, H, generator=generator, dtype=torch.float64)
    beta = torch.rand(B, T * n, H, generator=generator, dtype=torch.float64) * 2  # [0, 2]
    initial = rand(B, H, K, V)
    seq_idx = torch.tensor([[0] * 7 + [1] * 9 + [2] * 5, [3] * 21])  # documents; one whole row
    return (q, k, v, g, beta, initial), seq_idx


@pytest.mark.parametrize("n", [1, 2, 3])
def test_forward_final_state_and_every_gradient_match_the_float64_recurrence(n):
    tensors, seq_idx = inputs(n)
    ours = [x.clone().requires_grad_() for x in tensors]
    theirs = [x.clone().requires_grad_() for x in tensors]
    o, final = chunk_gated_delta_product(*ours[:5], n, initial_state=ours[5],
                                         output_final_state=True,
                                         use_qk_l2norm_in_kernel=True, seq_idx=seq_idx)
    o_ref, final_ref = reference(*theirs[:5], n, theirs[5], seq_idx)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, final_ref, rtol=1e-10, atol=1e-10)
    weights = torch.randn_like(o_ref), torch.randn_like(final_ref)
    ((o * weights[0]).sum() + (final * weights[1]).sum()).backward()
    ((o_ref * weights[0]).sum() + (final_ref * weights[1]).sum()).backward()
    for name, mine, expected in zip("q k v g beta initial".split(), ours, theirs, strict=True):
        torch.testing.assert_close(mine.grad, expected.grad, rtol=1e-9, atol=1e-9, msg=name)


def test_one_householder_step_is_gated_deltanet():
    (q, k, v, g, beta, initial), seq_idx = inputs(1, seed=3)
    product = chunk_gated_delta_product(q, k, v, g, beta, 1, initial_state=initial,
                                        output_final_state=True, use_qk_l2norm_in_kernel=True,
                                        seq_idx=seq_idx)
    gdn = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial, output_final_state=True,
                                 use_qk_l2norm_in_kernel=True, seq_idx=seq_idx)
    assert torch.equal(product[0], gdn[0]) and torch.equal(product[1], gdn[1])


def test_a_step_count_that_does_not_match_the_rows_is_named():
    (q, k, v, g, beta, _), _ = inputs(2)
    with pytest.raises(ValueError, match=r"k, v and beta need 3 rows a token: T\*n = 63 rows, "
                                         r"got 42, 42 and 42"):
        chunk_gated_delta_product(q, k, v, g, beta, 3)


def test_packed_documents_compile_with_fullgraph():
    (q, k, v, g, beta, _), seq_idx = inputs(2, seed=5)
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))

    def run(q, k, v, g, beta, seq_idx):
        return chunk_gated_delta_product(q, k, v, g, beta, 2, use_qk_l2norm_in_kernel=True,
                                         seq_idx=seq_idx)[0]

    compiled = torch.compile(run, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v, g, beta, seq_idx), run(q, k, v, g, beta, seq_idx))


@pytest.mark.triton_interpreter
def test_fla_kernels_on_the_interleaved_steps_match_the_torch_path():
    """On CUDA (here Triton's interpreter) the op runs fla's gated-delta-rule kernels, forward
    and backward, on the interleaved rows through their custom ops: packed documents, an
    initial state, final states, in-kernel L2 norms, two steps a token."""
    from tests.triton_kernels import (
        DEVICE,
        assert_close_rel,
        expect_custom_ops,
        kernels_on,
        outputs_and_grads,
    )
    from tests.unit.test_gated_delta import KERNEL_TOL, gdn_kernel_ops

    (q, k, v, g, beta, initial), seq_idx = inputs(2, seed=7)
    tensors = {name: value.float().to(DEVICE) for name, value in
               dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial).items()}
    kwargs = dict(num_householder=2, output_final_state=True, use_qk_l2norm_in_kernel=True,
                  seq_idx=seq_idx.to(DEVICE))
    with kernels_on(), expect_custom_ops(*gdn_kernel_ops()):
        got = outputs_and_grads(chunk_gated_delta_product, tensors, **kwargs)
    want = outputs_and_grads(chunk_gated_delta_product, tensors, **kwargs)
    assert_close_rel(got, want, KERNEL_TOL[torch.float32], "fla on GDP's steps")

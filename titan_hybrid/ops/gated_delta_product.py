"""Gated DeltaProduct (Siems et al., 2025; Megatron-LM's GatedDeltaProductMixer): n_h
generalized Householder steps per token after one decay, with flash-linear-attention's API.

Per head, with state S [K, V], log-decay g_t <= 0 and n = num_householder keys, values and
gates per token:

    H_0 = exp(g_t) S_{t-1}
    H_j = (I - beta_tj k_tj k_tj^T) H_{j-1} + beta_tj k_tj v_tj^T        j = 1 .. n
    S_t = H_n,  o_t = S_t^T (scale * q_t)

Each step is one step of the gated delta rule (ops/gated_delta.py) with no decay, so the whole
is the gated delta rule over a sequence n times longer: token t's sub-steps at rows
t*n .. t*n + n - 1, the decay on the first of them, the query read at the last (fla's
chunk_gated_delta_product and FlashInfer's do the same). With n = 1 it is GDN's op. The state
keeps its size; n multiplies the FLOPs. The op inherits chunk_gated_delta_rule's paths: fla's
Triton kernel on CUDA (through its custom op, probed once with a torch fallback), the chunked
torch path elsewhere, packed documents by `seq_idx`.

Layouts (fla's): q [B, T, Hk, K]; k [B, T*n, Hk, K]; v [B, T*n, H, V]; beta [B, T*n, H];
g [B, T, H]; row t*n + j of k, v, beta is token t's step j + 1.
"""

from __future__ import annotations

import torch

from titan_hybrid.ops.gated_delta import chunk_gated_delta_rule


def interleave_steps(per_token_BT: torch.Tensor, num_householder: int, at: int) -> torch.Tensor:
    """[B, T, ...] -> [B, T*n, ...]: each token's value at its sub-step `at` (0 .. n-1), zeros
    at the others."""
    if num_householder == 1:
        return per_token_BT
    shape = per_token_BT.shape
    steps = per_token_BT.new_zeros(shape[0], shape[1], num_householder, *shape[2:])
    steps[:, :, at] = per_token_BT
    return steps.flatten(1, 2)


def chunk_gated_delta_product(q, k, v, g, beta, num_householder: int, scale=None,
                              initial_state=None, output_final_state=False,
                              use_qk_l2norm_in_kernel=False, *, seq_idx=None):
    """(o [B, T, H, V], final state [B, H, K, V] or None). `seq_idx` [B, T]: packed documents
    (ops/gated_delta.py's form), each token's sub-steps in its document."""
    n = num_householder
    if k.shape[1] != q.shape[1] * n or v.shape[1] != k.shape[1] or beta.shape[1] != k.shape[1]:
        raise ValueError(f"k, v and beta need {n} rows a token: T*n = {q.shape[1] * n} rows, got "
                         f"{k.shape[1]}, {v.shape[1]} and {beta.shape[1]}")
    # The inner steps' zero queries stay zero under the L2 norm, and their outputs are dropped.
    o, final = chunk_gated_delta_rule(
        interleave_steps(q, n, n - 1), k, v, interleave_steps(g, n, 0), beta,
        scale=q.shape[-1] ** -0.5 if scale is None else scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        seq_idx=None if seq_idx is None else seq_idx.repeat_interleave(n, dim=1))
    return o.unflatten(1, (-1, n))[:, :, -1], final

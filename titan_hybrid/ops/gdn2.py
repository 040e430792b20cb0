"""Gated DeltaNet-2's core (GDN2: Megatron-LM's GatedDeltaNet2, #5765; fla's `chunk_gdn2`):
the gated delta rule with a decay, an erase gate and a write gate per channel.

Per head, with state S [K, V], log-decay g_t [K] <= 0, erase gate b_t [K] and write gate
w_t [V] (sigmoids in the mixer):

    S_t = (I - k_t (b_t * k_t)^T) Diag(exp(g_t)) S_{t-1} + k_t (w_t * v_t)^T
    o_t = S_t^T (scale * q_t)

b = w = beta is KDA (ops/kda.py), whose chunked torch path this runs with the gates in place
of beta (`chunk_erase_write_torch`: the same sub-chunked WY system, so no decay overflows), and
packed documents by `seq_idx`. fla's `chunk_gdn2` kernel is not wired yet: CUDA runs this path
too.
"""

from __future__ import annotations

import torch

from titan_hybrid.ops.kda import chunk_erase_write_torch


def chunk_gdn2(q, k, v, g, b, w, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, *, seq_idx=None):
    """q, k, g, b [B, T, H, K], v, w [B, T, H, V]. Returns (o [B, T, H, V] in v's dtype,
    final state [B, H, K, V] or None)."""
    B, T, H, K = q.shape
    if k.shape != q.shape or g.shape != q.shape or b.shape != q.shape:
        raise ValueError(f"k {tuple(k.shape)}, g {tuple(g.shape)} and b {tuple(b.shape)} must "
                         f"have q's shape {tuple(q.shape)}: GDN2's decay and erase gate are per "
                         "key channel")
    if w.shape != v.shape or tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"v {tuple(v.shape)} and w {tuple(w.shape)} must both be [B, T, H, V] "
                         f"with [B, T, H] = {[B, T, H]}")
    if initial_state is not None and tuple(initial_state.shape) != (B, H, K, v.shape[-1]):
        raise ValueError(f"initial_state has shape {tuple(initial_state.shape)}, expected "
                         f"{[B, H, K, v.shape[-1]]}")
    # Autocast would run the matmuls and the triangular solve in bf16.
    with torch.autocast(q.device.type, enabled=False):
        return chunk_erase_write_torch(q, k, v, g, b, w, scale, initial_state,
                                       output_final_state, seq_idx, use_qk_l2norm_in_kernel)

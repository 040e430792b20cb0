"""Gated DeltaNet-2's core (GDN2: Megatron-LM's GatedDeltaNet2, #5765; fla's `chunk_gdn2`):
the gated delta rule with a decay, an erase gate and a write gate per channel.

Per head, with state S [K, V], log-decay g_t [K] <= 0, erase gate b_t [K] and write gate
w_t [V] (sigmoids in the mixer):

    S_t = (I - k_t (b_t * k_t)^T) Diag(exp(g_t)) S_{t-1} + k_t (w_t * v_t)^T
    o_t = S_t^T (scale * q_t)

b = w = beta is KDA (ops/kda.py), whose chunked torch path this runs with the gates in place
of beta (`chunk_erase_write_torch`: the same sub-chunked WY system, so no decay overflows), and
packed documents by `seq_idx`. On CUDA, fla's chunk_gdn2 kernels through custom ops (below),
when `titan_hybrid.ops.kernels.use_kernel` says so, as KDA's.
"""

from __future__ import annotations

import torch

from titan_hybrid.compat import kernel_packages
from titan_hybrid.ops.custom_ops import kernel_op
from titan_hybrid.ops.delta_rule_documents import (
    FLA_CHUNK_SIZE,
    KernelRows,
    erase_write_fwd_fake_outputs,
    erase_write_fwd_outputs,
    l2norm_in_kernel,
    l2norm_in_kernel_bwd,
)
from titan_hybrid.ops.kda import chunk_erase_write_torch
from titan_hybrid.ops.kernels import use_kernel


def _check(q, k, v, g, b, w, initial_state) -> None:
    """Shapes only (no device sync)."""
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


def chunk_gdn2(q, k, v, g, b, w, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, *, seq_idx=None):
    """q, k, g, b [B, T, H, K], v, w [B, T, H, V]. Returns (o [B, T, H, V] in v's dtype,
    final state [B, H, K, V] or None). fla's Triton kernels when `use_kernel` says so, else
    `chunk_gdn2_torch`."""
    _check(q, k, v, g, b, w, initial_state)
    if use_kernel(v, "fla"):
        # fla's dots need one dtype for q, k and v; its states and decays are float32
        q, k = q.to(v.dtype).contiguous(), k.to(v.dtype).contiguous()
        o, final_state, *_ = _gdn2_fwd(
            q, k, v.contiguous(), g.float().contiguous(), b.contiguous(), w.contiguous(),
            q.shape[-1] ** -0.5 if scale is None else float(scale),
            None if initial_state is None else initial_state.float().contiguous(),
            output_final_state, None if seq_idx is None else seq_idx.contiguous(),
            use_qk_l2norm_in_kernel)
        return o, (final_state if output_final_state else None)
    return chunk_gdn2_torch(q, k, v, g, b, w, scale, initial_state, output_final_state,
                            use_qk_l2norm_in_kernel, seq_idx=seq_idx)


def chunk_gdn2_torch(q, k, v, g, b, w, scale=None, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, *, seq_idx=None):
    """The chunked torch path of `chunk_gdn2`: math in fp32 (fp64 for fp64 inputs)."""
    _check(q, k, v, g, b, w, initial_state)
    # Autocast would run the matmuls and the triangular solve in bf16.
    with torch.autocast(q.device.type, enabled=False):
        return chunk_erase_write_torch(q, k, v, g, b, w, scale, initial_state,
                                       output_final_state, seq_idx, use_qk_l2norm_in_kernel)


# ---- fla's GDN2 kernels as torch.library custom ops, as ops/kda.py wraps KDA's: the forward and
# backward are fla's chunk_gdn2_fwd / chunk_gdn2_bwd with l2norm_fwd / _bwd (internals, checked
# on fla 0.6.0: titan_hybrid.compat.kernel_packages), called as its ChunkGDN2Function calls
# them with the gates computed outside; the forward's residuals (l2-normalised q and k with
# their reciprocal norms, the chunk-local cumulative decay in base 2, Aqk and Akk) are extra
# outputs. With seq_idx the rows are laid end to end as documents inside (KernelRows).

@kernel_op("fla_gdn2_fwd", saved_by_selective_ac=True)
def _gdn2_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              b: torch.Tensor, w: torch.Tensor, scale: float,
              initial_state: torch.Tensor | None, output_final_state: bool,
              seq_idx: torch.Tensor | None, use_qk_l2norm: bool) -> list[torch.Tensor]:
    def empty():  # a custom op's outputs may not alias each other
        return q.new_empty(0)

    rows = KernelRows(q.shape[:2], seq_idx)
    q, k, v, g, b, w = rows.to_kernel(q, k, v, g, b, w)
    q, k, residuals = l2norm_in_kernel(q, k, use_qk_l2norm, empty)
    o, final_state, g_cum, Aqk, Akk, *_ = kernel_packages.gdn2_fwd(
        q=q, k=k, v=v, g=g, b=b, w_gate=w, scale=scale,
        initial_state=rows.initial_states(initial_state), output_final_state=output_final_state,
        cu_seqlens=rows.cu_seqlens, chunk_indices=rows.chunk_indices(),
        chunk_size=FLA_CHUNK_SIZE)
    return erase_write_fwd_outputs(rows, v.dtype, o, final_state, residuals, g_cum, Aqk, Akk,
                                   use_qk_l2norm, empty)


@_gdn2_fwd.register_fake
def _(q, k, v, g, b, w, scale, initial_state, output_final_state, seq_idx, use_qk_l2norm):
    return erase_write_fwd_fake_outputs(q, k, v, g, output_final_state, use_qk_l2norm)


@kernel_op("fla_gdn2_bwd")
def _gdn2_bwd(do: torch.Tensor, dfinal_state: torch.Tensor | None, q: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor, b: torch.Tensor, w: torch.Tensor,
              g: torch.Tensor, initial_state: torch.Tensor | None, q_normed: torch.Tensor,
              k_normed: torch.Tensor, q_rstd: torch.Tensor, k_rstd: torch.Tensor,
              g_cum: torch.Tensor, Aqk: torch.Tensor, Akk: torch.Tensor, scale: float,
              seq_idx: torch.Tensor | None, use_qk_l2norm: bool) -> list[torch.Tensor]:
    rows = KernelRows(q.shape[:2], seq_idx)
    q_used, k_used, v_used, b_used, w_used, g_cum, Aqk, Akk, do, q_rstd, k_rstd = rows.to_kernel(
        *((q_normed, k_normed) if use_qk_l2norm else (q, k)), v, b, w, g_cum, Aqk, Akk, do,
        *((q_rstd, k_rstd) if use_qk_l2norm else (None, None)))
    dq, dk, dv, db, dw, dg, dh0, *_ = kernel_packages.gdn2_bwd(
        q=q_used, k=k_used, v=v_used, b=b_used, w_gate=w_used, Aqk=Aqk, Akk=Akk, scale=scale,
        initial_state=rows.initial_states(initial_state), do=do.contiguous(),
        dht=rows.final_state_grads(dfinal_state), g=g_cum, cu_seqlens=rows.cu_seqlens,
        chunk_indices=rows.chunk_indices(), chunk_size=FLA_CHUNK_SIZE)
    if use_qk_l2norm:
        dq, dk = l2norm_in_kernel_bwd(dq, dk, q_used, k_used, q_rstd, k_rstd)
    dq, dk, dv, dg, db, dw = rows.from_kernel(dq, dk, dv, dg, db, dw)
    dh0 = rows.initial_state_grads(dh0)
    grads = [dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), db.to(b.dtype),
             dw.to(w.dtype)]
    return grads + [q.new_empty(0) if dh0 is None else dh0.to(initial_state.dtype)]


@_gdn2_bwd.register_fake
def _(do, dfinal_state, q, k, v, b, w, g, initial_state, *_):
    dh0 = q.new_empty(0) if initial_state is None else torch.empty_like(initial_state)
    return [torch.empty_like(t) for t in (q, k, v, g, b, w)] + [dh0]


def _gdn2_setup_context(ctx, inputs, output):
    (q, k, v, g, b, w, ctx.scale, initial_state, ctx.output_final_state, seq_idx,
     ctx.use_qk_l2norm) = inputs
    _, _, q_normed, k_normed, q_rstd, k_rstd, g_cum, Aqk, Akk = output
    ctx.save_for_backward(q, k, v, b, w, g, initial_state, seq_idx, q_normed, k_normed, q_rstd,
                          k_rstd, g_cum, Aqk, Akk)


def _gdn2_backward(ctx, output_grads):
    do, dfinal_state = output_grads[:2]  # the residual outputs' gradients are unused
    if not ctx.output_final_state:  # autograd passes zeros of the empty placeholder's shape
        dfinal_state = None
    (q, k, v, b, w, g, initial_state, seq_idx, q_normed, k_normed, q_rstd, k_rstd, g_cum, Aqk,
     Akk) = ctx.saved_tensors
    dq, dk, dv, dg, db, dw, dh0 = _gdn2_bwd(
        do, dfinal_state, q, k, v, b, w, g, initial_state, q_normed, k_normed, q_rstd, k_rstd,
        g_cum, Aqk, Akk, ctx.scale, seq_idx, ctx.use_qk_l2norm)
    return (dq, dk, dv, dg, db, dw, None, None if initial_state is None else dh0, None, None,
            None)


_gdn2_fwd.register_autograd(_gdn2_backward, setup_context=_gdn2_setup_context)

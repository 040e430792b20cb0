"""Kimi Delta Attention's core (KDA, Kimi Linear): the gated delta rule with a forget gate per
key channel, in pure PyTorch, with flash-linear-attention's `chunk_kda` API.

Legend as ops/gated_delta.py: B batch, T time, H heads, K key/query dim, V value dim, J chunks,
Q positions in a chunk, N sub-chunks of a chunk, S positions in a sub-chunk; b is B*H.

Per head, with state S [K, V], log-decay g_t [K] <= 0 (one per key channel) and beta_t:

    S   = Diag(exp(g_t)) S
    v'  = beta_t * (v_t - S^T k_t)
    S   = S + outer(k_t, v')
    o_t = S^T (scale * q_t)

that is S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T. Packed
documents come as `seq_idx` [B, T] (ops/gated_delta.py's convention: the state restarts where
the id changes; `initial_state` [B] feeds each row's first document and the final state is
each row's state at its end).

The torch path works on chunks of Q tokens as ops/gated_delta.py does, G being the inclusive
cumulative log-decay within the chunk, now a vector per token. The same WY system gives the
corrected values U, with the decays inside the channel sums:

    A_ij = beta_i sum_c k_ic k_jc exp(G_ic - G_jc)   (j < i)
    P_ij = sum_c q_ic k_jc exp(G_ic - G_jc)          (j <= i)
    (I + A) U = beta*V - (beta * K * exp(G)) S0,     O = (Q * exp(G)) S0 + P U
    S_exit = exp(G_end) * S0 + (K * exp(G_end - G))^T U

A pair's decay exp(G_i - G_j) <= 1, but split into a factor per token it is not: exp(-G_j)
overflows once a chunk's decay passes e^88. So each chunk is cut into sub-chunks of S tokens.
A pair in two sub-chunks (i's after j's) splits at the end r of j's sub-chunk:
exp(G_i - G_r) exp(G_r - G_j), both factors <= 1, and the channel sum is a matmul. A pair in
one sub-chunk takes its decays whole ([S, S, K] per sub-chunk). Every exp is of a number <= 0,
or masked to -inf before it, so nothing overflows, in forward or backward.
"""

from __future__ import annotations

import math

import torch

from titan_hybrid.compat import kernel_packages
from titan_hybrid.ops.custom_ops import kernel_op
from titan_hybrid.ops.delta_rule_documents import (
    FLA_CHUNK_SIZE,
    KernelRows,
    document_masks,
    erase_write_fwd_fake_outputs,
    erase_write_fwd_outputs,
    exp_where,
    l2norm,
    l2norm_in_kernel,
    l2norm_in_kernel_bwd,
)
from titan_hybrid.ops.kernels import use_kernel

CHUNK_SIZE = FLA_CHUNK_SIZE
SUB_CHUNK_SIZE = 8  # fastest of 4, 8, 16, 32 on CPU (fwd + bwd, T = 2048, H = 8, K = 128)


def _check(q, k, v, g, beta, initial_state, seq_idx) -> None:
    """Shapes only (no device sync)."""
    B, T, H, K = q.shape
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"k {tuple(k.shape)} and g {tuple(g.shape)} must have q's shape "
                         f"{tuple(q.shape)}: KDA's decay is per key channel")
    if tuple(v.shape[:3]) != (B, T, H) or tuple(beta.shape) != (B, T, H):
        raise ValueError(f"v {tuple(v.shape)} and beta {tuple(beta.shape)} must be [B, T, H, "
                         f"...] = {[B, T, H]}")
    if seq_idx is not None and tuple(seq_idx.shape) != (B, T):
        raise ValueError(f"seq_idx has shape {tuple(seq_idx.shape)}, expected [B, T] = {[B, T]}")
    if initial_state is not None and tuple(initial_state.shape) != (B, H, K, v.shape[-1]):
        raise ValueError(f"initial_state has shape {tuple(initial_state.shape)}, expected "
                         f"{[B, H, K, v.shape[-1]]}")


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, *, seq_idx=None):
    """q, k, g [B,T,H,K], v [B,T,H,V], beta [B,T,H]; g is the log-decay (<= 0) per key
    channel. Returns (o [B,T,H,V] in v's dtype, final_state [B,H,K,V] or None). fla's Triton
    kernels when `titan_hybrid.ops.kernels.use_kernel` says so (CUDA tensors with fla
    installed and probed, or inside `force_kernels()`), else `chunk_kda_torch`."""
    _check(q, k, v, g, beta, initial_state, seq_idx)
    if use_kernel(v, "fla"):
        # fla's dots need one dtype for q, k and v; its states and decays are float32
        q, k = q.to(v.dtype).contiguous(), k.to(v.dtype).contiguous()
        o, final_state, *_ = _kda_fwd(
            q, k, v.contiguous(), g.float().contiguous(), beta.contiguous(),
            q.shape[-1] ** -0.5 if scale is None else float(scale),
            None if initial_state is None else initial_state.float().contiguous(),
            output_final_state, None if seq_idx is None else seq_idx.contiguous(),
            use_qk_l2norm_in_kernel)
        return o, (final_state if output_final_state else None)
    return chunk_kda_torch(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                           output_final_state=output_final_state,
                           use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, seq_idx=seq_idx)


def chunk_kda_torch(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=False, *, seq_idx=None, chunk_size=CHUNK_SIZE,
                    sub_chunk_size=SUB_CHUNK_SIZE):
    """Chunked torch path of `chunk_kda`. Math in fp32 (fp64 for fp64 inputs); final_state in
    that dtype. Nothing depends on the values of the data (static shapes, no host sync)."""
    _check(q, k, v, g, beta, initial_state, seq_idx)
    if chunk_size % sub_chunk_size:
        raise ValueError(f"chunk_size {chunk_size} is not a multiple of sub_chunk_size "
                         f"{sub_chunk_size}")
    # Autocast would run the matmuls and the triangular solve below in bf16.
    with torch.autocast(q.device.type, enabled=False):
        return chunk_erase_write_torch(q, k, v, g, beta[..., None], beta[..., None], scale,
                                       initial_state, output_final_state, seq_idx,
                                       use_qk_l2norm_in_kernel, chunk_size, sub_chunk_size)


def _decayed_products(x_JBHQK, k_JBHQK, G_JBHQK, sub_chunk_size):
    """[J, B, H, Q, Q]: entry (i, j) = sum_c x_ic k_jc exp(G_ic - G_jc) for j <= i, 0 above
    the diagonal (module docstring: split at sub-chunk ends, whole within a sub-chunk)."""
    Q, S = x_JBHQK.shape[-2], sub_chunk_size
    N = Q // S
    # Pairs in one sub-chunk: [..., N, S, S, K] decays, -inf above the diagonal before exp.
    x_NSK, k_NSK, G_NSK = (t.unflatten(-2, (N, S)) for t in (x_JBHQK, k_JBHQK, G_JBHQK))
    causal_SS = torch.ones(S, S, dtype=torch.bool, device=x_JBHQK.device).tril()
    decay_NSSK = exp_where(G_NSK[..., :, None, :] - G_NSK[..., None, :, :],
                           causal_SS[..., None])
    within_NSS = torch.einsum("...ik,...jk,...ijk->...ij", x_NSK, k_NSK, decay_NSSK)
    out = _block_diagonal(within_NSS)
    if N == 1:
        return out
    # Pairs in two sub-chunks: split at the end r of j's sub-chunk n.
    G_end_NK = G_NSK[..., -1, :]  # [..., N, K]
    row_sub_Q = torch.arange(Q, device=x_JBHQK.device) // S
    after_NQ = row_sub_Q[None, :] > torch.arange(N, device=x_JBHQK.device)[:, None]
    left_NQK = x_JBHQK[..., None, :, :] * exp_where(
        G_JBHQK[..., None, :, :] - G_end_NK[..., :, None, :], after_NQ[..., None])
    right_NSK = k_NSK * (G_end_NK[..., :, None, :] - G_NSK).exp()
    across_NQS = left_NQK @ right_NSK.transpose(-1, -2)  # column block n of the [Q, Q]
    return out + across_NQS.movedim(-3, -2).flatten(-2)


def _block_diagonal(blocks_NSS):
    """[..., N*S, N*S] with the N [S, S] blocks on its diagonal, zeros elsewhere."""
    N, S = blocks_NSS.shape[-3], blocks_NSS.shape[-1]
    rows = [torch.nn.functional.pad(blocks_NSS[..., n, :, :], (n * S, (N - n - 1) * S))
            for n in range(N)]
    return torch.cat(rows, -2)


def chunk_erase_write_torch(q, k, v, g, erase, write, scale, initial_state, output_final_state,
                            seq_idx, use_qk_l2norm_in_kernel, chunk_size=CHUNK_SIZE,
                            sub_chunk_size=SUB_CHUNK_SIZE):
    """The chunked path of the delta rule whose erase and write gates act per channel
    (GDN2's): S_t = (I - k_t (erase_t * k_t)^T) Diag(exp(g_t)) S_{t-1} + k_t (write_t * v_t)^T,
    erase [B, T, H, K] (or [..., 1]), write [B, T, H, V] (or [..., 1]); KDA is
    erase = write = beta. In the WY system above, beta * k_i becomes erase_i * k_i (A's rows
    and the entering state's correction) and beta * V becomes write * V."""
    B, T, H, K = q.shape
    V, Q = v.shape[-1], chunk_size
    scale = K ** -0.5 if scale is None else scale
    dtype, out_dtype = torch.promote_types(q.dtype, torch.float32), v.dtype
    q, k, v, g, erase, write = (x.to(dtype) for x in (q, k, v, g, erase, write))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * scale

    # Padded to whole chunks with zero tokens (g = 0, k = 0, gates 0: the state unchanged).
    n_chunks = math.ceil(T / Q)

    def to_chunks(x_BTHD):  # -> [J, B, H, Q, D]
        x_BTHD = torch.nn.functional.pad(x_BTHD, (0, 0, 0, 0, 0, n_chunks * Q - T))
        return x_BTHD.unflatten(1, (n_chunks, Q)).movedim((1, 2), (0, 3)).contiguous()

    q_JBHQK, k_JBHQK, v_JBHQV, g_JBHQK = (to_chunks(x) for x in (q, k, v, g))
    erased_JBHQK = k_JBHQK * to_chunks(erase)  # erase * k: the key the state is read by
    written_JBHQV = v_JBHQV * to_chunks(write)
    G_JBHQK = g_JBHQK.cumsum(-2)

    if seq_idx is None:
        same_doc = from_entering = in_last = carries = None  # every term survives
    else:
        same_doc, from_entering, in_last, carries = document_masks(seq_idx, n_chunks, Q)
        from_entering, in_last = from_entering[..., None], in_last[..., None]
    A_JBHQQ = _decayed_products(erased_JBHQK, k_JBHQK, G_JBHQK, sub_chunk_size)
    P_JBHQQ = _decayed_products(q_JBHQK, k_JBHQK, G_JBHQK, sub_chunk_size)
    if same_doc is not None:
        A_JBHQQ, P_JBHQQ = A_JBHQQ * same_doc, P_JBHQQ * same_doc
    eye_QQ = torch.eye(Q, dtype=dtype, device=q.device)
    T_JBHQQ = torch.linalg.solve_triangular(A_JBHQQ, eye_QQ.expand_as(A_JBHQQ), upper=False,
                                            unitriangular=True)
    decay_in_JBHQK = _masked(G_JBHQK.exp(), from_entering)  # from the chunk's start
    W_JBHQV = T_JBHQQ @ written_JBHQV
    KC_JBHQK = T_JBHQQ @ (erased_JBHQK * decay_in_JBHQK)
    q_dec_JBHQK = q_JBHQK * _masked(G_JBHQK.exp(), from_entering)
    decay_out_JBHQK = _masked((G_JBHQK[..., -1:, :] - G_JBHQK).exp(), in_last)  # to the exit
    k_dec_JBHKQ = (k_JBHQK * decay_out_JBHQK).transpose(-1, -2)
    gamma_JBHK1 = _masked(G_JBHQK[..., -1, :, None].exp(), carries)

    S_bKV = (q.new_zeros(B * H, K, V) if initial_state is None
             else initial_state.to(dtype).flatten(0, 1))
    per_chunk = [x.flatten(1, 2).unbind(0) for x in (W_JBHQV, KC_JBHQK, P_JBHQQ, q_dec_JBHQK,
                                                     k_dec_JBHKQ, gamma_JBHK1)]
    o_chunks = []
    for W_bQV, KC_bQK, P_bQQ, q_dec_bQK, k_dec_bKQ, gamma_bK1 in zip(*per_chunk):
        v_new_bQV = torch.baddbmm(W_bQV, KC_bQK, S_bKV, alpha=-1)
        o_bQV = torch.baddbmm(P_bQQ @ v_new_bQV, q_dec_bQK, S_bKV)
        o_chunks.append(o_bQV.unflatten(0, (B, H)).transpose(1, 2))
        S_bKV = torch.baddbmm(S_bKV * gamma_bK1, k_dec_bKQ, v_new_bQV)
    o_BTHV = torch.stack(o_chunks, 1).flatten(1, 2)[:, :T]
    final = S_bKV.view(B, H, K, V) if output_final_state else None
    return o_BTHV.to(out_dtype), final


def _masked(decay: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """decay where `keep` (a decay <= 1: a product with the mask cannot be inf * 0)."""
    return decay if keep is None else decay * keep


def recurrent_kda_reference(q, k, v, g, beta, scale=None, initial_state=None,
                            output_final_state=False, use_qk_l2norm_in_kernel=False, *,
                            seq_idx=None):
    """Step-by-step recurrence (test oracle) in the inputs' dtype. Same API as `chunk_kda`."""
    _check(q, k, v, g, beta, initial_state, seq_idx)
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    S_BHKV = (q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None
              else initial_state.to(q.dtype))
    outs = []
    for t in range(T):
        if seq_idx is not None and t > 0:  # a document starts: the state restarts
            starts_B = seq_idx[:, t] != seq_idx[:, t - 1]
            S_BHKV = S_BHKV * (~starts_B).to(S_BHKV.dtype)[:, None, None, None]
        S_BHKV = S_BHKV * g[:, t].exp()[..., None]
        k_BHK = k[:, t]
        v_new_BHV = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S_BHKV, k_BHK))
        S_BHKV = S_BHKV + k_BHK[..., :, None] * v_new_BHV[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S_BHKV, q[:, t] * scale))
    o = torch.stack(outs, 1) if outs else v.new_zeros(v.shape)
    return o.to(v.dtype), (S_BHKV if output_final_state else None)


# ---- fla's KDA kernels as torch.library custom ops (opaque to torch.compile), as
# gated_delta.py wraps fla's gated delta rule: the forward and backward are fla's chunk_kda_fwd
# / chunk_kda_bwd with l2norm_fwd / _bwd (internals, checked on fla 0.6.0:
# titan_hybrid.compat.kernel_packages), called as its ChunkKDAFunction calls them with the gate
# and beta computed outside; its residuals (l2-normalised q and k with their reciprocal norms,
# the chunk-local cumulative decay in base 2, the intra-chunk matrices Aqk and Akk) are extra
# outputs of the forward op. With seq_idx [B, T] the ops lay the rows end to end as documents
# (cu_seqlens) inside, every op input and output keeping its [B, T] shape. The backward has its
# own fused dq / dk / dg kernel, not the gated delta rule's that Hopper GPUs with triton < 3.7.1
# miscompile (titan_hybrid.ops.kernels.fla_gated_delta_bwd_refusal): KDA runs fla whole there.

@kernel_op("fla_kda_fwd", saved_by_selective_ac=True)
def _kda_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor, scale: float, initial_state: torch.Tensor | None,
             output_final_state: bool, seq_idx: torch.Tensor | None,
             use_qk_l2norm: bool) -> list[torch.Tensor]:
    def empty():  # a custom op's outputs may not alias each other
        return q.new_empty(0)

    rows = KernelRows(q.shape[:2], seq_idx)
    q, k, v, g, beta = rows.to_kernel(q, k, v, g, beta)
    q, k, residuals = l2norm_in_kernel(q, k, use_qk_l2norm, empty)
    o, final_state, g_cum, Aqk, Akk, *_ = kernel_packages.kda_fwd(
        q=q, k=k, v=v, g=g, beta=beta, scale=scale,
        initial_state=rows.initial_states(initial_state), output_final_state=output_final_state,
        cu_seqlens=rows.cu_seqlens, chunk_indices=rows.chunk_indices(), chunk_size=CHUNK_SIZE)
    return erase_write_fwd_outputs(rows, v.dtype, o, final_state, residuals, g_cum, Aqk, Akk,
                                   use_qk_l2norm, empty)


@_kda_fwd.register_fake
def _(q, k, v, g, beta, scale, initial_state, output_final_state, seq_idx, use_qk_l2norm):
    return erase_write_fwd_fake_outputs(q, k, v, g, output_final_state, use_qk_l2norm)


@kernel_op("fla_kda_bwd")
def _kda_bwd(do: torch.Tensor, dfinal_state: torch.Tensor | None, q: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
             initial_state: torch.Tensor | None, q_normed: torch.Tensor, k_normed: torch.Tensor,
             q_rstd: torch.Tensor, k_rstd: torch.Tensor, g_cum: torch.Tensor, Aqk: torch.Tensor,
             Akk: torch.Tensor, scale: float, seq_idx: torch.Tensor | None,
             use_qk_l2norm: bool) -> list[torch.Tensor]:
    rows = KernelRows(q.shape[:2], seq_idx)
    q_used, k_used, v_used, beta_used, g_cum, Aqk, Akk, do, q_rstd, k_rstd = rows.to_kernel(
        *((q_normed, k_normed) if use_qk_l2norm else (q, k)), v, beta, g_cum, Aqk, Akk, do,
        *((q_rstd, k_rstd) if use_qk_l2norm else (None, None)))
    dq, dk, dv, dbeta, dg, dh0, *_ = kernel_packages.kda_bwd(
        q=q_used, k=k_used, v=v_used, beta=beta_used, Aqk=Aqk, Akk=Akk, scale=scale,
        initial_state=rows.initial_states(initial_state), do=do.contiguous(),
        dht=rows.final_state_grads(dfinal_state), g=g_cum, cu_seqlens=rows.cu_seqlens,
        chunk_indices=rows.chunk_indices(), chunk_size=CHUNK_SIZE)
    if use_qk_l2norm:
        dq, dk = l2norm_in_kernel_bwd(dq, dk, q_used, k_used, q_rstd, k_rstd)
    dq, dk, dv, dg, dbeta = rows.from_kernel(dq, dk, dv, dg, dbeta)
    dh0 = rows.initial_state_grads(dh0)
    grads = [dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype)]
    return grads + [q.new_empty(0) if dh0 is None else dh0.to(initial_state.dtype)]


@_kda_bwd.register_fake
def _(do, dfinal_state, q, k, v, beta, g, initial_state, *_):
    dh0 = q.new_empty(0) if initial_state is None else torch.empty_like(initial_state)
    return [torch.empty_like(t) for t in (q, k, v, g, beta)] + [dh0]


def _kda_setup_context(ctx, inputs, output):
    (q, k, v, g, beta, ctx.scale, initial_state, ctx.output_final_state, seq_idx,
     ctx.use_qk_l2norm) = inputs
    _, _, q_normed, k_normed, q_rstd, k_rstd, g_cum, Aqk, Akk = output
    ctx.save_for_backward(q, k, v, beta, g, initial_state, seq_idx, q_normed, k_normed, q_rstd,
                          k_rstd, g_cum, Aqk, Akk)


def _kda_backward(ctx, output_grads):
    do, dfinal_state = output_grads[:2]  # the residual outputs' gradients are unused
    if not ctx.output_final_state:  # autograd passes zeros of the empty placeholder's shape
        dfinal_state = None
    (q, k, v, beta, g, initial_state, seq_idx, q_normed, k_normed, q_rstd, k_rstd, g_cum, Aqk,
     Akk) = ctx.saved_tensors
    dq, dk, dv, dg, dbeta, dh0 = _kda_bwd(
        do, dfinal_state, q, k, v, beta, g, initial_state, q_normed, k_normed, q_rstd, k_rstd,
        g_cum, Aqk, Akk, ctx.scale, seq_idx, ctx.use_qk_l2norm)
    return (dq, dk, dv, dg, dbeta, None, None if initial_state is None else dh0, None, None,
            None)


_kda_fwd.register_autograd(_kda_backward, setup_context=_kda_setup_context)

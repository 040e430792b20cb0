"""Gated delta rule (gated DeltaNet) in pure PyTorch, with flash-linear-attention's API.

Shape suffixes follow the package legend (docs/architecture.md, "Shape suffixes"): B batch, T time, H heads,
K key/query dim, V value dim, J chunks, Q positions in a chunk (chunk length); a lower-case b
is B*H flattened. Sequences: the B rows, or the packed documents when `cu_seqlens` is given.

Packed documents come in one of two forms:
- `cu_seqlens` [N+1] (fla's API): batch size 1, N documents back to back, one initial and one
  final state per document.
- `seq_idx` [B, T] (mamba_ssm's form, what the model passes): a document starts wherever seq_idx
  differs from the previous position of the same row. The state restarts at every such start;
  the position before a row counts as the row's first document, whatever its id (mamba_ssm's
  SSD takes it as id 0), so `initial_state` [B] feeds each row's first document and the final
  state [B] is each row's state at its end (the state of its last document). Shapes do not
  depend on the documents, so torch.compile traces it.

Per head, with state S [K, V] and log-decay g_t <= 0, gate beta_t in (0, 1):

    S   = exp(g_t) * S
    v'  = beta_t * (v_t - S^T k_t)
    S   = S + outer(k_t, v')
    o_t = S^T (scale * q_t)

`chunk_gated_delta_rule` calls fla's Triton kernel for CUDA tensors when `fla` is installed (also
for CPU tensors inside `titan_hybrid.ops.kernels.force_kernels()`, as the interpreter tests do)
and `chunk_gated_delta_rule_torch` otherwise; on a runtime that refuses fla's backward alone
(Hopper with triton < 3.7.1) the backward differentiates the torch path. The torch path works
on chunks of Q tokens. Within a chunk, with G the inclusive cumulative log-decay and S0 the
state entering the chunk, the corrected values v' (rows of U) solve a unit lower-triangular
system (WY / UT representation):

    (I + A) U = beta*V - (beta*exp(G)*K) S0,   A_ij = beta_i exp(G_i - G_j) k_i.k_j  (j < i)

so with Tinv = (I + A)^-1:  U = W - KC S0,  W = Tinv (beta*V),  KC = Tinv (beta*exp(G)*K), and

    O      = (exp(G)*Q) S0 + P U,           P_ij = exp(G_i - G_j) q_i.k_j  (j <= i)
    S_exit = exp(G_end) S0 + (exp(G_end - G)*K)^T U,   G_end: G at the chunk's last token.

Everything but the last three products is batched over all chunks at once; a Python loop over
chunks carries S0 from chunk to chunk.

With `seq_idx` a chunk may hold several documents, and a document's tokens see neither the
state nor the tokens of the documents before it. Per chunk: A and P keep only pairs (i, j) of
one document; S0 reaches token i only if i is in S0's document (that of the previous chunk's
last token; for the first chunk, the row's first document), so a document starting at the
chunk's first token gets none of it; the exit state keeps exp(G_end) S0 only if no document
starts in the chunk, and K^T U only over the tokens of the chunk's last document. G still
runs from the chunk's start: for i, j of one document, G_i - G_j sums that document's decays
only. Every dropped term is masked to -inf before exp, so none can overflow.
"""

from __future__ import annotations

import math

import torch

from titan_hybrid.compat import kernel_packages
from titan_hybrid.ops.custom_ops import kernel_op
from titan_hybrid.ops.delta_rule_documents import (
    KernelRows,
    document_masks,
    exp_where,
    l2norm,
    l2norm_in_kernel,
    l2norm_in_kernel_bwd,
)
from titan_hybrid.ops.kernels import kernel_op_refused, use_kernel

CHUNK_SIZE = 64


def _num_seqs(q: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None,
              initial_state: torch.Tensor | None, seq_idx: torch.Tensor | None = None) -> int:
    """Checks shapes only (no device sync); returns N, the number of initial / final states."""
    B = q.shape[0]
    if v.shape[2] % q.shape[2]:
        raise ValueError(f"{v.shape[2]} value heads are not a multiple of {q.shape[2]} "
                         "query / key heads")
    if seq_idx is not None:
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens and seq_idx both given: they are two forms of the same "
                             "document boundaries, pass one")
        if tuple(seq_idx.shape) != tuple(q.shape[:2]):
            raise ValueError(f"seq_idx has shape {tuple(seq_idx.shape)}, expected [B, T] = "
                             f"{list(q.shape[:2])}")
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"cu_seqlens needs batch size 1 (packed sequences), got B={B}")
    n_seqs = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is not None and initial_state.shape[0] != n_seqs:
        raise ValueError(f"initial_state has {initial_state.shape[0]} states, expected {n_seqs}")
    return n_seqs


def _repeat_to_value_heads(q, k, v):
    """Grouped value heads (fla's GVA): value head h reads query / key head h // (HV / H)."""
    repeat = v.shape[2] // q.shape[2]
    if repeat == 1:
        return q, k
    return q.repeat_interleave(repeat, dim=2), k.repeat_interleave(repeat, dim=2)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                           output_final_state=False, cu_seqlens=None,
                           use_qk_l2norm_in_kernel=False, *, seq_idx=None):
    """fla-compatible entry point: q, k [B,T,Hk,K], v [B,T,H,V], g, beta [B,T,H], with H a
    multiple of Hk (value head h reads query / key head h // (H / Hk), as fla's GVA: the kernel
    reads the shared heads in place, the torch path repeats them). Packed documents: either
    `cu_seqlens` [N+1] (B = 1) or `seq_idx` [B,T] (integers, see the module docstring).

    Returns (o [B,T,H,V] in v's dtype, final_state [N,H,K,V] or None), N the number of
    documents with cu_seqlens, else B. fla's Triton kernel when
    `titan_hybrid.ops.kernels.use_kernel` says so (CUDA tensors, or inside `force_kernels()`),
    else `chunk_gated_delta_rule_torch`.
    """
    _num_seqs(q, v, cu_seqlens, initial_state, seq_idx)
    if use_kernel(v, "fla"):
        # fla's dots need one dtype for q, k and v (a no-op for our mixer); cu_seqlens are int64
        # in fla's API. Its entry point made inputs contiguous; the launchers below do not.
        q, k = q.to(v.dtype).contiguous(), k.to(v.dtype).contiguous()
        o, final_state, *_ = _gdn_fwd(
            q, k, v.contiguous(), g.contiguous(), beta.contiguous(),
            q.shape[-1] ** -0.5 if scale is None else float(scale),
            None if initial_state is None else initial_state.contiguous(), output_final_state,
            None if cu_seqlens is None else cu_seqlens.to(torch.int64).contiguous(),
            None if seq_idx is None else seq_idx.contiguous(), use_qk_l2norm_in_kernel)
        return o, (final_state if output_final_state else None)
    return chunk_gated_delta_rule_torch(q, k, v, g, beta, scale=scale,
                                        initial_state=initial_state,
                                        output_final_state=output_final_state,
                                        cu_seqlens=cu_seqlens,
                                        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                        seq_idx=seq_idx)


def chunk_gated_delta_rule_torch(q, k, v, g, beta, scale=None, initial_state=None,
                                 output_final_state=False, cu_seqlens=None,
                                 use_qk_l2norm_in_kernel=False, *, seq_idx=None,
                                 chunk_size=CHUNK_SIZE):
    """Chunked torch path; same arguments and returns as `chunk_gated_delta_rule`.

    Math runs in fp32 (fp64 for fp64 inputs); final_state is returned in that dtype. With
    `seq_idx` nothing depends on the values of the data (no host sync, static shapes).
    """
    # Autocast would run the matmuls and the triangular solve below in bf16.
    with torch.autocast(q.device.type, enabled=False):
        return _chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state,
                                       output_final_state, cu_seqlens, seq_idx,
                                       use_qk_l2norm_in_kernel, chunk_size)


def _chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                            cu_seqlens, seq_idx, use_qk_l2norm_in_kernel, chunk_size):
    n_seqs = _num_seqs(q, v, cu_seqlens, initial_state, seq_idx)
    q, k = _repeat_to_value_heads(q, k, v)
    B, T, H, K = q.shape
    if cu_seqlens is not None and (cu_seqlens[0] != 0 or cu_seqlens[-1] != T):
        raise ValueError(f"cu_seqlens must start at 0 and end at T={T}")
    V, Q = v.shape[-1], chunk_size
    scale = K ** -0.5 if scale is None else scale
    dtype, out_dtype = torch.promote_types(q.dtype, torch.float32), v.dtype
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * scale

    # Every sequence is padded to whole chunks with zeros: a zero token (g = 0, k = 0, beta = 0)
    # leaves the state exactly unchanged, so padding affects neither outputs nor final states.
    if cu_seqlens is None:
        seq_chunks = [math.ceil(T / Q)]
        dest_T = None
    else:
        seq_lens = cu_seqlens.diff().to(q.device)
        seq_chunks = ((seq_lens + Q - 1) // Q).tolist()
        seq_padded_starts = torch.cumsum(seq_lens.new_tensor([0] + seq_chunks[:-1]), 0) * Q
        seq_T = torch.repeat_interleave(torch.arange(n_seqs, device=q.device), seq_lens)
        dest_T = (torch.arange(T, device=q.device) - cu_seqlens.to(q.device)[seq_T]
                  + seq_padded_starts[seq_T])
    n_chunks = sum(seq_chunks)

    def to_chunks(x_BTHD):  # -> [J, B, H, Q, D], chunk-major: one chunk's slice is contiguous
        if dest_T is None:
            x_BTHD = torch.nn.functional.pad(x_BTHD, (0, 0, 0, 0, 0, n_chunks * Q - T))
        else:
            x_BTHD = x_BTHD.new_zeros((B, n_chunks * Q) + x_BTHD.shape[2:]).index_copy(1, dest_T, x_BTHD)
        return x_BTHD.unflatten(1, (n_chunks, Q)).movedim((1, 2), (0, 3)).contiguous()

    q_JBHQK, k_JBHQK, v_JBHQV = to_chunks(q), to_chunks(k), to_chunks(v)
    g_JBHQ, beta_JBHQ = to_chunks(g[..., None])[..., 0], to_chunks(beta[..., None])[..., 0]

    G_JBHQ = g_JBHQ.cumsum(-1)
    if seq_idx is None:
        pairs_QQ = torch.ones(Q, Q, dtype=torch.bool, device=q.device).tril()
        from_entering = in_last = carries = None  # every term survives
    else:
        pairs_QQ, from_entering, in_last, carries = document_masks(seq_idx, n_chunks, Q)
    # exp(G_i - G_j) is a decay (<= 1) only for i >= j; above the diagonal it can overflow, so
    # it is masked before exp (exp_where)
    log_decay_JBHQQ = G_JBHQ[..., :, None] - G_JBHQ[..., None, :]
    decay_JBHQQ = exp_where(log_decay_JBHQQ, pairs_QQ)
    A_JBHQQ = (k_JBHQK @ k_JBHQK.transpose(-1, -2)) * decay_JBHQQ * beta_JBHQ[..., None]
    # (I + A)^-1 by a triangular solve (backward stable; a Neumann series would cancel badly).
    # unitriangular: the diagonal is taken as 1 and only the strict lower part of A is read.
    eye_QQ = torch.eye(Q, dtype=dtype, device=q.device)
    T_JBHQQ = torch.linalg.solve_triangular(A_JBHQQ, eye_QQ.expand_as(A_JBHQQ), upper=False,
                                            unitriangular=True)
    # All decays below are exp of non-positive numbers: nothing can overflow. The decay from S0
    # to each token is computed twice rather than shared: sharing would sum its two gradients
    # before the exp's backward, another rounding of dg, and runs without documents would no
    # longer repeat their earlier loss curves bit for bit.
    W_JBHQV = T_JBHQQ @ (v_JBHQV * beta_JBHQ[..., None])
    KC_JBHQK = T_JBHQQ @ (k_JBHQK * (beta_JBHQ * exp_where(G_JBHQ, from_entering))[..., None])
    P_JBHQQ = (q_JBHQK @ k_JBHQK.transpose(-1, -2)) * decay_JBHQQ
    q_dec_JBHQK = q_JBHQK * exp_where(G_JBHQ, from_entering)[..., None]
    decay_out_JBHQ = exp_where(G_JBHQ[..., -1:] - G_JBHQ, in_last)  # each token to the exit
    k_dec_JBHKQ = (k_JBHQK * decay_out_JBHQ[..., None]).transpose(-1, -2)
    gamma_JBH11 = exp_where(G_JBHQ[..., -1, None, None], carries)

    if initial_state is None:
        initial_state = q.new_zeros(n_seqs, H, K, V)
    init = initial_state.to(dtype)
    init_per_seq = [init.flatten(0, 1)] if cu_seqlens is None else list(init)
    # unbind, not indexing: each index's backward would fill a full-size zero gradient
    per_chunk = [x.flatten(1, 2).unbind(0) for x in (W_JBHQV, KC_JBHQK, P_JBHQQ, q_dec_JBHQK,
                                                     k_dec_JBHKQ, gamma_JBH11)]
    o_chunks, final_states, chunk = [], [], 0
    for S_bKV, n in zip(init_per_seq, seq_chunks):  # S_bKV: [B*H, K, V]
        for _ in range(n):
            W_bQV, KC_bQK, P_bQQ, q_dec_bQK, k_dec_bKQ, gamma_b11 = (x[chunk] for x in per_chunk)
            v_new_bQV = torch.baddbmm(W_bQV, KC_bQK, S_bKV, alpha=-1)
            o_bQV = torch.baddbmm(P_bQQ @ v_new_bQV, q_dec_bQK, S_bKV)
            o_chunks.append(o_bQV.unflatten(0, (B, H)).transpose(1, 2))
            S_bKV = torch.baddbmm(S_bKV * gamma_b11, k_dec_bKQ, v_new_bQV)
            chunk += 1
        final_states.append(S_bKV)

    o_BTHV = torch.stack(o_chunks, 1).flatten(1, 2)
    o_BTHV = o_BTHV[:, :T] if dest_T is None else o_BTHV.index_select(1, dest_T)
    final = torch.stack(final_states).view(n_seqs, H, K, V) if output_final_state else None
    return o_BTHV.to(out_dtype), final


def recurrent_gated_delta_rule_reference(q, k, v, g, beta, scale=None, initial_state=None,
                                         output_final_state=False, cu_seqlens=None,
                                         use_qk_l2norm_in_kernel=False):
    """Step-by-step recurrence (test oracle), computed in the inputs' dtype. Same API."""
    n_seqs = _num_seqs(q, v, cu_seqlens, initial_state)
    q, k = _repeat_to_value_heads(q, k, v)
    if cu_seqlens is not None:
        outs, finals = [], []
        for i, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
            o, S = recurrent_gated_delta_rule_reference(
                *(x[:, start:end] for x in (q, k, v, g, beta)), scale=scale,
                initial_state=None if initial_state is None else initial_state[i:i + 1],
                output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
            outs.append(o)
            finals.append(S)
        return torch.cat(outs, 1), (torch.cat(finals) if output_final_state else None)

    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    S_BHKV = (q.new_zeros(n_seqs, H, K, v.shape[-1]) if initial_state is None
              else initial_state.to(q.dtype))
    outs = []
    for t in range(T):
        S_BHKV = S_BHKV * g[:, t].exp()[..., None, None]
        k_BHK = k[:, t]
        v_new_BHV = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S_BHKV, k_BHK))
        S_BHKV = S_BHKV + k_BHK[..., :, None] * v_new_BHV[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S_BHKV, q[:, t] * scale))
    o = torch.stack(outs, 1) if outs else v.new_zeros(v.shape)
    return o.to(v.dtype), (S_BHKV if output_final_state else None)


# ---- fla's kernel as torch.library custom ops (opaque to torch.compile; fla's own entry point is
# marked torch.compiler.disable). The forward and backward are fla's
# chunk_gated_delta_rule_fwd / _bwd and l2norm_fwd / _bwd (internals, checked on fla 0.6.0:
# titan_hybrid.compat.kernel_packages), called as its ChunkGatedDeltaRuleFunction calls them;
# the residuals it saves (l2-normalised q and k with their reciprocal norms, the chunk-local
# cumulative decay, the WY matrix A) are extra outputs of the forward op. Absent tensors travel
# as empty ones (a custom op cannot return None).
#
# fla takes packed documents as cu_seqlens only. With seq_idx [B, T] the ops flatten the batch
# into one packed row and derive cu_seqlens inside, where data-dependent sizes are allowed (the
# op is opaque to torch.compile): every op input and output keeps its [B, T] shape.
#
# A runtime where fla's backward computes wrong gradients (a Hopper GPU with triton < 3.7.1:
# titan_hybrid.ops.kernels.fla_gated_delta_bwd_refusal) refuses the backward op alone: the
# forward still runs fla's kernel, and the backward recomputes the forward on the torch path
# from the same inputs and differentiates it (`_gdn_backward_by_torch`).


@kernel_op("fla_gated_delta_fwd", saved_by_selective_ac=True)
def _gdn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor, scale: float, initial_state: torch.Tensor | None,
             output_final_state: bool, cu_seqlens: torch.Tensor | None,
             seq_idx: torch.Tensor | None, use_qk_l2norm: bool) -> list[torch.Tensor]:
    def empty():  # a custom op's outputs may not alias each other
        return q.new_empty(0)

    rows = KernelRows(q.shape[:2], seq_idx, cu_seqlens)
    q, k, v, g, beta = rows.to_kernel(q, k, v, g, beta)
    q, k, residuals = l2norm_in_kernel(q, k, use_qk_l2norm, empty)
    g_cum, o, A, final_state, _, _ = kernel_packages.gated_delta_rule_fwd(
        q=q, k=k, v=v, g=g, beta=beta, scale=scale,
        initial_state=rows.initial_states(initial_state), output_final_state=output_final_state,
        cu_seqlens=rows.cu_seqlens, chunk_indices=rows.chunk_indices(), chunk_size=CHUNK_SIZE)
    o, g_cum, A = rows.from_kernel(o, g_cum, A)
    if use_qk_l2norm:
        residuals = rows.from_kernel(*residuals)
    final_state = rows.final_states(final_state)
    return [o, empty() if final_state is None else final_state, *residuals, g_cum, A]


@_gdn_fwd.register_fake
def _(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, seq_idx,
      use_qk_l2norm):
    B, T, H, K = q.shape
    n_seqs = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    final_state = q.new_empty((n_seqs, v.shape[2], K, v.shape[-1]) if output_final_state else (0,),
                              dtype=torch.float32 if output_final_state else q.dtype)
    if use_qk_l2norm:
        rstd = q.new_empty(B, T, H, dtype=torch.float32)
        residuals = [torch.empty_like(q), torch.empty_like(k), rstd, torch.empty_like(rstd)]
    else:
        residuals = [q.new_empty(0) for _ in range(4)]
    return [torch.empty_like(v), final_state, *residuals,
            torch.empty_like(g, dtype=torch.float32), q.new_empty(B, T, v.shape[2], CHUNK_SIZE)]


@kernel_op("fla_gated_delta_bwd")
def _gdn_bwd(do: torch.Tensor, dfinal_state: torch.Tensor | None, q: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
             initial_state: torch.Tensor | None, q_normed: torch.Tensor, k_normed: torch.Tensor,
             q_rstd: torch.Tensor, k_rstd: torch.Tensor, g_cum: torch.Tensor, A: torch.Tensor,
             scale: float, cu_seqlens: torch.Tensor | None, seq_idx: torch.Tensor | None,
             use_qk_l2norm: bool) -> list[torch.Tensor]:
    rows = KernelRows(q.shape[:2], seq_idx, cu_seqlens)
    q_used, k_used, v_used, beta_used, g_cum, A, do, q_rstd, k_rstd = rows.to_kernel(
        *((q_normed, k_normed) if use_qk_l2norm else (q, k)), v, beta, g_cum, A, do,
        *((q_rstd, k_rstd) if use_qk_l2norm else (None, None)))
    dq, dk, dv, dbeta, dg, dh0, _, _ = kernel_packages.gated_delta_rule_bwd(
        q=q_used, k=k_used, v=v_used, g=g_cum, beta=beta_used, A=A, scale=scale,
        initial_state=rows.initial_states(initial_state), do=do.contiguous(),
        dht=rows.final_state_grads(dfinal_state), cu_seqlens=rows.cu_seqlens,
        chunk_indices=rows.chunk_indices(), chunk_size=CHUNK_SIZE)
    if use_qk_l2norm:
        dq, dk = l2norm_in_kernel_bwd(dq, dk, q_used, k_used, q_rstd, k_rstd)
    dq, dk, dv, dg, dbeta = rows.from_kernel(dq, dk, dv, dg, dbeta)
    dh0 = rows.initial_state_grads(dh0)
    grads = [dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype)]
    return grads + [q.new_empty(0) if dh0 is None else dh0.to(initial_state.dtype)]


@_gdn_bwd.register_fake
def _(do, dfinal_state, q, k, v, beta, g, initial_state, *_):
    dh0 = q.new_empty(0) if initial_state is None else torch.empty_like(initial_state)
    return [torch.empty_like(t) for t in (q, k, v, g, beta)] + [dh0]


def _gdn_setup_context(ctx, inputs, output):
    (q, k, v, g, beta, ctx.scale, initial_state, ctx.output_final_state, cu_seqlens, seq_idx,
     ctx.use_qk_l2norm) = inputs
    _, _, q_normed, k_normed, q_rstd, k_rstd, g_cum, A = output
    ctx.save_for_backward(q, k, v, beta, g, initial_state, cu_seqlens, seq_idx, q_normed,
                          k_normed, q_rstd, k_rstd, g_cum, A)


def _gdn_backward(ctx, output_grads):
    do, dfinal_state = output_grads[:2]  # the residual outputs' gradients are unused
    if not ctx.output_final_state:  # autograd passes zeros of the empty placeholder's shape
        dfinal_state = None
    if kernel_op_refused("fla_gated_delta_bwd"):
        return _gdn_backward_by_torch(ctx, do, dfinal_state)
    (q, k, v, beta, g, initial_state, cu_seqlens, seq_idx, q_normed, k_normed, q_rstd, k_rstd,
     g_cum, A) = ctx.saved_tensors
    dq, dk, dv, dg, dbeta, dh0 = _gdn_bwd(
        do, dfinal_state, q, k, v, beta, g, initial_state, q_normed, k_normed, q_rstd, k_rstd,
        g_cum, A, ctx.scale, cu_seqlens, seq_idx, ctx.use_qk_l2norm)
    return (dq, dk, dv, dg, dbeta, None, None if initial_state is None else dh0, None, None,
            None, None)


def _gdn_backward_by_torch(ctx, do, dfinal_state):
    """The gradients `_gdn_bwd` gives, from the torch path: its forward recomputed from the
    forward op's inputs (documents, initial state, scale, l2norm as the op had them) under
    autograd, then differentiated. Plain torch ops, so torch.compile traces them into the
    backward graph; the fla-only residuals go unused."""
    q, k, v, beta, g, initial_state, cu_seqlens, seq_idx = ctx.saved_tensors[:8]
    with torch.enable_grad():  # autograd runs a backward with grad mode off
        leaves = [x.detach().requires_grad_() for x in (q, k, v, g, beta)]
        h0 = None if initial_state is None else initial_state.detach().requires_grad_()
        o, final_state = chunk_gated_delta_rule_torch(
            *leaves, scale=ctx.scale, initial_state=h0,
            output_final_state=dfinal_state is not None, cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=ctx.use_qk_l2norm, seq_idx=seq_idx)
        outputs, output_grads = ([o], [do]) if dfinal_state is None else (
            [o, final_state], [do, dfinal_state])
        dq, dk, dv, dg, dbeta, *dh0 = torch.autograd.grad(
            outputs, leaves + ([] if h0 is None else [h0]), output_grads)
    return (dq, dk, dv, dg, dbeta, None, dh0[0] if dh0 else None, None, None, None, None)


_gdn_fwd.register_autograd(_gdn_backward, setup_context=_gdn_setup_context)

"""What the delta-rule ops (gated_delta.py, kda.py) share: the L2 norm of queries and keys,
masked decays, and packed documents in both forms, as chunk masks for the torch paths
(`seq_idx` [B, T], gated_delta.py's docstring) and as one packed row with `cu_seqlens` for
fla's kernels."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from titan_hybrid.compat import kernel_packages

FLA_CHUNK_SIZE = 64  # the chunk length fla's kernels run with here


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # eps inside the sqrt (as fla): an all-zero vector, e.g. padding, maps to zero, not NaN
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def exp_where(log_decay: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """exp(log_decay) where `keep`, exactly 0 elsewhere: -inf before exp, not a product after,
    so an entry that would overflow can give neither inf nor (inf * 0) NaN, also in backward."""
    if keep is None:
        return log_decay.exp()
    return log_decay.masked_fill(~keep, -math.inf).exp()


def document_masks(seq_idx_BT: torch.Tensor, n_chunks: int, chunk_size: int):
    """Which terms of the chunk equations survive document starts (module docstring), for
    `seq_idx` [B, T] cut into n_chunks chunks. Returns, shaped to broadcast over heads:
    same_doc_JB1QQ (pairs j <= i of one document), from_entering_JB1Q (tokens S0 reaches),
    in_last_JB1Q (tokens of the chunk's last document) and carries_JB111 (no start inside)."""
    B, T = seq_idx_BT.shape
    Q = chunk_size
    # Count the starts rather than compare ids: a later document reusing an id stays apart.
    # The position before the row counts as its first document (number 0).
    starts_BT = seq_idx_BT[:, 1:] != seq_idx_BT[:, :-1]
    doc_BT = torch.cat((starts_BT.new_zeros(B, 1), starts_BT), 1).cumsum(1)
    # Padding tokens (zeros: they change no state) join the row's last document.
    doc_BT = torch.cat((doc_BT, doc_BT[:, -1:].expand(B, n_chunks * Q - T)), 1)
    doc_JBQ = doc_BT.view(B, n_chunks, Q).transpose(0, 1)
    last_JB = doc_JBQ[..., -1]
    entering_JB = torch.cat((last_JB.new_zeros(1, B), last_JB[:-1]))  # S0's document
    causal_QQ = torch.ones(Q, Q, dtype=torch.bool, device=seq_idx_BT.device).tril()
    same_doc_JBQQ = (doc_JBQ[..., :, None] == doc_JBQ[..., None, :]) & causal_QQ
    from_entering_JBQ = doc_JBQ == entering_JB[..., None]
    in_last_JBQ = doc_JBQ == last_JB[..., None]
    carries_JB = last_JB == entering_JB
    return (same_doc_JBQQ[:, :, None], from_entering_JBQ[:, :, None], in_last_JBQ[:, :, None],
            carries_JB[:, :, None, None, None])


def chunk_indices(cu_seqlens):
    if cu_seqlens is None:
        return None
    return kernel_packages.prepare_chunk_indices(cu_seqlens, FLA_CHUNK_SIZE)


def rows_as_documents(seq_idx_BT: torch.Tensor):
    """The B rows laid end to end as N documents (each row's first token starts one):
    (cu_seqlens [N+1] int64, first_B, last_B), first_B / last_B the numbers among the N of
    each row's first and last document."""
    B, T = seq_idx_BT.shape
    starts_BT = torch.ones(B, T, dtype=torch.bool, device=seq_idx_BT.device)
    starts_BT[:, 1:] = seq_idx_BT[:, 1:] != seq_idx_BT[:, :-1]
    boundaries = starts_BT.flatten().nonzero().flatten()
    cu_seqlens = torch.cat((boundaries, boundaries.new_tensor([B * T])))
    docs_in_row_B = starts_BT.sum(1)
    docs_through_row_B = docs_in_row_B.cumsum(0)
    return cu_seqlens, docs_through_row_B - docs_in_row_B, docs_through_row_B - 1


def states_of_documents(states_B, index_B, n_docs):
    """Row states placed at their documents among n_docs, zeros for the others."""
    if states_B is None:
        return None
    return states_B.new_zeros((n_docs,) + states_B.shape[1:]).index_copy(0, index_B, states_B)


class KernelRows:
    """What fla's kernels see of [B, T] rows (they take packed documents as `cu_seqlens` over
    one row only): with `seq_idx`, the rows laid end to end as documents, each row's initial
    state entering its first document and its final state leaving its last; without, the
    rows (and `cu_seqlens`, if given) as they are. Inside the custom ops, where the
    data-dependent document count is allowed."""

    def __init__(self, shape_BT: tuple[int, int], seq_idx: torch.Tensor | None,
                 cu_seqlens: torch.Tensor | None = None) -> None:
        self.shape_BT, self.packed = tuple(shape_BT), seq_idx is not None
        self.cu_seqlens = cu_seqlens
        if self.packed:
            self.cu_seqlens, self.first_B, self.last_B = rows_as_documents(seq_idx)
            self.n_docs = self.cu_seqlens.numel() - 1

    def chunk_indices(self):
        return chunk_indices(self.cu_seqlens)

    def to_kernel(self, *tensors_BT):
        """[B, T, ...] -> [1, B*T, ...] when packed (None stays None)."""
        if not self.packed:
            return list(tensors_BT)
        return [None if x is None else x.flatten(0, 1)[None] for x in tensors_BT]

    def from_kernel(self, *tensors):
        """The kernel's [1, B*T, ...] back to [B, T, ...]."""
        if not self.packed:
            return list(tensors)
        return [x.view(*self.shape_BT, *x.shape[2:]) for x in tensors]

    def initial_states(self, states_B):
        """The rows' initial states placed at their first documents (zeros for the others)."""
        return states_of_documents(states_B, self.first_B, self.n_docs) if self.packed else states_B

    def final_state_grads(self, grads_B):
        """The gradients of the rows' final states placed at their last documents."""
        return states_of_documents(grads_B, self.last_B, self.n_docs) if self.packed else grads_B

    def final_states(self, states):
        """The documents' final states back to the rows' (None stays None)."""
        if not self.packed or states is None:
            return states
        return states.index_select(0, self.last_B)

    def initial_state_grads(self, grads):
        """The documents' initial-state gradients back to the rows' first documents'."""
        if not self.packed or grads is None:
            return grads
        return grads.index_select(0, self.first_B)


def l2norm_in_kernel(q, k, enabled: bool, empty: Callable[[], torch.Tensor]):
    """(q, k normalised by fla's kernel when `enabled`, the residuals its backward needs:
    [q, k normalised, their reciprocal norms], or four empty tensors)."""
    if not enabled:
        return q, k, [empty() for _ in range(4)]
    q, q_rstd = kernel_packages.l2norm_fwd(q)
    k, k_rstd = kernel_packages.l2norm_fwd(k)
    return q, k, [q, k, q_rstd, k_rstd]


def l2norm_in_kernel_bwd(dq, dk, q_normed, k_normed, q_rstd, k_rstd):
    return (kernel_packages.l2norm_bwd(q_normed, q_rstd, dq),
            kernel_packages.l2norm_bwd(k_normed, k_rstd, dk))


def erase_write_fwd_outputs(rows: KernelRows, v_dtype, o, final_state, residuals, g_cum, Aqk,
                            Akk, use_qk_l2norm: bool,
                            empty: Callable[[], torch.Tensor]) -> list[torch.Tensor]:
    """KDA's and GDN2's kernel forward op outputs from fla's ([B, T] rows again): o in v's
    dtype, the final state (or a placeholder), the l2norm residuals, the cumulative decay and
    the chunks' Aqk and Akk (what the backward takes)."""
    o, g_cum, Aqk, Akk = rows.from_kernel(o, g_cum, Aqk, Akk)
    if use_qk_l2norm:  # else the residuals are placeholders
        residuals = rows.from_kernel(*residuals)
    final_state = rows.final_states(final_state)
    return [o.to(v_dtype), empty() if final_state is None else final_state, *residuals, g_cum,
            Aqk, Akk]


def erase_write_fwd_fake_outputs(q, k, v, g, output_final_state: bool, use_qk_l2norm: bool):
    """The fake (shape-only) outputs of KDA's and GDN2's kernel forward ops: o, the final state
    (or an empty placeholder), the l2norm residuals (q, k normalised, their reciprocal norms;
    or four placeholders), the cumulative decay and the chunks' Aqk and Akk."""
    B, T, H, K = q.shape
    final_state = (q.new_empty((B, H, K, v.shape[-1]), dtype=torch.float32)
                   if output_final_state else q.new_empty(0))
    if use_qk_l2norm:
        rstd = q.new_empty(B, T, H, dtype=torch.float32)
        residuals = [torch.empty_like(q), torch.empty_like(k), rstd, torch.empty_like(rstd)]
    else:
        residuals = [q.new_empty(0) for _ in range(4)]
    return [torch.empty_like(v), final_state, *residuals, torch.empty_like(g, dtype=torch.float32),
            k.new_empty(B, T, H, FLA_CHUNK_SIZE), k.new_empty(B, T, H, FLA_CHUNK_SIZE)]

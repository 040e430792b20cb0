"""What the delta-rule ops (gated_delta.py, kda.py) share: the L2 norm of queries and keys,
masked decays, and packed documents in both forms, as chunk masks for the torch paths
(`seq_idx` [B, T], gated_delta.py's docstring) and as one packed row with `cu_seqlens` for
fla's kernels."""

from __future__ import annotations

import math

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


def one_row(*tensors_BT):
    """[B, T, ...] -> [1, B*T, ...] (None stays None)."""
    return [None if x is None else x.flatten(0, 1)[None] for x in tensors_BT]


def states_of_documents(states_B, index_B, n_docs):
    """Row states placed at their documents among n_docs, zeros for the others."""
    if states_B is None:
        return None
    return states_B.new_zeros((n_docs,) + states_B.shape[1:]).index_copy(0, index_B, states_B)

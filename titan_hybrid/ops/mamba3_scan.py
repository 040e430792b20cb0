"""Mamba-3's scan (arXiv 2603.15569; mamba_ssm 2.3.2.post1's `Mamba3`), chunked, in PyTorch.

Per head, with a state h [P, N], rank R inputs and read-outs (R = 1: SISO), and per token t
the step dt_t, its log decay a_t = A_t * dt_t (A_t per token, < 0) and the trapezoid's
weight lam_t in (0, 1)::

    h_t   = exp(a_t) h_{t-1}
            + (1 - lam_t) dt_t exp(a_t) sum_r x_{t-1,r} k_{t-1,r}^T    (the previous token)
            + lam_t dt_t sum_r x_{t,r} k_{t,r}^T                      (this token)
    o_t,r = h_t q_t,r + D x_t,r

q and k come in rotated by each token's cumulative angle, so q_t . k_s sees the rotation from
s to t (the rotation is the layer's: model/mamba3.py). Packed documents (`seq_idx [B, T]`)
restart everything at a document's first token: the state, and the previous-token term (a
document's first token has none).

The chunked form carries S_t = h_t + s_t sum_r x_t,r k_t,r^T, where s_t = (1 - lam_{t+1})
dt_{t+1} is the part of the next token's trapezoid term that the next decay does not scale
(0 where the next token starts a document, and at the row's end, so that the final S is h).
S then follows SSD's recurrence (ops/ssd.py), S_t = exp(a_t) S_{t-1} + (lam_t dt_t + s_t)
sum_r x_t,r k_t,r^T, and o_t,r = q_t,r . S_t - s_t sum_r' (q_t,r . k_t,r') x_t,r' + D x_t,r.
mamba_ssm's SISO kernel carries the same S across its chunks.

A state entering a row (`initial_state`: h [B, H, P, N], the previous token's k [B, R, H, N]
and x [B, R, H, P]) enters its leading document (seq_idx 0, as in ops/ssd.py), with that
token's trapezoid term. With `return_final_state`, the state after each row's last token in
the same three parts (h in float32, float64 for float64 inputs).

Everything is computed in float32 (float64 for float64 inputs), o in x's dtype. Shape
suffixes: B batch, T time, R rank, H heads, P head dim, N state size, J chunks, Q (and S)
positions in a chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titan_hybrid.ops.ssd import _doc_ids


def next_token_weights(dt_BTH: torch.Tensor, lam_BTH: torch.Tensor,
                       seq_idx_BT: torch.Tensor | None) -> torch.Tensor:
    """s_t = (1 - lam_{t+1}) dt_{t+1} [B, T, H]: 0 at each row's last token and where the next
    token starts another document."""
    s_BTH = F.pad(((1 - lam_BTH) * dt_BTH)[:, 1:], (0, 0, 0, 1))
    if seq_idx_BT is not None:
        same_BT = F.pad(seq_idx_BT[:, 1:] == seq_idx_BT[:, :-1], (0, 1))
        s_BTH = s_BTH * same_BT[..., None].to(s_BTH.dtype)
    return s_BTH


def mamba3_scan(x_BTRHP: torch.Tensor, q_BTRHN: torch.Tensor, k_BTRHN: torch.Tensor,
                dt_BTH: torch.Tensor, log_decay_BTH: torch.Tensor, lam_BTH: torch.Tensor,
                D_H: torch.Tensor | None, chunk_size: int, seq_idx_BT: torch.Tensor | None = None,
                initial_state: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                return_final_state: bool = False):
    """o [B, T, R, H, P] (see the module docstring); with `return_final_state`, (o, (h
    [B, H, P, N], k [B, R, H, N], x [B, R, H, P])) after each row's last token."""
    with torch.autocast(x_BTRHP.device.type, enabled=False):
        return _chunked(x_BTRHP, q_BTRHN, k_BTRHN, dt_BTH, log_decay_BTH, lam_BTH, D_H,
                        chunk_size, seq_idx_BT, initial_state, return_final_state)


def _chunked(x, q, k, dt, log_decay, lam, D, chunk_size, seq_idx, initial_state,
             return_final_state):
    b, t, r, h, p = x.shape
    n = q.shape[-1]
    out_dtype = x.dtype
    f = torch.promote_types(x.dtype, torch.float32)
    x, q, k, dt, log_decay, lam = (v.to(f) for v in (x, q, k, dt, log_decay, lam))
    s_BTH = next_token_weights(dt, lam, seq_idx)
    weight_BTH = lam * dt + s_BTH  # what S_t takes of token t's inputs
    c = chunk_size
    j = -(-t // c)
    pad = j * c - t

    def split(tensor):  # [B, T, ...] -> [B, J, Q, ...], zero-padded at the end
        tensor = F.pad(tensor, (0, 0) * (tensor.dim() - 2) + (0, pad))
        return tensor.reshape(b, j, c, *tensor.shape[2:])

    # padding: zero log decay, weight and inputs, so the final state is untouched
    x_BJQRHP, q_BJQRHN, k_BJQRHN = split(x), split(q), split(k)
    weight_BJQH = split(weight_BTH)
    cum_BJQH = split(log_decay).cumsum(2)
    last_BJH = cum_BJQH[:, :, -1]

    causal_QS = torch.ones(c, c, dtype=torch.bool, device=x.device).tril()
    if seq_idx is None:
        intra_BJQS = causal_QS[None, None]
        end_BJQ = start_BJQ = carry_BJ = None
    else:
        doc_BT = _doc_ids(seq_idx)
        doc_BJQ = torch.cat([doc_BT, doc_BT[:, -1:].expand(b, pad)], 1).reshape(b, j, c)
        last_doc_BJ = doc_BJQ[:, :, -1]
        entering_doc_BJ = F.pad(last_doc_BJ, (1, 0))[:, :-1]  # the doc carried into a chunk
        intra_BJQS = causal_QS & (doc_BJQ[..., :, None] == doc_BJQ[..., None, :])
        end_BJQ = doc_BJQ == last_doc_BJ[..., None]
        start_BJQ = doc_BJQ == entering_doc_BJ[..., None]
        carry_BJ = last_doc_BJ == entering_doc_BJ

    def decay(log_value, mask):
        if mask is None:
            return log_value.exp()
        while mask.dim() < log_value.dim():
            mask = mask[..., None]
        return log_value.masked_fill(~mask, float("-inf")).exp()

    # 1) within a chunk: token s's inputs, weighted and decayed to t (s <= t, same document)
    #    [B, J, H, Q, S] -- the decay differences are masked before exp, so never overflow
    gaps_BJHQS = (cum_BJQH.permute(0, 1, 3, 2)[..., :, None]
                  - cum_BJQH.permute(0, 1, 3, 2)[..., None, :])
    mixing_BJHQS = (decay(gaps_BJHQS, intra_BJQS[:, :, None])
                    * weight_BJQH.permute(0, 1, 3, 2)[..., None, :])
    scores_BJHQRSR = torch.einsum("bjqrhn,bjsuhn->bjhqrsu", q_BJQRHN, k_BJQRHN)
    o_BJQRHP = torch.einsum("bjhqs,bjhqrsu,bjsuhp->bjqrhp", mixing_BJHQS, scores_BJHQRSR,
                            x_BJQRHP)

    # 2) the state each chunk adds by its end, from its own tokens
    to_end_BJQH = decay(last_BJH[:, :, None] - cum_BJQH, end_BJQ) * weight_BJQH
    chunk_states_BJHPN = torch.einsum("bjqh,bjqrhp,bjqrhn->bjhpn", to_end_BJQH, x_BJQRHP,
                                      k_BJQRHN)

    # 3) across chunks, one step per chunk on [B, H, P, N]
    if initial_state is None:
        state_BHPN = x.new_zeros(b, h, p, n)
    else:  # S before the first token: h and the first token's term of the previous one (a
        # row whose first token starts a document reads none of it: the masks below)
        h0_BHPN, k_prev_BRHN, x_prev_BRHP = (v.to(f) for v in initial_state)
        s_first_BH = (1 - lam[:, 0]) * dt[:, 0]
        state_BHPN = h0_BHPN + s_first_BH[..., None, None] * torch.einsum(
            "brhp,brhn->bhpn", x_prev_BRHP, k_prev_BRHN)
    carry_BJH = decay(last_BJH, carry_BJ)
    entering = []
    for carry_BH, chunk_state_BHPN in zip(carry_BJH.unbind(1), chunk_states_BJHPN.unbind(1)):
        entering.append(state_BHPN)
        state_BHPN = state_BHPN * carry_BH[..., None, None] + chunk_state_BHPN
    entering_BJHPN = torch.stack(entering, 1)

    # 4) the state entering each chunk, decayed to each token and read out
    from_start_BJQH = decay(cum_BJQH, start_BJQ)
    o_BJQRHP = o_BJQRHP + torch.einsum("bjqh,bjqrhn,bjhpn->bjqrhp", from_start_BJQH, q_BJQRHN,
                                       entering_BJHPN)
    o_BTRHP = o_BJQRHP.reshape(b, j * c, r, h, p)[:, :t]

    # 5) S_t holds s_t of token t's own term, which h_t does not; and the skip
    own_BTRHP = torch.einsum("btrhn,btuhn,btuhp->btrhp", q, k, x)
    o_BTRHP = o_BTRHP - s_BTH[:, :, None, :, None] * own_BTRHP
    if D is not None:
        o_BTRHP = o_BTRHP + x * D.to(f)[:, None]
    o_BTRHP = o_BTRHP.to(out_dtype)
    if not return_final_state:
        return o_BTRHP
    # the row's last token has s = 0, so S there is h
    return o_BTRHP, (state_BHPN, k[:, -1], x[:, -1])

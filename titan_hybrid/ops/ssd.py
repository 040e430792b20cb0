"""Chunked SSD (Mamba2 state-space duality) scan in plain PyTorch.

``mamba_chunk_scan_combined`` takes the same arguments as
``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined``. On CUDA, when
``mamba_ssm`` imports, it forwards to that Triton kernel; everywhere else it runs
``ssd_chunked_torch``. ``ssd_recurrent_reference`` is a step-by-step loop, used
only as a test oracle.

Per head (state ``[p, n]``)::

    dt    = clamp(softplus(dt + dt_bias))          # each step optional
    S_t   = exp(dt_t * A) * S_{t-1} + dt_t * outer(x_t, B_t)
    y_t   = S_t @ C_t + D * x_t ;   y = y * silu(z)   # if z is given

Shape legend (names carry it as a suffix, e.g. ``x_BLHP``):
    b batch, l sequence length, h heads, p head dim, g B/C groups,
    r heads per group (h = g * r; head hh uses group hh // r),
    n state size, c chunks, k chunk length (chunk_size); ``K`` doubles as the
    source position inside a chunk when two positions appear (``_BCGRKK``).

Packed documents (``seq_idx [b, l]``): the state is zeroed wherever seq_idx
differs from the previous position. As in mamba_ssm, the position before the
sequence counts as seq_idx 0, so ``initial_states`` feeds only the leading
positions and only when they have seq_idx 0 (documents are normally numbered
from 0). ``final_states`` is then the state of the last document.

Precision: everything is computed in float32, or float64 for float64 inputs
(the "compute dtype"), including matmuls; ``y`` is cast back to ``x.dtype``,
``final_states`` stays in the compute dtype (float32, like mamba_ssm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_NO_LIMIT = (0.0, float("inf"))


def _prepare_dt(dt, dt_bias, dt_softplus, dt_limit, dtype):
    dt = dt.to(dtype)
    if dt_bias is not None:
        dt = dt + dt_bias.to(dtype)
    if dt_softplus:
        dt = F.softplus(dt)  # threshold 20 matches mamba_ssm's kernel
    if tuple(dt_limit) != _NO_LIMIT:
        dt = dt.clamp(dt_limit[0], dt_limit[1])
    return dt


def _skip(y, x, D, z):
    if D is not None:
        y = y + x * (D[:, None] if D.dim() == 1 else D).to(y.dtype)
    if z is not None:
        y = y * F.silu(z.to(y.dtype))
    return y


def _doc_ids(seq_idx_BL):
    """Document counter that increments at every seq_idx change (the position before
    the sequence counts as seq_idx 0). Counting changes, rather than comparing raw
    ids, keeps a document separate even if a later one reuses its id."""
    prev = F.pad(seq_idx_BL, (1, 0))[:, :-1]
    return (seq_idx_BL != prev).cumsum(-1)


class _IntraChunk(torch.autograd.Function):
    """y = (exp(segsum(Acum)) * CB) @ xdt within each chunk, masked to causal / same-document.

    Written out by hand because the [b, c, g, r, k, k] decay matrix is the largest tensor of
    the scan and, left to autograd, every elementwise step on it (fill, exp, product with CB
    and each of their backwards) is a full pass over memory. Here the forward keeps only the
    masked decay E; the backward rebuilds E * CB once and reuses one buffer for dL.
    """

    @staticmethod
    def forward(ctx, Acum_BCGRK, CB_BCGKK, xdt_BCGRKP, mask):
        # Masked entries become -inf before exp, so they are exact zeros and never overflow.
        E_BCGRKK = (Acum_BCGRK[..., :, None] - Acum_BCGRK[..., None, :])
        E_BCGRKK.masked_fill_(~mask, float("-inf")).exp_()
        ctx.save_for_backward(E_BCGRKK, CB_BCGKK, xdt_BCGRKP)
        return (E_BCGRKK * CB_BCGKK[:, :, :, None]) @ xdt_BCGRKP

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy_BCGRKP):
        E_BCGRKK, CB_BCGKK, xdt_BCGRKP = ctx.saved_tensors
        dxdt_BCGRKP = (E_BCGRKK * CB_BCGKK[:, :, :, None]).transpose(-1, -2) @ dy_BCGRKP
        dM_BCGRKK = dy_BCGRKP @ xdt_BCGRKP.transpose(-1, -2)
        dM_BCGRKK.mul_(E_BCGRKK)
        dCB_BCGKK = dM_BCGRKK.sum(3)
        dL_BCGRKK = dM_BCGRKK.mul_(CB_BCGKK[:, :, :, None])  # d(exp) = exp: dL = dM * E * CB
        # L_ij = Acum_i - Acum_j: row sums enter with +, column sums with -.
        dAcum_BCGRK = dL_BCGRKK.sum(-1) - dL_BCGRKK.sum(-2)
        return dAcum_BCGRK, dCB_BCGKK, dxdt_BCGRKP, None


def ssd_chunked_torch(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                      initial_states=None, seq_idx=None, dt_softplus=False,
                      dt_limit=_NO_LIMIT, return_final_states=False):
    """Torch path of :func:`mamba_chunk_scan_combined` (same signature).

    Returns ``y [b, l, h, p]`` in ``x.dtype``, or ``(y, final_states [b, h, p, n])``
    with ``final_states`` in the compute dtype (float32 / float64).
    """
    # Autocast would silently run the einsums/matmuls in bf16; keep the documented precision.
    with torch.autocast(x.device.type, enabled=False):
        return _ssd_chunked(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
                            dt_softplus, dt_limit, return_final_states)


def _ssd_chunked(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
                 dt_softplus, dt_limit, return_final_states):
    b, l, h, p = x.shape
    g, n = B.shape[-2:]
    if h % g != 0:
        raise ValueError(f"heads ({h}) must be a multiple of groups ({g})")
    r, k = h // g, chunk_size
    c = -(-l // k)
    pad = c * k - l
    f = torch.promote_types(x.dtype, torch.float32)

    # Padding comes after softplus/clamp: dt = 0 there, so decay is exp(0) = 1 and
    # the padded input adds nothing, leaving the final state untouched.
    dt_BLH = _prepare_dt(dt, dt_bias, dt_softplus, dt_limit, f)
    x_BLHP = x.to(f)

    def split(t):  # [b, l, ...] -> [b, c, k, ...], zero-padded at the end
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(b, c, k, *t.shape[2:])

    # Contiguous once here rather than copied inside each matmul (forward and backward) below.
    xdt_BCGRKP = (split(x_BLHP * dt_BLH[..., None]).reshape(b, c, k, g, r, p)
                  .permute(0, 1, 3, 4, 2, 5).contiguous())
    B_BCKGN = split(B.to(f))
    C_BCKGN = split(C.to(f))
    dA_BCKH = split(dt_BLH * A.to(f))
    # Decays come from differences of the cumulative log-decay in the compute dtype;
    # masked (non-causal / cross-document) entries are set to -inf before exp so they
    # become exact zeros and never overflow.
    Acum_BCGRK = dA_BCKH.reshape(b, c, k, g, r).permute(0, 1, 3, 4, 2).cumsum(-1)
    Alast_BCGR = Acum_BCGRK[..., -1]

    causal_KK = torch.ones(k, k, dtype=torch.bool, device=x.device).tril()
    if seq_idx is None:
        intra_mask = causal_KK
        end_mask = start_mask = carry_mask = None
    else:
        doc_BL = _doc_ids(seq_idx)
        doc_BL = torch.cat([doc_BL, doc_BL[:, -1:].expand(b, pad)], dim=1)  # padding joins the last doc
        doc_BCK = doc_BL.reshape(b, c, k)
        last_BC = doc_BCK[:, :, -1]
        prev_BC = F.pad(last_BC, (1, 0))[:, :-1]  # doc id carried into each chunk
        same_BCKK = doc_BCK[:, :, :, None] == doc_BCK[:, :, None, :]
        intra_mask = (causal_KK & same_BCKK)[:, :, None, None]
        end_mask = (doc_BCK == last_BC[..., None])[:, :, None, None]
        start_mask = (doc_BCK == prev_BC[..., None])[:, :, None, None]
        carry_mask = (last_BC == prev_BC)[:, :, None, None]

    def decay(log_decay, mask):
        return log_decay.exp() if mask is None else log_decay.masked_fill(~mask, float("-inf")).exp()

    # 1) Intra-chunk (quadratic) term.
    CB_BCGKK = torch.einsum("bcign,bcjgn->bcgij", C_BCKGN, B_BCKGN)  # shared by the group's heads
    y_BCGRKP = _IntraChunk.apply(Acum_BCGRK, CB_BCGKK, xdt_BCGRKP, intra_mask)

    # 2) State each chunk adds by its end, from its own inputs only.
    w_end_BCGRK = decay(Alast_BCGR[..., None] - Acum_BCGRK, end_mask)
    states_BCGRPN = torch.einsum("bcgrkp,bckgn->bcgrpn", xdt_BCGRKP * w_end_BCGRK[..., None], B_BCKGN)

    # 3) Inter-chunk recurrence: sequential over c (cheap: c steps on [b, h, p, n]),
    #    which avoids a [b, c, c, h, p, n]-sized segment sum for long sequences.
    carry_BCGR = decay(Alast_BCGR, carry_mask)
    if initial_states is None:
        state_BGRPN = x_BLHP.new_zeros(b, g, r, p, n)
    else:
        state_BGRPN = initial_states.to(f).reshape(b, g, r, p, n)
    entering = []
    # unbind, not indexing: the backward of `t[:, ci]` writes a full-size zero gradient per
    # chunk, which makes the backward quadratic in the number of chunks.
    for carry_BGR, chunk_state_BGRPN in zip(carry_BCGR.unbind(1), states_BCGRPN.unbind(1)):
        entering.append(state_BGRPN)
        state_BGRPN = state_BGRPN * carry_BGR[..., None, None] + chunk_state_BGRPN
    prev_BCGRPN = torch.stack(entering, dim=1)

    # 4) Contribution of the state entering each chunk, decayed to each position.
    w_start_BCGRK = decay(Acum_BCGRK, start_mask)
    y_off_BCGRKP = torch.einsum("bckgn,bcgrpn->bcgrkp", C_BCKGN, prev_BCGRPN)
    y_BCGRKP = y_BCGRKP + y_off_BCGRKP * w_start_BCGRK[..., None]

    y_BLHP = y_BCGRKP.permute(0, 1, 4, 2, 3, 5).reshape(b, c * k, h, p)[:, :l]
    y_BLHP = _skip(y_BLHP, x_BLHP, D, z).to(x.dtype)
    if return_final_states:
        return y_BLHP, state_BGRPN.reshape(b, h, p, n)
    return y_BLHP


def _mamba_ssm_kernel():
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined as fn
    except ImportError:
        return None
    return fn


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                              initial_states=None, seq_idx=None, dt_softplus=False,
                              dt_limit=_NO_LIMIT, return_final_states=False):
    """Chunked SSD scan with mamba_ssm's API (see module docstring for shapes/semantics).

    Uses mamba_ssm's Triton kernel for CUDA tensors when available, else
    :func:`ssd_chunked_torch`.
    """
    kwargs = dict(D=D, z=z, dt_bias=dt_bias, initial_states=initial_states, seq_idx=seq_idx,
                  dt_softplus=dt_softplus, dt_limit=dt_limit,
                  return_final_states=return_final_states)
    if x.is_cuda:
        kernel = _mamba_ssm_kernel()
        if kernel is not None:
            return kernel(x, dt, A, B, C, chunk_size, **kwargs)
    return ssd_chunked_torch(x, dt, A, B, C, chunk_size, **kwargs)


def ssd_recurrent_reference(x, dt, A, B, C, D=None, z=None, dt_bias=None, initial_states=None,
                            seq_idx=None, dt_softplus=False, dt_limit=_NO_LIMIT):
    """Step-by-step recurrence, in the dtype it is given (test oracle; O(l) Python steps).

    Returns ``(y [b, l, h, p], final_states [b, h, p, n])``.
    """
    b, l, h, p = x.shape
    g, n = B.shape[-2:]
    dt = dt if dt_bias is None else dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != _NO_LIMIT:
        dt = dt.clamp(dt_limit[0], dt_limit[1])
    B_BLHN = B.repeat_interleave(h // g, dim=2)
    C_BLHN = C.repeat_interleave(h // g, dim=2)
    if initial_states is None:
        state = x.new_zeros(b, h, p, n)
    else:
        state = initial_states.to(x.dtype)
    prev_seq = None if seq_idx is None else torch.zeros_like(seq_idx[:, 0])
    ys = []
    for t in range(l):
        if seq_idx is not None:
            keep = (seq_idx[:, t] == prev_seq).to(x.dtype)
            state = state * keep[:, None, None, None]
            prev_seq = seq_idx[:, t]
        dt_t = dt[:, t]  # [b, h]
        state = (state * torch.exp(dt_t * A)[..., None, None]
                 + (dt_t[..., None] * x[:, t])[..., None] * B_BLHN[:, t, :, None, :])
        ys.append((state * C_BLHN[:, t, :, None, :]).sum(-1))
    y = _skip(torch.stack(ys, dim=1), x, D, z)
    return y, state

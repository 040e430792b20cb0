"""Chunked SSD (Mamba2 state-space duality) scan in plain PyTorch.

``mamba_chunk_scan_combined`` takes the same arguments as
``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined``. For CUDA tensors, when
``mamba_ssm`` imports, it runs that Triton kernel (also for CPU tensors inside
``titan_hybrid.ops.kernels.force_kernels()``, as the interpreter tests do); everywhere else it
runs ``ssd_chunked_torch``. ``ssd_recurrent_reference`` is a step-by-step loop, used
only as a test oracle.

Per head (state ``[p, n]``)::

    dt    = clamp(softplus(dt + dt_bias))          # each step optional
    S_t   = exp(dt_t * A) * S_{t-1} + dt_t * outer(x_t, B_t)
    y_t   = S_t @ C_t + D * x_t ;   y = y * silu(z)   # if z is given

Shape suffixes follow the package legend (docs/architecture.md, "Shape suffixes"), e.g. ``x_BTHP``;
lower-case letters are the sizes: b batch, t time, h heads, p head dim, g B/C groups,
r heads per group (h = g * r; head hh uses group hh // r), n state size, j chunks,
q positions in a chunk (chunk_size); ``QQ`` is (position, source position) in a chunk.

Packed documents (``seq_idx [b, t]``): the state is zeroed wherever seq_idx
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

from titan_hybrid.compat import kernel_packages
from titan_hybrid.ops.custom_ops import kernel_op
from titan_hybrid.ops.kernels import use_kernel
from titan_hybrid.ops.ssd_backward import ssd_backward

_NO_LIMIT = (0.0, float("inf"))


def discretized_dt(dt, dt_bias, dt_softplus, dt_limit, dtype):
    """The step sizes the scan uses: (softplus(dt + dt_bias), clamped to dt_limit) in `dtype`."""
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


def _doc_ids(seq_idx_BT):
    """Document counter that increments at every seq_idx change (the position before
    the sequence counts as seq_idx 0). Counting changes, rather than comparing raw
    ids, keeps a document separate even if a later one reuses its id."""
    prev = F.pad(seq_idx_BT, (1, 0))[:, :-1]
    return (seq_idx_BT != prev).cumsum(-1)


class _IntraChunk(torch.autograd.Function):
    """y = (exp(segsum(Acum)) * CB) @ xdt within each chunk, masked to causal / same-document.

    Written out by hand because the [b, j, g, r, q, q] decay matrix is the largest tensor of
    the scan and, left to autograd, every elementwise step on it (fill, exp, product with CB
    and each of their backwards) is a full pass over memory. Here the forward keeps only the
    masked decay E; the backward rebuilds E * CB once and reuses one buffer for dL.
    """

    @staticmethod
    def forward(ctx, Acum_BJGRQ, CB_BJGQQ, xdt_BJGRQP, mask):
        # Masked entries become -inf before exp, so they are exact zeros and never overflow.
        E_BJGRQQ = (Acum_BJGRQ[..., :, None] - Acum_BJGRQ[..., None, :])
        E_BJGRQQ.masked_fill_(~mask, float("-inf")).exp_()
        ctx.save_for_backward(E_BJGRQQ, CB_BJGQQ, xdt_BJGRQP)
        return (E_BJGRQQ * CB_BJGQQ[:, :, :, None]) @ xdt_BJGRQP

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy_BJGRQP):
        E_BJGRQQ, CB_BJGQQ, xdt_BJGRQP = ctx.saved_tensors
        dxdt_BJGRQP = (E_BJGRQQ * CB_BJGQQ[:, :, :, None]).transpose(-1, -2) @ dy_BJGRQP
        dM_BJGRQQ = dy_BJGRQP @ xdt_BJGRQP.transpose(-1, -2)
        dM_BJGRQQ.mul_(E_BJGRQQ)
        dCB_BJGQQ = dM_BJGRQQ.sum(3)
        dL_BJGRQQ = dM_BJGRQQ.mul_(CB_BJGQQ[:, :, :, None])  # d(exp) = exp: dL = dM * E * CB
        # L_ij = Acum_i - Acum_j: row sums enter with +, column sums with -.
        dAcum_BJGRQ = dL_BJGRQQ.sum(-1) - dL_BJGRQQ.sum(-2)
        return dAcum_BJGRQ, dCB_BJGQQ, dxdt_BJGRQP, None


def ssd_chunked_torch(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                      initial_states=None, seq_idx=None, dt_softplus=False,
                      dt_limit=_NO_LIMIT, return_final_states=False):
    """Torch path of :func:`mamba_chunk_scan_combined` (same signature).

    Returns ``y [b, t, h, p]`` in ``x.dtype``, or ``(y, final_states [b, h, p, n])``
    with ``final_states`` in the compute dtype (float32 / float64).
    """
    # Autocast would silently run the einsums/matmuls in bf16; keep the documented precision.
    with torch.autocast(x.device.type, enabled=False):
        return _ssd_chunked(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
                            dt_softplus, dt_limit, return_final_states)


def _ssd_chunked(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
                 dt_softplus, dt_limit, return_final_states):
    b, t, h, p = x.shape
    g, n = B.shape[-2:]
    if h % g != 0:
        raise ValueError(f"heads ({h}) must be a multiple of groups ({g})")
    r, q = h // g, chunk_size
    j = -(-t // q)
    pad = j * q - t
    f = torch.promote_types(x.dtype, torch.float32)

    # Padding comes after softplus/clamp: dt = 0 there, so decay is exp(0) = 1 and
    # the padded input adds nothing, leaving the final state untouched.
    dt_BTH = discretized_dt(dt, dt_bias, dt_softplus, dt_limit, f)
    x_BTHP = x.to(f)

    def split(tensor):  # [b, t, ...] -> [b, j, q, ...], zero-padded at the end
        tensor = F.pad(tensor, (0, 0) * (tensor.dim() - 2) + (0, pad))
        return tensor.reshape(b, j, q, *tensor.shape[2:])

    # Contiguous once here rather than copied inside each matmul (forward and backward) below.
    xdt_BJGRQP = (split(x_BTHP * dt_BTH[..., None]).reshape(b, j, q, g, r, p)
                  .permute(0, 1, 3, 4, 2, 5).contiguous())
    B_BJQGN = split(B.to(f))
    C_BJQGN = split(C.to(f))
    dA_BJQH = split(dt_BTH * A.to(f))
    # Decays come from differences of the cumulative log-decay in the compute dtype;
    # masked (non-causal / cross-document) entries are set to -inf before exp so they
    # become exact zeros and never overflow.
    Acum_BJGRQ = dA_BJQH.reshape(b, j, q, g, r).permute(0, 1, 3, 4, 2).cumsum(-1)
    Alast_BJGR = Acum_BJGRQ[..., -1]

    causal_QQ = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()
    if seq_idx is None:
        intra_mask = causal_QQ
        end_mask = start_mask = carry_mask = None
    else:
        doc_BT = _doc_ids(seq_idx)
        doc_BT = torch.cat([doc_BT, doc_BT[:, -1:].expand(b, pad)], dim=1)  # padding joins the last doc
        doc_BJQ = doc_BT.reshape(b, j, q)
        last_BJ = doc_BJQ[:, :, -1]
        prev_BJ = F.pad(last_BJ, (1, 0))[:, :-1]  # doc id carried into each chunk
        same_BJQQ = doc_BJQ[:, :, :, None] == doc_BJQ[:, :, None, :]
        intra_mask = (causal_QQ & same_BJQQ)[:, :, None, None]
        end_mask = (doc_BJQ == last_BJ[..., None])[:, :, None, None]
        start_mask = (doc_BJQ == prev_BJ[..., None])[:, :, None, None]
        carry_mask = (last_BJ == prev_BJ)[:, :, None, None]

    def decay(log_decay, mask):
        return log_decay.exp() if mask is None else log_decay.masked_fill(~mask, float("-inf")).exp()

    # 1) Intra-chunk (quadratic) term.
    CB_BJGQQ = torch.einsum("bjqgn,bjsgn->bjgqs", C_BJQGN, B_BJQGN)  # shared by the group's heads
    y_BJGRQP = _IntraChunk.apply(Acum_BJGRQ, CB_BJGQQ, xdt_BJGRQP, intra_mask)

    # 2) State each chunk adds by its end, from its own inputs only.
    w_end_BJGRQ = decay(Alast_BJGR[..., None] - Acum_BJGRQ, end_mask)
    states_BJGRPN = torch.einsum("bjgrqp,bjqgn->bjgrpn", xdt_BJGRQP * w_end_BJGRQ[..., None], B_BJQGN)

    # 3) Inter-chunk recurrence: sequential over j (cheap: j steps on [b, h, p, n]),
    #    which avoids a [b, j, j, h, p, n]-sized segment sum for long sequences.
    carry_BJGR = decay(Alast_BJGR, carry_mask)
    if initial_states is None:
        state_BGRPN = x_BTHP.new_zeros(b, g, r, p, n)
    else:
        state_BGRPN = initial_states.to(f).reshape(b, g, r, p, n)
    entering = []
    # unbind, not indexing: the backward of `t[:, ci]` writes a full-size zero gradient per
    # chunk, which makes the backward quadratic in the number of chunks.
    for carry_BGR, chunk_state_BGRPN in zip(carry_BJGR.unbind(1), states_BJGRPN.unbind(1)):
        entering.append(state_BGRPN)
        state_BGRPN = state_BGRPN * carry_BGR[..., None, None] + chunk_state_BGRPN
    prev_BJGRPN = torch.stack(entering, dim=1)

    # 4) Contribution of the state entering each chunk, decayed to each position.
    w_start_BJGRQ = decay(Acum_BJGRQ, start_mask)
    y_off_BJGRQP = torch.einsum("bjqgn,bjgrpn->bjgrqp", C_BJQGN, prev_BJGRPN)
    y_BJGRQP = y_BJGRQP + y_off_BJGRQP * w_start_BJGRQ[..., None]

    y_BTHP = y_BJGRQP.permute(0, 1, 4, 2, 3, 5).reshape(b, j * q, h, p)[:, :t]
    y_BTHP = _skip(y_BTHP, x_BTHP, D, z).to(x.dtype)
    if return_final_states:
        return y_BTHP, state_BGRPN.reshape(b, h, p, n)
    return y_BTHP


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                              initial_states=None, seq_idx=None, dt_softplus=False,
                              dt_limit=_NO_LIMIT, return_final_states=False):
    """Chunked SSD scan with mamba_ssm's API (see module docstring for shapes/semantics).

    mamba_ssm's Triton kernel when ``titan_hybrid.ops.kernels.use_kernel`` says so (CUDA
    tensors, or inside ``force_kernels()``), else :func:`ssd_chunked_torch`.
    """
    if use_kernel(x, "mamba_ssm"):
        y, final_states, *_ = _ssd_fwd(
            x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states,
            # mamba_ssm's own modules pass int32 document ids
            None if seq_idx is None else seq_idx.to(torch.int32).contiguous(),
            dt_softplus, float(dt_limit[0]), float(dt_limit[1]), return_final_states)
        return (y, final_states) if return_final_states else y
    return ssd_chunked_torch(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
                             initial_states=initial_states, seq_idx=seq_idx,
                             dt_softplus=dt_softplus, dt_limit=dt_limit,
                             return_final_states=return_final_states)


# ---- mamba_ssm's kernel as torch.library custom ops (opaque to torch.compile). The forward
# calls its forward launcher (what its own MambaChunkScanCombinedFn calls; private in mamba_ssm,
# so reached through titan_hybrid.compat.kernel_packages) and keeps, besides the output, what
# the backward would otherwise recompute: dt after softplus, its chunked cumulative decay and
# the chunk states (titan_hybrid.ops.ssd_backward). Absent gradients travel as empty tensors
# (a custom op cannot return None).


@kernel_op("mamba_ssd_fwd", saved_by_selective_ac=True)
def _ssd_fwd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, chunk_size: int, D: torch.Tensor | None, z: torch.Tensor | None,
             dt_bias: torch.Tensor | None, initial_states: torch.Tensor | None,
             seq_idx: torch.Tensor | None, dt_softplus: bool, dt_min: float, dt_max: float,
             final_states_used: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                               torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, final_states, y before the z gate (empty without z), dt_chunked, dA_cumsum,
    states)."""
    y, y_before_gate, dt_chunked, dA_cumsum, states, final_states = kernel_packages.ssd_scan_fwd(
        x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
        seq_idx=seq_idx, dt_softplus=dt_softplus, dt_limit=(dt_min, dt_max))
    return (y, final_states, (x.new_empty(0) if z is None else y_before_gate), dt_chunked,
            dA_cumsum, states)


@_ssd_fwd.register_fake
def _(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus, dt_min,
      dt_max, final_states_used):
    b, t, h, p = x.shape
    chunks = -(-t // chunk_size)
    final_states = x.new_empty(b, h, p, B.shape[-1], dtype=torch.float32)
    chunked = x.new_empty(b, h, chunks, chunk_size, dtype=torch.float32)
    return (x.new_empty(x.shape), final_states, x.new_empty(0 if z is None else x.shape),
            chunked, torch.empty_like(chunked), C.new_empty(b, chunks, h, p, B.shape[-1]))


@kernel_op("mamba_ssd_bwd")
def _ssd_bwd(dy: torch.Tensor, dfinal_states: torch.Tensor | None, y_before_gate: torch.Tensor,
             x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, chunk_size: int, D: torch.Tensor | None, z: torch.Tensor | None,
             dt_bias: torch.Tensor | None, initial_states: torch.Tensor | None,
             seq_idx: torch.Tensor | None, dt_softplus: bool, dt_min: float, dt_max: float,
             dt_chunked: torch.Tensor, dA_cumsum: torch.Tensor,
             states: torch.Tensor) -> list[torch.Tensor]:
    grads = ssd_backward(dy, dfinal_states, y_before_gate, x, dt, A, B, C, chunk_size, D, z,
                         dt_bias, initial_states, seq_idx, dt_softplus, (dt_min, dt_max),
                         dt_chunked, dA_cumsum, states)
    like = (x, dt, A, B, C, D, z, dt_bias, initial_states)
    return [x.new_empty(0) if grad is None else grad.to(t.dtype) for grad, t in zip(grads, like)]


@_ssd_bwd.register_fake
def _(dy, dfinal_states, y_before_gate, x, dt, A, B, C, chunk_size, D, z, dt_bias,
      initial_states, seq_idx, dt_softplus, dt_min, dt_max, dt_chunked, dA_cumsum, states):
    # dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinitial_states
    like = (x, dt, A, B, C, D, z, dt_bias, initial_states)
    return [x.new_empty(0) if t is None else torch.empty_like(t) for t in like]


def _ssd_setup_context(ctx, inputs, output):
    (x, dt, A, B, C, ctx.chunk_size, D, z, dt_bias, initial_states, seq_idx, ctx.dt_softplus,
     ctx.dt_min, ctx.dt_max, ctx.final_states_used) = inputs
    y, _, y_before_gate, dt_chunked, dA_cumsum, states = output
    ctx.save_for_backward(y if z is None else y_before_gate, x, dt, A, B, C, D, z, dt_bias,
                          initial_states, seq_idx, dt_chunked, dA_cumsum, states)


def _ssd_backward(ctx, dy, dfinal_states, *_):
    (y_before_gate, x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, dt_chunked,
     dA_cumsum, states) = ctx.saved_tensors
    if not ctx.final_states_used:  # autograd passes zeros: skip the kernel's work on them
        dfinal_states = None
    dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinitial_states = _ssd_bwd(
        dy, dfinal_states, y_before_gate, x, dt, A, B, C, ctx.chunk_size, D, z, dt_bias,
        initial_states, seq_idx, ctx.dt_softplus, ctx.dt_min, ctx.dt_max, dt_chunked,
        dA_cumsum, states)
    absent = (lambda tensor, grad: None if tensor is None else grad)
    return (dx, ddt, dA, dB, dC, None, absent(D, dD), absent(z, dz), absent(dt_bias, ddt_bias),
            absent(initial_states, dinitial_states), None, None, None, None, None)


_ssd_fwd.register_autograd(_ssd_backward, setup_context=_ssd_setup_context)


def ssd_recurrent_reference(x, dt, A, B, C, D=None, z=None, dt_bias=None, initial_states=None,
                            seq_idx=None, dt_softplus=False, dt_limit=_NO_LIMIT):
    """Step-by-step recurrence, in the dtype it is given (test oracle; O(t) Python steps).

    Returns ``(y [b, t, h, p], final_states [b, h, p, n])``.
    """
    b, length, h, p = x.shape
    g, n = B.shape[-2:]
    dt = dt if dt_bias is None else dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != _NO_LIMIT:
        dt = dt.clamp(dt_limit[0], dt_limit[1])
    B_BTHN = B.repeat_interleave(h // g, dim=2)
    C_BTHN = C.repeat_interleave(h // g, dim=2)
    if initial_states is None:
        state = x.new_zeros(b, h, p, n)
    else:
        state = initial_states.to(x.dtype)
    prev_seq = None if seq_idx is None else torch.zeros_like(seq_idx[:, 0])
    ys = []
    for t in range(length):
        if seq_idx is not None:
            keep = (seq_idx[:, t] == prev_seq).to(x.dtype)
            state = state * keep[:, None, None, None]
            prev_seq = seq_idx[:, t]
        dt_t = dt[:, t]  # [b, h]
        state = (state * torch.exp(dt_t * A)[..., None, None]
                 + (dt_t[..., None] * x[:, t])[..., None] * B_BTHN[:, t, :, None, :])
        ys.append((state * C_BTHN[:, t, :, None, :]).sum(-1))
    y = _skip(torch.stack(ys, dim=1), x, D, z)
    return y, state

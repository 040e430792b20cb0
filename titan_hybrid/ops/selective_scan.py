"""Mamba1's selective scan in plain PyTorch: chunked, with packed documents and initial / final
states.

Per channel d (its state a vector of n)::

    dt    = softplus(dt + dt_bias)                          # optional
    h_t   = exp(dt_t[d] * A[d, :]) * h_{t-1} + dt_t[d] * B_t * u_t[d]
    y_t   = C_t . h_t + D[d] * u_t[d] ;   y = y * silu(z)   # if z is given

Shapes: u, dt, z [b, t, d]; A [d, n] (negative: -exp(A_log)); B, C [b, t, n], one vector a
token shared by every channel; D [d]. Unlike Mamba2 (a scalar decay per head), the state
decays by its own rate per (channel, state entry).

The scan runs chunk by chunk (CHUNK_SIZE tokens), each chunk in closed form: with L_t the
cumulative log decay since the chunk's start and X_s = dt_s B_s u_s,
h_t = exp(L_t) h_0 + sum_{s <= t} exp(L_t - L_s) X_s, every exponent <= 0 (the differences are
taken per pair, so nothing overflows), and the chunk's last state enters the next.

Memory: a chunk's pairwise decays [b, q, s, d, n] are chunk_size times the size of its states.
Kept for backward they cost about 700 MB a layer at b 8, t 64, d 512, n 16, so under autograd
each chunk is checkpointed: backward keeps only the chunk's inputs and entering state, and
recomputes the chunk's forward (bit for bit the same) when it reaches it.

Packed documents (`seq_idx [b, t]`): the state does not cross a document start. As in
titan_hybrid.ops.ssd (and mamba_ssm), the position before the sequence counts as seq_idx 0, so
`initial_state` [b, d, n] enters only the leading positions with seq_idx 0, and the final
state is that of the last document.

`selective_scan` runs our Triton kernels (ops/selective_scan_triton.py) for CUDA tensors, and
inside ops.kernels.force_kernels() (the tests' interpreter runs), and `selective_scan_torch`
otherwise: the reference, and the CPU path.

Precision: computed in float32, or float64 for float64 inputs; y is cast back to u's dtype, the
final state stays in the compute dtype. Legend: b batch, t time, d channels, n state size,
q / s positions in a chunk (target / source).
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from titan_hybrid.ops.kernels import KERNEL_DTYPES, kernels_forced

if importlib.util.find_spec("triton") is not None:
    from titan_hybrid.ops.selective_scan_triton import selective_scan_triton
else:  # a CPU-only torch without triton: the torch path everywhere
    selective_scan_triton = None

CHUNK_SIZE = 16  # the [q, s, d, n] decays of one chunk are what the scan holds at a time


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def selective_scan(u_BTD: torch.Tensor, dt_BTD: torch.Tensor, A_DN: torch.Tensor,
                   B_BTN: torch.Tensor, C_BTN: torch.Tensor, D: torch.Tensor | None = None,
                   z_BTD: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                   dt_softplus: bool = False, seq_idx: torch.Tensor | None = None,
                   initial_state: torch.Tensor | None = None, return_final_state: bool = False):
    """y [b, t, d] (with `return_final_state`, also the state after the last token [b, d, n]),
    through the Triton kernels or the torch path (the module docstring)."""
    scan = selective_scan_torch
    if selective_scan_triton is not None and (u_BTD.is_cuda or kernels_forced()) \
            and u_BTD.dtype in KERNEL_DTYPES:
        scan = selective_scan_triton
    return scan(u_BTD, dt_BTD, A_DN, B_BTN, C_BTN, D=D, z_BTD=z_BTD, dt_bias=dt_bias,
                dt_softplus=dt_softplus, seq_idx=seq_idx, initial_state=initial_state,
                return_final_state=return_final_state)


def selective_scan_torch(u_BTD: torch.Tensor, dt_BTD: torch.Tensor, A_DN: torch.Tensor,
                         B_BTN: torch.Tensor, C_BTN: torch.Tensor, D: torch.Tensor | None = None,
                         z_BTD: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                         dt_softplus: bool = False, seq_idx: torch.Tensor | None = None,
                         initial_state: torch.Tensor | None = None,
                         return_final_state: bool = False, chunk_size: int = CHUNK_SIZE):
    """The chunked torch path (the module docstring)."""
    dtype = _compute_dtype(u_BTD)
    batch, length, channels = u_BTD.shape
    u, dt = u_BTD.to(dtype), dt_BTD.to(dtype)
    if dt_bias is not None:
        dt = dt + dt_bias.to(dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    A, B, C = A_DN.to(dtype), B_BTN.to(dtype), C_BTN.to(dtype)
    state = (u.new_zeros(batch, channels, A.shape[-1]) if initial_state is None
             else initial_state.to(dtype))
    previous_doc = (None if seq_idx is None
                    else torch.zeros(batch, 1, dtype=seq_idx.dtype, device=seq_idx.device))
    recompute = torch.is_grad_enabled() and any(
        t.requires_grad for t in (u, dt, A, B, C, state))
    outputs = []
    for start in range(0, length, chunk_size):
        stop = min(start + chunk_size, length)
        chunk_doc = None if seq_idx is None else seq_idx[:, start:stop]
        chunk_inputs = (u[:, start:stop], dt[:, start:stop], A, B[:, start:stop],
                        C[:, start:stop], state, chunk_doc, previous_doc)
        y, state = (checkpoint(_chunk, *chunk_inputs, use_reentrant=False) if recompute
                    else _chunk(*chunk_inputs))
        outputs.append(y)
        if chunk_doc is not None:
            previous_doc = chunk_doc[:, -1:]
    y = torch.cat(outputs, 1)
    if D is not None:
        y = y + u * D.to(dtype)
    if z_BTD is not None:
        y = y * F.silu(z_BTD.to(dtype))
    y = y.to(u_BTD.dtype)
    return (y, state) if return_final_state else y


def _chunk(u, dt, A, B, C, state, chunk_doc, previous_doc):
    """One chunk: (y [b, q, d], the state after its last token [b, d, n]).

    Channel-major ([b, d, n, q]) so that the pairwise decays are made in place and enter a
    batched matmul without a copy."""
    dt_BD1Q = dt.permute(0, 2, 1)[:, :, None]
    log_decay = torch.cumsum(dt_BD1Q * A[..., None], dim=-1)  # L [b, d, n, q]
    inputs = (dt_BD1Q * u.permute(0, 2, 1)[:, :, None]) * B.permute(0, 2, 1)[:, None]  # X
    positions = torch.arange(u.shape[1], device=u.device)
    blocked = (positions[:, None] < positions[None, :])[None]  # s > t  [1, q, s]
    carried = torch.ones_like(u[:, :, 0])  # whether h_0 reaches t  [b, q]
    if chunk_doc is not None:
        blocked = blocked | (chunk_doc[:, :, None] != chunk_doc[:, None, :])
        carried = (chunk_doc == previous_doc).to(u.dtype)
    # L_t - L_s [b, d, n, q, s], exp'd in place
    decays = (log_decay[..., :, None] - log_decay[..., None, :])
    decays = decays.masked_fill_(blocked[:, None, None], float("-inf")).exp_()
    states = (decays @ inputs[..., None])[..., 0]  # [b, d, n, q]
    states = states + log_decay.exp() * carried[:, None, None] * state[..., None]
    y = torch.einsum("bqn,bdnq->bqd", C, states)
    return y, states[..., -1]


def selective_scan_reference(u_BTD, dt_BTD, A_DN, B_BTN, C_BTN, D=None, z_BTD=None,
                             dt_bias=None, dt_softplus=False, seq_idx=None, initial_state=None):
    """The recurrence step by step, in float64 (a test oracle): (y, final state)."""
    u, dt, A, B, C = (t.double() for t in (u_BTD, dt_BTD, A_DN, B_BTN, C_BTN))
    if dt_bias is not None:
        dt = dt + dt_bias.double()
    if dt_softplus:
        dt = F.softplus(dt)
    batch, length, channels = u.shape
    state = (u.new_zeros(batch, channels, A.shape[-1]) if initial_state is None
             else initial_state.double())
    ys = []
    for t in range(length):
        if seq_idx is not None:
            before = seq_idx[:, t - 1] if t else torch.zeros_like(seq_idx[:, 0])
            state = state * (seq_idx[:, t] == before).double()[:, None, None]
        state = (torch.exp(dt[:, t, :, None] * A) * state
                 + (dt[:, t] * u[:, t])[..., None] * B[:, t, None, :])
        ys.append(torch.einsum("bdn,bn->bd", state, C[:, t]))
    y = torch.stack(ys, 1)
    if D is not None:
        y = y + u * D.double()
    if z_BTD is not None:
        y = y * F.silu(z_BTD.double())
    return y, state

"""Mamba1's selective scan in plain PyTorch: chunked, with packed documents and initial / final
states.

Per channel d (its state a vector of n)::

    dt    = softplus(dt + dt_bias)                          # optional
    h_t   = exp(dt_t[d] * A[d, :]) * h_{t-1} + dt_t[d] * B_t * u_t[d]
    y_t   = C_t . h_t + D[d] * u_t[d] ;   y = y * silu(z)   # if z is given

Shapes: u, dt, z [b, t, d]; A [d, n] (negative: -exp(A_log)); B, C [b, t, n], one vector a
token shared by every channel; D [d]. Unlike Mamba2 (a scalar decay per head), the state
decays by its own rate per (channel, state entry).

The torch path walks the tokens, one multiply-add of the state [b, d, n] each
(`h = dt B u + exp(dt A) h`), with each step's decay and input made for a chunk of CHUNK_SIZE
tokens at a time and the read-out C . h taken over the chunk's states in one product. That is
the recurrence's own arithmetic (nothing is formed per pair of tokens, and no exponent is
rescaled), one small step per token: on a CPU its ops are memory-bound either way.

Memory: under autograd each chunk is checkpointed: backward keeps only the chunk's inputs and
entering state, and recomputes the chunk (bit for bit the same) when it reaches it, so what a
layer keeps is about its inputs, not its T x d x n states.

Packed documents (`seq_idx [b, t]`): the state does not cross a document start. As in
titan_hybrid.ops.ssd (and mamba_ssm), the position before the sequence counts as seq_idx 0, so
`initial_state` [b, d, n] enters only the leading positions with seq_idx 0, and the final
state is that of the last document.

`selective_scan` runs our Triton kernels (ops/selective_scan_triton.py) for CUDA tensors, and
inside ops.kernels.force_kernels() (the tests' interpreter runs), and `selective_scan_torch`
otherwise: the reference, and the CPU path.

Precision: computed in float32, or float64 for float64 inputs; y is cast back to u's dtype, the
final state stays in the compute dtype. Legend: b batch, t time, d channels, n state size,
q positions in a chunk.
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

CHUNK_SIZE = 64  # tokens whose decays, inputs and states [b, q, d, n] are made at a time


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
    carried = None  # [b, t]: whether the state before t enters t
    if seq_idx is not None:
        before = torch.cat((torch.zeros_like(seq_idx[:, :1]), seq_idx[:, :-1]), 1)
        carried = (seq_idx == before).to(dtype)
    recompute = torch.is_grad_enabled() and any(
        t.requires_grad for t in (u, dt, A, B, C, state))
    outputs = []
    for start in range(0, length, chunk_size):
        stop = min(start + chunk_size, length)
        chunk_inputs = (u[:, start:stop], dt[:, start:stop], A, B[:, start:stop],
                        C[:, start:stop], state,
                        None if carried is None else carried[:, start:stop])
        y, state = (checkpoint(_chunk, *chunk_inputs, use_reentrant=False) if recompute
                    else _chunk(*chunk_inputs))
        outputs.append(y)
    y = torch.cat(outputs, 1)
    if D is not None:
        y = y + u * D.to(dtype)
    if z_BTD is not None:
        y = y * F.silu(z_BTD.to(dtype))
    y = y.to(u_BTD.dtype)
    return (y, state) if return_final_state else y


def _chunk(u, dt, A, B, C, state, carried):
    """One chunk: (y [b, q, d], the state after its last token [b, d, n])."""
    decay = torch.exp(dt[..., None] * A)  # [b, q, d, n]
    if carried is not None:  # a document start drops the state before it
        decay = decay * carried[:, :, None, None]
    inputs = (dt * u)[..., None] * B[:, :, None, :]  # [b, q, d, n]
    states = []
    # unbind, not indexing: its backward stacks the steps' gradients once, where each
    # index's backward would fill a whole [b, q, d, n] of zeros
    for step_input, step_decay in zip(inputs.unbind(1), decay.unbind(1), strict=True):
        state = torch.addcmul(step_input, step_decay, state)
        states.append(state)
    y = torch.einsum("bqn,bqdn->bqd", C, torch.stack(states, 1))
    return y, state


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

"""The SSD scan's backward on mamba_ssm's kernels, reusing what its forward computed.

mamba_ssm's own backward (`_mamba_chunk_scan_combined_bwd`) is given only the forward's inputs
and output: it clones dt (a workaround for an old Triton's device-context bug) and recomputes
dt's softplus and chunked cumulative sum, and the chunk states with their passing between
chunks: four kernels and the clone, about a third of the forward again. Its forward has already
returned all of it (dt after softplus, dA_cumsum, the states entering each chunk), so the
custom op (titan_hybrid.ops.ssd) keeps those and this runs the backward's remaining steps on
them, through the same launchers (titan_hybrid.compat.kernel_packages) in the same order.

The states come from the forward in C's dtype (bf16 in a bf16 layer) where mamba_ssm's backward
recomputes them in float32; they enter only the products that mamba_ssm runs in x's dtype
anyway (dC, and the states' share of dA through the state passing's backward), and their
gradient (dstates) is still accumulated in float32.

Shapes: x [b, t, h, p], dt [b, t, h], B / C [b, t, g, n], dt_chunked / dA_cumsum
[b, h, chunks, chunk], states [b, chunks, h, p, n].
"""

from __future__ import annotations

import torch

from titan_hybrid.compat import kernel_packages as kp


def ssd_backward(dy, dfinal_states, y_before_gate, x, dt, A, B, C, chunk_size, D, z, dt_bias,
                 initial_states, seq_idx, dt_softplus, dt_limit, dt_chunked, dA_cumsum, states,
                 *, dx=None, ddt=None, dB=None, dC=None):
    """(dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinitial_states), None where there is no such
    input. dx, ddt, dB, dC are written into the tensors given for them (views into a larger
    gradient: Mamba2's fused core, titan_hybrid.ops.mamba_core), else into new ones."""
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    groups, state_size = B.shape[-2:]
    CB = kp.bmm_chunk_fwd(C, B, chunk_size, seq_idx=seq_idx, output_dtype=torch.float32)
    dz = None
    if z is not None:  # the z gate's backward; dy becomes the gradient of the ungated output
        dz, dy, dD, *_ = kp.chunk_scan_bwd_dz(x, z, y_before_gate, dy, chunk_size=chunk_size,
                                              has_ddAcs=False, D=D)
    # Gradient of the state entering each chunk, from the outputs that read it (float32).
    dstates = kp.chunk_scan_bwd_dstates(C, dA_cumsum, dy, seq_idx=seq_idx, dtype=torch.float32)
    dstates, ddA_chunk_ends, dinitial_states, states = kp.state_passing_bwd(
        states.flatten(-2), dA_cumsum[..., -1], dstates.flatten(-2),
        dfinal_states=None if dfinal_states is None else dfinal_states.flatten(-2),
        seq_idx=seq_idx, has_initial_states=initial_states is not None,
        dstates_dtype=x.dtype, states_dtype=x.dtype, chunk_size=chunk_size)
    states, dstates = states.unflatten(-1, (-1, state_size)), dstates.unflatten(
        -1, (-1, state_size))
    if dinitial_states is not None:
        dinitial_states = dinitial_states.unflatten(-1, (-1, state_size))
    dx, ddt_chunked, dD_from_x = kp.chunk_scan_chunk_state_bwd_dx(
        x, dt_chunked, dA_cumsum, B, CB, dy, dstates, D=D, seq_idx=seq_idx, dx=dx)
    dB_from_states, ddA_next = kp.chunk_state_bwd_db(x, dt_chunked, dA_cumsum, dstates,
                                                     seq_idx=seq_idx, B=B, ngroups=groups)
    dC_from_states, ddA_prev = kp.chunk_scan_bwd_dC(states, dA_cumsum, dy, seq_idx=seq_idx, C=C,
                                                    ngroups=groups)
    dCB = kp.chunk_scan_bwd_dcb(x, dt_chunked, dA_cumsum, dy, seq_idx=seq_idx,
                                ngroups=groups).to(CB.dtype)
    dB = torch.empty_like(B) if dB is None else dB
    dC = torch.empty_like(C) if dC is None else dC
    kp.bmm_chunk_bwd(C, dCB, residual=dB_from_states, out=dB)
    kp.bmm_chunk_bwd(B, dCB.transpose(-1, -2), residual=dC_from_states, out=dC)
    if z is None:
        dD = dD_from_x
    # dA_cumsum's gradient: what each position's decay to the chunk end and from the chunk
    # start contribute (a reverse cumulative sum), and the intra-chunk part.
    ddA_prev[..., -1] += ddA_chunk_ends
    ddA = kp.chunk_scan_bwd_ddAcs_stable(x, dt_chunked, dA_cumsum, dy, CB)
    ddA += ddA_next + ddA_prev.flip([-1]).cumsum(-1).flip([-1])
    ddt, dA, ddt_bias = kp.chunk_cumsum_bwd(ddA, ddt_chunked, dt, A, dt_bias=dt_bias,
                                            dt_softplus=dt_softplus, dt_limit=dt_limit, ddt=ddt)
    return dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinitial_states

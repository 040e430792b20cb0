"""Stand-in for mamba_ssm 2.3.2.post1's Mamba-3 MIMO TileLang kernels, which compile for CUDA
only: the four launchers of mamba_ssm.ops.tilelang.mamba3.mamba3_mimo_{fwd,bwd}[_varlen], with
their signatures (tests/unit/test_mamba3_mimo_kernel.py reads those from mamba_ssm's sources),
computing what their kernels compute, token by token in float64:

- q and k of each rank plus their per-head bias, rotated by the angles' running sum on the
  pairs (n, n + N/2), n < N / rotary_dim_divisor; each head reads its group's q and k;
- x_r = v * mimo_v[r];
- h_t = exp(adt_t) h_{t-1} + (gamma_t + shifted_t) sum_r k_t,r x_t,r^T, from zero at each
  sequence's first token, where gamma_t = dt_t sigmoid(trap_t), and shifted_t =
  dt_{t+1} sigmoid(-trap_{t+1}), zero at a sequence's last token;
- o_t,r = q_t,r . exp(adt_t) h_{t-1} + gamma_t sum_r' (q_t,r . k_t,r') x_t,r' + D x_t,r;
- with z, o_t,r * silu(z_t * mimo_z[r]); with mimo_o, the sum over r of o_t,r * mimo_o[r].

adt comes back from dA_cs, the within-chunk running sums of the decay kernel's chunks (chunk_size
tokens from each sequence's start). The backward differentiates this forward with autograd and
returns the kernels' results in their shapes and dtypes: dq and dk summed over a group's heads;
one group or one per head, else a ValueError, as theirs.

`__version__` is the tilelang this stands in for: inside tests.triton_kernels.kernels_on() on
CPU this module is also `tilelang`, whose version the kernel probe reads.
"""

from __future__ import annotations

import concurrent.futures

import torch
import torch.nn.functional as F

__version__ = "0.1.8"


def _sequence_starts(length: int, cu_seqlens, device) -> torch.Tensor:
    """[S] bool: each sequence's first token (every row's first without cu_seqlens)."""
    starts = torch.zeros(length, dtype=torch.bool, device=device)
    starts[0] = True
    if cu_seqlens is not None:
        starts[cu_seqlens[:-1].long()] = True
    return starts


def _log_decays(dA_cs: torch.Tensor, starts: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """adt [B, H, S] from its within-chunk running sums."""
    positions = torch.arange(dA_cs.shape[-1], device=dA_cs.device)
    sequence_start = torch.where(starts, positions, 0).cummax(0).values
    chunk_first = (positions - sequence_start) % chunk_size == 0
    return torch.where(chunk_first, dA_cs, dA_cs - F.pad(dA_cs[..., :-1], (1, 0)))


def _rotated(x, angles, pairs):
    """x [B, S, R, H, N] with the pairs (n, n + N/2), n < pairs, rotated by angles
    [B, S, H, pairs]."""
    half = x.shape[-1] // 2
    first, second = x[..., :pairs], x[..., half:half + pairs]
    cos, sin = angles.cos()[:, :, None], angles.sin()[:, :, None]
    return torch.cat([first * cos - second * sin, x[..., pairs:half],
                      first * sin + second * cos, x[..., half + pairs:]], -1)


def _outputs(q, k, v, q_bias, k_bias, mimo_v, mimo_o, z, D, mimo_z, angles, adt, dt, trap,
             starts, rotary_dim_divisor):
    _, length, _, groups, n = q.shape
    heads = v.shape[2]

    def per_head(qk, bias):
        biased = qk.repeat_interleave(heads // groups, dim=3) + bias.transpose(0, 1)
        return _rotated(biased, angles, n // rotary_dim_divisor)

    q, k = per_head(q, q_bias), per_head(k, k_bias)
    x = v[:, :, None] * mimo_v.transpose(0, 1)
    gamma = dt * torch.sigmoid(trap)
    shifted = F.pad(dt[..., 1:] * torch.sigmoid(-trap[..., 1:]), (0, 1))
    shifted = torch.where(F.pad(starts[1:], (0, 1), value=True), 0.0, shifted)
    state = v.new_zeros(v.shape[0], heads, n, v.shape[-1])
    outputs = []
    for t in range(length):
        if starts[t]:
            state = torch.zeros_like(state)
        entering = adt[:, :, t].exp()[..., None, None] * state
        q_t, k_t, x_t = q[:, t], k[:, t], x[:, t]
        own = torch.einsum("bihn,bjhn,bjhp->bihp", q_t, k_t, x_t) * gamma[:, None, :, t, None]
        outputs.append(torch.einsum("brhn,bhnp->brhp", q_t, entering) + own
                       + D[:, None] * x_t)
        written = torch.einsum("brhn,brhp->bhnp", k_t, x_t)
        state = entering + (gamma[:, :, t] + shifted[:, :, t])[..., None, None] * written
    out = torch.stack(outputs, 1)
    if z is not None:
        out = out * F.silu(z[:, :, None] * mimo_z.transpose(0, 1))
    if mimo_o is not None:
        out = (out * mimo_o.transpose(0, 1)).sum(2)
    return out


def _forward(q, k, v, q_bias, k_bias, mimo_v, mimo_o, z, D, mimo_z, angles, dA_cs, dt, trap,
             chunk_size, rotary_dim_divisor, dtype, cu_seqlens):
    starts = _sequence_starts(q.shape[1], cu_seqlens, q.device)
    inputs = [None if tensor is None else tensor.double() for tensor in (
        q, k, v, q_bias, k_bias, mimo_v, mimo_o, z, D, mimo_z, angles,
        _log_decays(dA_cs, starts, chunk_size), dt, trap)]
    out = _outputs(*inputs, starts, rotary_dim_divisor)
    return out.to(dtype), None, None


def mamba_mimo_forward(q, k, v, q_bias, k_bias, mimo_v, mimo_o, z, D, mimo_z, angles, dA_cs,
                       dA_cs_rev, dt, trap, segsum, chunk_size, rotary_dim_divisor, dtype,
                       return_state=False, threads=128, num_stages=0):
    assert not return_state, "the stand-in computes no final state"
    return _forward(q, k, v, q_bias, k_bias, mimo_v, mimo_o, z, D, mimo_z, angles, dA_cs, dt,
                    trap, chunk_size, rotary_dim_divisor, dtype, None)


def mamba_mimo_forward_varlen(q, k, v, q_bias, k_bias, mimo_v, mimo_o, z, D, mimo_z, angles,
                              dA_cs, dA_cs_rev, dt, trap, segsum, chunk_size,
                              rotary_dim_divisor, dtype, cu_seqlens=None, return_state=False,
                              threads=128, num_stages=0):
    assert not return_state, "the stand-in computes no final state"
    return _forward(q, k, v, q_bias, k_bias, mimo_v, mimo_o, z, D, mimo_z, angles, dA_cs, dt,
                    trap, chunk_size, rotary_dim_divisor, dtype, cu_seqlens)


def _gradients(outputs, leaves: list, dout: torch.Tensor) -> tuple:
    """autograd's gradients of (outputs(*leaves) * dout).sum(), in a thread of its own: a custom
    op's implementation runs below autograd, and under the caller's dispatch modes (tests
    count ops), and both are per thread."""
    def run():
        values = [leaf.detach().requires_grad_() for leaf in leaves]
        return torch.autograd.grad(outputs(*values), values, dout)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(run).result()


def _backward(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, z, mimo_z, angles, dA_cs, dt,
              trap, D, chunk_size, rotary_dim_divisor, cu_seqlens):
    groups, heads = q.shape[3], v.shape[2]
    if groups not in (1, heads):
        raise ValueError(f"G value of {groups} is not currently supported!")
    starts = _sequence_starts(q.shape[1], cu_seqlens, q.device)
    given = dict(q=q, k=k, v=v, q_bias=q_bias, k_bias=k_bias, mimo_v=mimo_v, mimo_o=mimo_o,
                 z=z, D=D, mimo_z=mimo_z, angles=angles,
                 adt=_log_decays(dA_cs, starts, chunk_size), dt=dt, trap=trap)
    if z is None:  # mimo_z is then unused and gets no gradient, as in the kernels
        given["mimo_z"] = None
    leaves = {name: tensor.double() for name, tensor in given.items() if tensor is not None}

    def outputs(*values):
        inputs = {**dict.fromkeys(given), **dict(zip(leaves, values, strict=True))}
        inputs["mimo_z"] = inputs["mimo_z"] if z is not None else mimo_z.double()
        return _outputs(*inputs.values(), starts, rotary_dim_divisor)

    grads = dict(zip(leaves, _gradients(outputs, list(leaves.values()), dout.double()),
                     strict=True))

    def grad(name, dtype):
        return grads[name].to(dtype) if name in grads else None

    return (grad("q", q.dtype), grad("k", k.dtype), grad("v", v.dtype),
            grad("adt", torch.float32), grad("dt", dt.dtype), grad("trap", trap.dtype),
            grad("q_bias", q.dtype), grad("k_bias", k.dtype), grad("mimo_v", mimo_v.dtype),
            grad("mimo_z", mimo_v.dtype), grad("mimo_o", mimo_v.dtype),
            grad("angles", angles.dtype), grad("D", D.dtype), grad("z", v.dtype))


def mamba_mimo_bwd_combined(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, z, mimo_z, angles,
                            dA_cs, dA_cs_rev, dt, trap, D, segsum, chunk_size,
                            rotary_dim_divisor, dtype, bf_threads=128, bf_num_stages=0,
                            bb_threads=256, bb_num_stages=0):
    return _backward(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, z, mimo_z, angles, dA_cs,
                     dt, trap, D, chunk_size, rotary_dim_divisor, None)


def mamba_mimo_bwd_combined_varlen(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, z, mimo_z,
                                   angles, dA_cs, dA_cs_rev, dt, trap, D, segsum, chunk_size,
                                   rotary_dim_divisor, dtype, cu_seqlens=None, bf_threads=128,
                                   bf_num_stages=0, bb_threads=256, bb_num_stages=0):
    return _backward(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, z, mimo_z, angles, dA_cs,
                     dt, trap, D, chunk_size, rotary_dim_divisor, cu_seqlens)

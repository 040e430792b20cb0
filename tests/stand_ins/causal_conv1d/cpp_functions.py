"""causal-conv1d 1.7's `causal_conv1d_fwd_function` / `causal_conv1d_bwd_function` signatures,
computed with explicit per-tap loops over [b, c, t] tensors (no initial / final states, which
titan_hybrid never passes). `calls` counts the invocations, so a test can prove the kernel path
ran."""

import torch
import torch.nn.functional as F

calls = {"fwd": 0, "bwd": 0}


def _same_document(seq_idx, shift, length):
    if seq_idx is None:
        return 1.0
    return (seq_idx[:, shift:] == seq_idx[:, :length - shift]).unsqueeze(1)


def _pre_activation(x, weight, bias, seq_idx):
    width, length = weight.shape[1], x.shape[2]
    pre = torch.zeros(x.shape, dtype=torch.float32)
    for shift in range(min(width, length)):
        tap = weight[:, width - 1 - shift].float()[None, :, None]
        pre[:, :, shift:] += tap * x[:, :, :length - shift].float() * _same_document(
            seq_idx, shift, length)
    if bias is not None:
        pre += bias.float()[None, :, None]
    return pre


def causal_conv1d_fwd_function(x, weight, bias, seq_idx, initial_states, final_states_out,
                               silu_activation):
    assert initial_states is None and final_states_out is None
    assert x.stride(1) == 1, "channels-last input expected"
    calls["fwd"] += 1
    pre = _pre_activation(x, weight, bias, seq_idx)
    out = F.silu(pre) if silu_activation else pre
    return out.to(x.dtype).transpose(1, 2).contiguous().transpose(1, 2)


def causal_conv1d_bwd_function(x, weight, bias, dout, seq_idx, initial_states, dfinal_states,
                               dx, return_dinitial_states, silu_activation):
    assert not return_dinitial_states
    dx_out = dx  # like the kernel, the input gradient is written into `dx` when given
    calls["bwd"] += 1
    width, length = weight.shape[1], x.shape[2]
    dpre = dout.float()
    if silu_activation:
        sig = torch.sigmoid(_pre_activation(x, weight, bias, seq_idx))
        dpre = dpre * sig * (1 + _pre_activation(x, weight, bias, seq_idx) * (1 - sig))
    dx = torch.zeros(x.shape, dtype=torch.float32)
    dweight = torch.zeros(weight.shape, dtype=torch.float32)
    for shift in range(min(width, length)):
        masked = dpre[:, :, shift:] * _same_document(seq_idx, shift, length)
        dx[:, :, :length - shift] += masked * weight[:, width - 1 - shift].float()[None, :, None]
        dweight[:, width - 1 - shift] = (masked * x[:, :, :length - shift].float()).sum((0, 2))
    dbias = None if bias is None else dpre.sum((0, 2)).to(bias.dtype)
    dx = dx.to(x.dtype).transpose(1, 2).contiguous().transpose(1, 2)
    if dx_out is not None:
        dx = dx_out.copy_(dx)
    return dx, dweight.to(weight.dtype), dbias, None

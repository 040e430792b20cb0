"""Causal depthwise 1-D convolution over the time axis, with packed-document masking.

x `[b, t, c]` (channels last, as the mixers produce it), weight `[c, w]`, bias `[c]`,
seq_idx `[b, t]` (document id per position; taps never reach into an earlier document).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _causal_conv1d_cuda(x_BTC, weight_CW, bias_C, seq_idx_BT, activation):
    channels, width = weight_CW.shape
    # The kernel's channel-last path needs 8-aligned strides and widths 2..4.
    if channels % 8 or not 2 <= width <= 4:
        return None
    try:
        from causal_conv1d import causal_conv1d_fn
    except ImportError:
        return None
    x_BTC = x_BTC.contiguous()  # slices of in_proj's output have a row stride of its width
    out = causal_conv1d_fn(x_BTC.transpose(1, 2), weight_CW, bias_C,
                           seq_idx=None if seq_idx_BT is None else seq_idx_BT.to(torch.int32),
                           activation=activation)
    return out.transpose(1, 2)


def causal_depthwise_conv1d(
    x_BTC: torch.Tensor,
    weight_CW: torch.Tensor,
    bias_C: torch.Tensor | None = None,
    *,
    seq_idx: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    if x_BTC.is_cuda:
        out = _causal_conv1d_cuda(x_BTC, weight_CW, bias_C, seq_idx, activation)
        if out is not None:
            return out
    return causal_depthwise_conv1d_torch(x_BTC, weight_CW, bias_C, seq_idx=seq_idx,
                                         activation=activation)


def causal_depthwise_conv1d_torch(x_BTC, weight_CW, bias_C=None, *, seq_idx=None,
                                  activation=None):
    # The weights may be fp32 while x is bf16 (a mixer whose SSM parameters data parallelism
    # keeps in fp32 keeps its conv there too); compute in x's dtype, as a bf16 layer does.
    weight_CW = weight_CW.to(x_BTC.dtype)
    bias_C = None if bias_C is None else bias_C.to(x_BTC.dtype)
    width = weight_CW.shape[-1]
    if seq_idx is None:
        out = F.conv1d(x_BTC.transpose(1, 2), weight_CW.unsqueeze(1), bias_C,
                       padding=width - 1, groups=x_BTC.shape[-1])
        out = out[..., : x_BTC.shape[1]].transpose(1, 2)
    else:
        # Sum of shifted copies: tap s reads position t-s only when it is in the same document.
        length = x_BTC.shape[1]
        out = x_BTC * weight_CW[:, width - 1]
        for shift in range(1, min(width, length)):
            same_doc = (seq_idx[:, shift:] == seq_idx[:, :-shift]).unsqueeze(-1)
            tap = x_BTC[:, :-shift] * weight_CW[:, width - 1 - shift] * same_doc
            out = out + F.pad(tap, (0, 0, shift, 0))
        if bias_C is not None:
            out = out + bias_C
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"activation '{activation}' is not 'silu' or None")
    return out

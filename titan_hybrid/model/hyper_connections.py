"""Manifold-constrained hyper-connections (mHC; DeepSeek-V4, Megatron-LM's HybridModel): the
residual stream is N parallel streams [B, T, N, D] instead of one.

Around each physical layer a HyperConnection reads the streams and computes, from their
flattened RMS-normed values through one learned projection `fn` (plus `base`, times the three
`scale`s):
- `pre` [B, T, N]: the weights that collapse the streams into the layer's input [B, T, D];
- `post` [B, T, N]: how the layer's output is written back into each stream;
- `comb` [B, T, N, N]: how the streams mix with each other, projected towards a doubly
  stochastic matrix by Sinkhorn steps (a row softmax, then alternating column and row
  normalisations, the last one over columns).

The new streams are `post[k] * out + sum_j comb[j, k] * h[j]`. The embedding enters as N copies,
and a HyperHead collapses the streams (its own `pre`) before the final norm.

This is transformers 5.24's DeepseekV4HyperConnection / DeepseekV4HyperHead computation, with
V4's parameter names (`fn`, `base`, `scale`; the head's `hc_fn`, `hc_base`, `hc_scale`). The
weights are computed in fp32 at least (in float64 for a float64 model), and `post` / `comb`
are cast to the streams' dtype before they mix them, as transformers and Megatron do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_hybrid.model.common import upcast


def mixing_flops(dim: int, streams: int) -> int:
    """Forward FLOPs per token of one hyper-connection beyond its `fn` matmul (which the 6N
    count holds as a weight): the streams' mix (comb^T h), the collapse (pre h) and the write
    of the layer's output (post * out, added)."""
    return 2 * streams * streams * dim + 2 * streams * dim + 2 * streams * dim


def expand_streams(h_BTD: torch.Tensor, streams: int) -> torch.Tensor:
    """The embedding as `streams` identical copies [B, T, N, D]."""
    return h_BTD.unsqueeze(2).expand(-1, -1, streams, -1).contiguous()


def _normed_streams(h_BTND: torch.Tensor, eps: float) -> torch.Tensor:
    """The streams flattened to [B, T, N * D] and RMS-normed without a weight, in fp32 or
    wider."""
    return F.rms_norm(upcast(h_BTND.flatten(2)), (h_BTND.shape[2] * h_BTND.shape[3],), eps=eps)


def collapse(h_BTND: torch.Tensor, pre_BTN: torch.Tensor) -> torch.Tensor:
    """sum_k pre[k] * h[k] [B, T, D], in the weights' precision, cast to the streams' dtype."""
    return (pre_BTN.unsqueeze(-1) * h_BTND).sum(dim=2).to(h_BTND.dtype)


def sinkhorn(logits_BTNN: torch.Tensor, iterations: int, eps: float) -> torch.Tensor:
    """A row softmax projected towards a doubly stochastic matrix: a column normalisation,
    then `iterations - 1` rounds of rows then columns (each sum + eps)."""
    comb = torch.softmax(logits_BTNN, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iterations - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class HyperConnection(nn.Module):
    """The N-stream connection around one layer: `forward` gives the layer's input (and the
    weights `combine` writes its output back with)."""

    def __init__(self, dim: int, streams: int, *, sinkhorn_iters: int, eps: float,
                 norm_eps: float) -> None:
        super().__init__()
        self.streams, self.sinkhorn_iters, self.eps, self.norm_eps = (streams, sinkhorn_iters,
                                                                      eps, norm_eps)
        width = (2 + streams) * streams  # [pre (N) | post (N) | comb (N x N, row-major)]
        self.fn = nn.Parameter(torch.empty(width, streams * dim))
        self.base = nn.Parameter(torch.empty(width))
        self.scale = nn.Parameter(torch.empty(3))  # pre, post, comb

    def forward(self, h_BTND: torch.Tensor):
        """(the layer's input [B, T, D], post [B, T, N], comb [B, T, N, N])."""
        n = self.streams
        mixes = F.linear(_normed_streams(h_BTND, self.norm_eps), upcast(self.fn))
        scale, base = upcast(self.scale), upcast(self.base)
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * scale[0] + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
        comb = sinkhorn(comb_w.unflatten(-1, (n, n)) * scale[2] + comb_b.view(n, n),
                        self.sinkhorn_iters, self.eps)
        return collapse(h_BTND, pre), post, comb

    @staticmethod
    def combine(h_BTND: torch.Tensor, out_BTD: torch.Tensor, post_BTN: torch.Tensor,
                comb_BTNN: torch.Tensor) -> torch.Tensor:
        """The streams after the layer: post[k] * out + sum_j comb[j, k] * h[j]."""
        dtype = h_BTND.dtype
        written = post_BTN.to(dtype).unsqueeze(-1) * out_BTD.unsqueeze(2)
        return written + comb_BTNN.to(dtype).transpose(-1, -2) @ h_BTND

    def init_weights(self, *, init_std: float) -> None:
        """transformers' init: `fn` normal(0, init_std), `base` 0, `scale` 1."""
        nn.init.normal_(self.fn, std=init_std)
        nn.init.zeros_(self.base)
        nn.init.ones_(self.scale)


class HyperHead(nn.Module):
    """The streams collapsed into one [B, T, D] before the final norm, by learned `pre`
    weights."""

    def __init__(self, dim: int, streams: int, *, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(streams, streams * dim))
        self.hc_base = nn.Parameter(torch.empty(streams))
        self.hc_scale = nn.Parameter(torch.empty(1))

    def forward(self, h_BTND: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(_normed_streams(h_BTND, self.norm_eps), upcast(self.hc_fn))
        pre = torch.sigmoid(mixes * upcast(self.hc_scale) + upcast(self.hc_base)) + self.eps
        return collapse(h_BTND, pre)

    def init_weights(self, *, init_std: float) -> None:
        nn.init.normal_(self.hc_fn, std=init_std)
        nn.init.zeros_(self.hc_base)
        nn.init.ones_(self.hc_scale)

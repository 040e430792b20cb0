"""Rotary position embeddings: the cos / sin table and the rotation of channel pairs, shared by
every attention kind that rotates its queries and keys (attention, MLA, DSA, DeepSeek-V4's)."""

from __future__ import annotations

import torch

from titan_hybrid.model.common import upcast


def rotary_tables(*, head_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """[max_seq_len, head_dim // 2, 2] cos/sin table (fp32: angles of long positions need it)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rotary_pairs(x_BTHR: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                       interleaved: bool) -> torch.Tensor:
    """Rotate channel pairs (2i, 2i+1) in place (interleaved) or (i, i + R/2) by angle i."""
    x = upcast(x_BTHR)
    if interleaved:
        real, imag = x[..., 0::2], x[..., 1::2]
    else:
        real, imag = x.chunk(2, dim=-1)
    cos, sin = cos[:, :, None], sin[:, :, None]
    rotated = (real * cos - imag * sin, real * sin + imag * cos)
    if interleaved:
        return torch.stack(rotated, dim=-1).flatten(-2).type_as(x_BTHR)
    return torch.cat(rotated, dim=-1).type_as(x_BTHR)

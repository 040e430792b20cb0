"""RMS norms: the plain one, one across heads, Mamba2's gated grouped one and gated DeltaNet's
gated per-head one."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_hybrid.model.common import TensorParallelPartialSum, upcast
from titan_hybrid.ops.gated_norm import gated_group_rms_norm


class RMSNorm(nn.Module):
    """`zero_centered`: the scale is 1 + weight, the weight starting at 0 (Qwen3-Next /
    Qwen3.5's norms), so weight decay pulls the scale towards 1, not 0."""

    def __init__(self, dim: int, *, eps: float = 1e-5, zero_centered: bool = False) -> None:
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32: the mean of squares loses precision in bf16.
        normed = F.rms_norm(upcast(x), (x.shape[-1],), eps=self.eps)
        scale = upcast(self.weight) + 1 if self.zero_centered else upcast(self.weight)
        return (normed * scale).type_as(x)

    def init_weights(self) -> None:
        (nn.init.zeros_ if self.zero_centered else nn.init.ones_)(self.weight)


class AcrossHeadsRMSNorm(nn.Module):
    """RMS norm over all heads' channels of a projection, [B, T, heads, head_dim] (OLMo Hybrid's
    q / k norms, weight [heads * head_dim]). Under tensor parallelism a rank holds some heads:
    its sum of squares is marked for the TP plan to sum over the group, and the mean divides
    by the whole width."""

    def __init__(self, width: int, *, eps: float = 1e-5) -> None:
        super().__init__()
        self.width, self.eps = width, eps
        self.weight = nn.Parameter(torch.empty(width))
        self.sum_over_heads = TensorParallelPartialSum()

    def forward(self, x_BTHD: torch.Tensor) -> torch.Tensor:
        x = upcast(x_BTHD.flatten(-2))
        mean_square = self.sum_over_heads(x.square().sum(-1, keepdim=True)) / self.width
        normed = x * torch.rsqrt(mean_square + self.eps) * upcast(self.weight)
        return normed.type_as(x_BTHD).view_as(x_BTHD)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


class GatedGroupRMSNorm(nn.Module):
    """norm(y * silu(z)) with the RMS taken over groups of `group_size` channels; with
    `norm_before_gate`, norm(y) * silu(z) (Mamba-3's output norm, a group per head).

    Mamba2's norm: each group of channels (one per SSM group) is normalised on its own, so the
    result does not depend on how the channels are split across tensor-parallel ranks as long as
    a rank holds whole groups. Its weight is sharded with the channels, unlike ordinary norms.
    """

    def __init__(self, dim: int, *, group_size: int, eps: float = 1e-5,
                 norm_before_gate: bool = False) -> None:
        super().__init__()
        if dim % group_size != 0:
            raise ValueError(f"gated norm: dim {dim} is not a multiple of group_size {group_size}")
        self.group_size = group_size
        self.eps = eps
        self.norm_before_gate = norm_before_gate
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        # mamba_ssm's Triton kernel on CUDA, else the torch path (titan_hybrid.ops.gated_norm).
        return gated_group_rms_norm(y, z, self.weight, group_size=self.group_size, eps=self.eps,
                                    norm_before_gate=self.norm_before_gate)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


class HeadGatedRMSNorm(nn.Module):
    """Gated DeltaNet's output norm: rms_norm(o) * weight * silu(z), over each head's channels.

    The weight has one entry per head channel and is shared by all heads, so it stays replicated
    under tensor parallelism (its gradient must then be summed over the TP group).
    """

    def __init__(self, head_dim: int, *, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(head_dim))

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """o, z `[..., heads, head_dim]` (z may be a slice of a projection's output)."""
        heads, head_dim = o.shape[-2:]
        # mamba_ssm's kernel on CUDA (one group per head, norm before the gate), else the torch
        # path; the repeated weight's gradient sums back over the heads.
        weight = self.weight.expand(heads, head_dim).flatten()
        out = gated_group_rms_norm(o.flatten(-2), z.flatten(-2), weight,
                                   group_size=head_dim, eps=self.eps, norm_before_gate=True)
        return out.view(o.shape)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)

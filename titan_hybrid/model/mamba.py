"""Mamba2 mixer (Megatron / mamba_ssm layout).

in_proj: hidden -> [z | x | B | C | dt] (d_inner, d_inner, G*N, G*N, H), depthwise causal conv
over [x | B | C] then SiLU, SSD scan, gated grouped RMSNorm norm(y * silu(z)), out_proj.
Legend: B batch, T time, D hidden, H heads, P head dim, G groups, N state size.
"""

from __future__ import annotations


import torch
from torch import nn

from titan_hybrid.model.args import MambaArgs
from titan_hybrid.model.common import (
    annotate_tensor_parallel,
    init_depthwise_conv,
    init_linear,
    init_ssm_decay,
    upcast,
)
from titan_hybrid.model.norms import GatedGroupRMSNorm
from titan_hybrid.ops.conv import causal_depthwise_conv1d
from titan_hybrid.ops.ssd import mamba_chunk_scan_combined


class Mamba2Mixer(nn.Module):
    def __init__(self, *, dim: int, args: MambaArgs, norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.args = args
        self.d_inner = args.expand * dim
        self.n_heads = self.d_inner // args.head_dim
        group_state = args.n_groups * args.d_state
        in_parts = {".z": self.d_inner, ".x": self.d_inner, ".B": group_state,
                    ".C": group_state, ".dt": self.n_heads}
        conv_parts = {".x": self.d_inner, ".B": group_state, ".C": group_state}
        in_size, conv_size = sum(in_parts.values()), sum(conv_parts.values())

        self.in_proj = nn.Linear(dim, in_size, bias=False)
        self.conv1d = nn.Conv1d(conv_size, conv_size, args.conv_width, groups=conv_size,
                                bias=True)
        self.A_log = nn.Parameter(torch.empty(self.n_heads, dtype=torch.float32))
        self.D = nn.Parameter(torch.empty(self.n_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(self.n_heads))
        self.norm = GatedGroupRMSNorm(self.d_inner, group_size=self.d_inner // args.n_groups,
                                      eps=norm_eps)
        self.out_proj = nn.Linear(self.d_inner, dim, bias=False)

        # Every per-channel / per-head tensor is split with the heads under TP, including the
        # norm weight (a norm by name, but sharded).
        annotate_tensor_parallel(self.in_proj.weight, components=in_parts)
        annotate_tensor_parallel(self.out_proj.weight, partition_dim=1)
        annotate_tensor_parallel(self.conv1d.weight, components=conv_parts)
        annotate_tensor_parallel(self.conv1d.bias, components=conv_parts)
        for param in (self.A_log, self.D, self.dt_bias, self.norm.weight):
            annotate_tensor_parallel(param)

    def forward(self, x_BTD: torch.Tensor, seq_idx: torch.Tensor | None = None) -> torch.Tensor:
        args = self.args
        zxbcdt = self.in_proj(x_BTD)
        # Local sizes derive from the local tensors, so the same code runs on a TP shard.
        n_heads = self.A_log.shape[0]
        d_inner = n_heads * args.head_dim
        n_groups = n_heads * args.n_groups // self.n_heads
        z, xbc, dt = zxbcdt.split([d_inner, d_inner + 2 * n_groups * args.d_state, n_heads], -1)
        xbc = causal_depthwise_conv1d(xbc, self.conv1d.weight.squeeze(1), self.conv1d.bias,
                                      seq_idx=seq_idx, activation="silu")
        x, b, c = xbc.split([d_inner, n_groups * args.d_state, n_groups * args.d_state], -1)
        batch, seq_len, _ = x.shape
        y_BTHP = mamba_chunk_scan_combined(
            x.view(batch, seq_len, n_heads, args.head_dim),
            dt,
            -torch.exp(upcast(self.A_log)),
            b.view(batch, seq_len, n_groups, args.d_state),
            c.view(batch, seq_len, n_groups, args.d_state),
            args.chunk_size,
            D=self.D,
            dt_bias=self.dt_bias,
            seq_idx=seq_idx,
            dt_softplus=True,
            dt_limit=args.dt_limit,
        )
        y = self.norm(y_BTHP.reshape(batch, seq_len, d_inner), z)
        return self.out_proj(y)

    def init_weights(self, *, init_std: float, out_std: float) -> None:
        args = self.args
        init_linear(self.in_proj, std=init_std)
        init_linear(self.out_proj, std=out_std)
        init_depthwise_conv(self.conv1d)
        init_ssm_decay(self.A_log, self.dt_bias, a_range=args.a_init_range, dt_min=args.dt_min,
                       dt_max=args.dt_max, dt_floor=args.dt_init_floor)
        nn.init.ones_(self.D)
        self.norm.init_weights()

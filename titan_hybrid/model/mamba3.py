"""Mamba-3 mixer (arXiv 2603.15569; mamba_ssm 2.3.2.post1's `Mamba3`), what `M` builds with
`hybrid.m_layers = "mamba3"`. Parameter names and layouts are mamba_ssm's but for in_proj
(below), and its module's state dict loads as it is.

mamba_ssm's in_proj: hidden -> [z | x | B | C | dd_dt | dd_A | trap | angles] (d_inner, d_inner,
R*G*N, R*G*N, H, H, H, S), held here as two projections: in_proj [z | x | dd_dt | dd_A | trap],
the parts per head, which tensor parallelism splits with the heads, and bc_proj [B | C |
angles], which every head reads (replicated under TP); its state dicts load (their in_proj is
split on load). No conv. Per token and head: dt = softplus(dd_dt + dt_bias); A =
min(-softplus(dd_A), -A_floor) (a decay rate per token, no A_log); the trapezoid's weight
lam = sigmoid(trap); B and C RMS-normed over N (B_norm, C_norm, shared by groups and ranks),
plus per-head biases B_bias / C_bias [H, R, N], then rotated by the cumulative angle
theta_t = sum_{s <= t} tanh(angles_s) * pi * dt_s (the S angles shared by all heads, each head
scaling them by its dt; restarted at each document). SISO rotates interleaved pairs (2i, 2i+1),
MIMO half-split pairs (i, i + N/2), the first S pairs (rope_fraction 0.5: half of N; 1.0: all).
The scan (ops/mamba3_scan.py) with D; MIMO up-projects x by mimo_x [H, R, P] into R inputs and
reads R outputs. The output: y * silu(z) (SISO), or sum_r mimo_o[r] * o_r * silu(z * mimo_z[r])
(MIMO); with `outproj_norm`, a gated RMS norm per head (norm before the gate) in place of the
plain gate. Then out_proj.

On CUDA, where mamba_ssm is usable, SISO runs its Triton kernels (ops/mamba3_kernel.py: the
biases, angles, rotation and gate inside them), and MIMO its TileLang kernels where tilelang is
installed too (ops/mamba3_mimo_kernel.py: x's up-projection, the gate and read-out inside as
well), in bfloat16 as its module does; any other layer the torch path. What differs from
mamba_ssm's module: its kernels compute q, k, x, z (and SISO the angles) in bfloat16 whatever
the model's dtype; the torch path computes in float32. The angle's running sum is not taken
modulo 2 pi (the same rotation). mamba_ssm ignores unknown options and `seq_idx`; here packed
documents restart the state, the previous token's term and the angle, as its kernels do for
`cu_seqlens`.
Legend: B batch, T time, D hidden, H heads, P head dim, G groups, R rank, N state size, S angles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_hybrid.model.common import (
    REPLICATED_ON_LOCAL_SHARDS,
    TPLayout,
    init_dt_bias,
    init_linear,
    sharded,
    upcast,
)
from titan_hybrid.model.layer_kind import (
    GROUPS,
    HEADS,
    SHARED,
    ContextParallelRule,
    HeadChannels,
    LayerKind,
)
from titan_hybrid.model.layout import TokenLayout
from titan_hybrid.model.norms import GatedGroupRMSNorm, RMSNorm
from titan_hybrid.model.recurrent import TrapezoidalCore
from titan_hybrid.model.symbols import MIXER, LayerSymbol
from titan_hybrid.ops.gated_norm import gated_group_rms_norm
from titan_hybrid.ops.kernels import kernel_op_refused, request_kernel_package, use_kernel
from titan_hybrid.ops.mamba3_kernel import mamba3_siso
from titan_hybrid.ops.mamba3_mimo_kernel import mamba3_mimo
from titan_hybrid.ops.mamba3_scan import mamba3_scan

ROPE_FRACTIONS = (0.5, 1.0)
# The sizes mamba_ssm 2.3.2.post1 tested its MIMO TileLang kernels on (its mamba3_mimo warns
# outside them), and the (N, P) pairs it says fail to compile.
MIMO_KERNEL_STATE_SIZES = (16, 32, 64, 128, 256)
MIMO_KERNEL_HEAD_DIMS = (32, 64, 128)
MIMO_KERNEL_RANKS = (1, 2, 4, 8)
MIMO_KERNEL_FAILING_SIZES = ((16, 32), (256, 128))
NORM_EPS = 1e-5  # mamba_ssm's B / C norms and output norm


@dataclass
class Mamba3Args:
    d_state: int = 128
    head_dim: int = 64
    n_groups: int = 1
    expand: int = 2
    rope_fraction: float = 0.5  # the share of N that the angles rotate: 0.5 or 1.0
    mimo: bool = False  # MIMO: mimo_rank inputs and read-outs per head and token
    mimo_rank: int = 4
    a_floor: float = 1e-4  # A <= -a_floor
    outproj_norm: bool = False  # mamba_ssm's is_outproj_norm
    chunk_size: int = 64
    dt_min: float = 1e-3
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4

    def d_inner(self, dim: int) -> int:
        return self.expand * dim

    def n_heads(self, dim: int) -> int:
        return self.d_inner(dim) // self.head_dim

    def rank(self) -> int:
        return self.mimo_rank if self.mimo else 1

    def angles(self) -> int:
        """S, the angles per token (mamba_ssm's num_rope_angles)."""
        rotated = int(self.d_state * self.rope_fraction)
        return (rotated - rotated % 2) // 2

    def in_proj_sizes(self, dim: int) -> dict[str, int]:
        """mamba_ssm's fused in_proj, part by part, in its order."""
        inner, heads = self.d_inner(dim), self.n_heads(dim)
        bc = self.rank() * self.n_groups * self.d_state
        return {"z": inner, "x": inner, "b": bc, "c": bc, "dd_dt": heads, "dd_A": heads,
                "trap": heads, "angles": self.angles()}


# mamba_ssm's in_proj, split in two: the parts per head (split with the heads under TP) and the
# parts every head reads (B, C and the angles: replicated under TP).
PER_HEAD_PARTS = ("z", "x", "dd_dt", "dd_A", "trap")
SHARED_PARTS = ("b", "c", "angles")


def rotate(x_BTRHN: torch.Tensor, theta_BTHS: torch.Tensor, *, interleaved: bool) -> torch.Tensor:
    """The first S pairs of N rotated by theta (pairs (2i, 2i+1), or (i, i + N/2)); the other
    entries as they are."""
    angles = theta_BTHS.shape[-1]
    n = x_BTRHN.shape[-1]
    index = torch.arange(angles, device=x_BTRHN.device)
    first, second = (2 * index, 2 * index + 1) if interleaved else (index, index + n // 2)
    cos, sin = theta_BTHS.cos()[:, :, None], theta_BTHS.sin()[:, :, None]
    a, b = x_BTRHN[..., first], x_BTRHN[..., second]
    rotated = x_BTRHN.clone()
    rotated[..., first] = a * cos - b * sin
    rotated[..., second] = a * sin + b * cos
    return rotated


def cumulative_angles(step_BTHS: torch.Tensor, seq_idx: torch.Tensor | None) -> torch.Tensor:
    """theta_t = the sum of the steps from the document's first token to t."""
    theta = step_BTHS.cumsum(1)
    if seq_idx is None:
        return theta
    # subtract the running sum before each document's first token
    starts_BT = F.pad(seq_idx[:, 1:] != seq_idx[:, :-1], (1, 0), value=True)
    before_BTHS = F.pad(theta, (0, 0, 0, 0, 1, 0))[:, :-1] * starts_BT[..., None, None]
    # carry each document's offset forward: the last start at or before t
    start_position_BT = torch.where(starts_BT, torch.arange(seq_idx.shape[1],
                                                            device=seq_idx.device), 0)
    start_position_BT = start_position_BT.cummax(1).values
    offset = before_BTHS.gather(1, start_position_BT[..., None, None].expand_as(theta))
    return theta - offset


def _step_size(dd_dt_BTH: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    return F.softplus(upcast(dd_dt_BTH) + upcast(dt_bias))


class Mamba3Core(TrapezoidalCore):
    """Mamba-3's part that runs along time (model/recurrent.py's TrapezoidalCore): from the
    in-projection's per-head parts, the normed B / C and the angles to the gated output
    [B, T, H, P]. Every per-head parameter comes in as an argument (sliced with the heads
    under context parallelism's head exchange); sizes come from the tensors (TP / CP shards).
    Chunkwise CP calls `angles`, `entry_weights` and `scan` (the torch path) itself."""

    def forward(self, x_BTC, z_BTC, dd_dt_BTH, dd_A_BTH, trap_BTH, b_BTC, c_BTC, angles_BTS,
                dt_bias, B_bias, C_bias, D, mimo_x, mimo_z, mimo_o, norm_weight,
                layout: TokenLayout | None) -> torch.Tensor:
        seq_idx = None if layout is None else layout.seq_idx
        if not self.args.mimo and self.runs_kernel(x_BTC):
            return self._siso_kernel_path(x_BTC, z_BTC, dd_dt_BTH, dd_A_BTH, trap_BTH, b_BTC,
                                          c_BTC, angles_BTS, dt_bias, B_bias, C_bias, D,
                                          norm_weight, seq_idx)
        if self.args.mimo and self._mimo_kernel_takes(x_BTC, b_BTC, D, seq_idx) \
                and self.runs_kernel(x_BTC):
            return self._mimo_kernel_path(x_BTC, z_BTC, dd_dt_BTH, dd_A_BTH, trap_BTH, b_BTC,
                                          c_BTC, angles_BTS, dt_bias, B_bias, C_bias, D,
                                          mimo_x, mimo_z, mimo_o, norm_weight, seq_idx)
        theta_BTHS = self.angles(dd_dt_BTH, dt_bias, angles_BTS, seq_idx)
        return self.scan(x_BTC, z_BTC, dd_dt_BTH, dd_A_BTH, trap_BTH, b_BTC, c_BTC, dt_bias,
                         B_bias, C_bias, D, mimo_x, mimo_z, mimo_o, norm_weight, seq_idx,
                         theta_BTHS)

    def runs_kernel(self, x: torch.Tensor) -> bool:
        """Whether the layer may run mamba_ssm's kernels, on CUDA where they are usable: SISO
        its Triton kernels (ops/mamba3_kernel.py) with an even number of angles (their
        condition); MIMO its TileLang kernels (ops/mamba3_mimo_kernel.py: tilelang installed
        too), for the shapes `_mimo_kernel_takes`. Else the torch path."""
        args = self.args
        if args.mimo:
            return use_kernel(x, "mamba_ssm") and use_kernel(x, "tilelang")
        return (args.angles() % 2 == 0 and use_kernel(x, "mamba_ssm")
                and not kernel_op_refused("mamba3_siso_fwd"))

    def mimo_kernel_chunk(self) -> int:
        """The MIMO kernels' chunk: they hold chunk * R rows in shared memory, so chunks of
        64 / R tokens (mamba_ssm's recommendation), at most chunk_size, at least 8, a power of
        two (their decay sums' condition). The torch path's chunk stays chunk_size."""
        limit = max(8, min(self.args.chunk_size, 64 // self.args.rank()))
        return 1 << (limit.bit_length() - 1)

    def _mimo_kernel_takes(self, x_BTC, b_BTC, D, seq_idx) -> bool:
        """The shapes mamba_ssm's MIMO kernels compute right: the sizes it tested them on
        (MIMO_KERNEL_*: TileLang may fail to compile others mid-run), one group or one per head
        (their backward), and without documents a length that is a multiple of the chunk
        (their dense backward asserts it)."""
        args, heads = self.args, D.shape[0]
        groups = b_BTC.shape[-1] // (args.rank() * args.d_state)
        return (args.d_state in MIMO_KERNEL_STATE_SIZES and args.head_dim in MIMO_KERNEL_HEAD_DIMS
                and args.rank() in MIMO_KERNEL_RANKS
                and (args.d_state, args.head_dim) not in MIMO_KERNEL_FAILING_SIZES
                and groups in (1, heads)
                and (seq_idx is not None or x_BTC.shape[1] % self.mimo_kernel_chunk() == 0))

    def _steps(self, dd_dt_BTH, dd_A_BTH, dt_bias):
        """(dt, the log decay) per token and head."""
        dt_BTH = _step_size(dd_dt_BTH, dt_bias)
        log_decay_BTH = torch.clamp(-F.softplus(upcast(dd_A_BTH)), max=-self.args.a_floor)
        return dt_BTH, log_decay_BTH * dt_BTH

    def angles(self, dd_dt_BTH, dt_bias, angles_BTS, seq_idx):
        """theta [B, T, H, S]: tanh(angles) * pi * dt summed from each document's start."""
        dt_BTH = _step_size(dd_dt_BTH, dt_bias)
        step_BTHS = torch.tanh(upcast(angles_BTS))[:, :, None] * math.pi * dt_BTH[..., None]
        return cumulative_angles(step_BTHS, seq_idx)

    def entry_weights(self, dd_dt_BTH, dd_A_BTH, trap_BTH, dt_bias):
        dt_BTH, log_decay_BTH = self._steps(dd_dt_BTH, dd_A_BTH, dt_bias)
        return log_decay_BTH, (1 - torch.sigmoid(upcast(trap_BTH[:, 0]))) * dt_BTH[:, 0]

    def _siso_kernel_path(self, x_BTC, z_BTC, dd_dt_BTH, dd_A_BTH, trap_BTH, b_BTC, c_BTC,
                          angles_BTS, dt_bias, B_bias, C_bias, D, norm_weight, seq_idx):
        """mamba_ssm's SISO kernels: the biases, the angles, the rotation and (without the
        output norm) the gate inside them."""
        args = self.args
        b, t, _ = x_BTC.shape
        heads, p = D.shape[0], args.head_dim
        dt_BTH, log_decay_BTH = self._steps(dd_dt_BTH, dd_A_BTH, dt_bias)
        x_BTHP, z_BTHP = x_BTC.view(b, t, heads, p), z_BTC.view(b, t, heads, p)
        B, C = (bc.view(b, t, -1, args.d_state) for bc in (b_BTC, c_BTC))  # [B, T, G, N]
        y_BTHP = mamba3_siso(C, B, x_BTHP, log_decay_BTH, dt_BTH, trap_BTH, C_bias[:, 0],
                             B_bias[:, 0], angles_BTS, D,
                             None if args.outproj_norm else z_BTHP, seq_idx, args.chunk_size)
        if args.outproj_norm:
            y_BTHP = self._gated_norm(y_BTHP, z_BTHP, norm_weight)
        return y_BTHP

    def _mimo_kernel_path(self, x_BTC, z_BTC, dd_dt_BTH, dd_A_BTH, trap_BTH, b_BTC, c_BTC,
                          angles_BTS, dt_bias, B_bias, C_bias, D, mimo_x, mimo_z, mimo_o,
                          norm_weight, seq_idx):
        """mamba_ssm's MIMO kernels: the biases, the angles, the rotation, x's up-projection
        and (without the output norm) the gate and read-out inside them; with it, the kernels
        return each rank's output and the norm, gate and read-out follow here, as in its
        module."""
        args = self.args
        b, t, _ = x_BTC.shape
        heads, rank, p = D.shape[0], args.rank(), args.head_dim
        dt_BTH, log_decay_BTH = self._steps(dd_dt_BTH, dd_A_BTH, dt_bias)
        x_BTHP, z_BTHP = x_BTC.view(b, t, heads, p), z_BTC.view(b, t, heads, p)
        B, C = (bc.view(b, t, rank, -1, args.d_state) for bc in (b_BTC, c_BTC))
        norm = args.outproj_norm
        y = mamba3_mimo(C, B, x_BTHP, log_decay_BTH, dt_BTH, trap_BTH, C_bias, B_bias, mimo_x,
                        mimo_z, None if norm else mimo_o, angles_BTS, D,
                        None if norm else z_BTHP, seq_idx, self.mimo_kernel_chunk(),
                        round(2 / args.rope_fraction))
        if not norm:
            return y
        z_BTRHP = upcast(z_BTHP)[:, :, None] * upcast(mimo_z).transpose(0, 1)
        y_BTRHP = self._gated_norm(y, z_BTRHP, norm_weight)
        return (y_BTRHP * upcast(mimo_o).transpose(0, 1)).sum(2)

    def _gated_norm(self, y, z, norm_weight):
        """The output norm per head, before the gate (mamba_ssm's is_outproj_norm)."""
        return gated_group_rms_norm(y.flatten(-2), z.flatten(-2), norm_weight,
                                    group_size=self.args.head_dim, eps=NORM_EPS,
                                    norm_before_gate=True).view_as(y)

    def scan(self, x_BTC, z_BTC, dd_dt_BTH, dd_A_BTH, trap_BTH, b_BTC, c_BTC, dt_bias, B_bias,
             C_bias, D, mimo_x, mimo_z, mimo_o, norm_weight, seq_idx, theta_BTHS,
             initial_state=None, return_final_state=False):
        """The torch path: ops/mamba3_scan.py, with the biases, the rotation by theta and the
        gates around it."""
        args = self.args
        b, t, _ = x_BTC.shape
        heads, rank, p, n = D.shape[0], args.rank(), args.head_dim, args.d_state
        dt_BTH, log_decay_BTH = self._steps(dd_dt_BTH, dd_A_BTH, dt_bias)

        def per_head(bc_BTC, bias):  # -> biased, rotated [B, T, R, H, N]
            normed = upcast(bc_BTC).view(b, t, rank, -1, n)
            normed = normed.repeat_interleave(heads // normed.shape[3], dim=3)
            return rotate(normed + upcast(bias).transpose(0, 1), theta_BTHS,
                          interleaved=not args.mimo)

        x_BTRHP = upcast(x_BTC).view(b, t, 1, heads, p)
        z_BTRHP = upcast(z_BTC).view(b, t, 1, heads, p)
        if args.mimo:
            x_BTRHP = x_BTRHP * upcast(mimo_x).transpose(0, 1)
            z_BTRHP = z_BTRHP * upcast(mimo_z).transpose(0, 1)
        scanned = mamba3_scan(x_BTRHP, per_head(c_BTC, C_bias), per_head(b_BTC, B_bias),
                              dt_BTH, log_decay_BTH, torch.sigmoid(upcast(trap_BTH)), D,
                              args.chunk_size, seq_idx_BT=seq_idx, initial_state=initial_state,
                              return_final_state=return_final_state)
        o_BTRHP, final = scanned if return_final_state else (scanned, None)
        y_BTRHP = (self._gated_norm(o_BTRHP, z_BTRHP, norm_weight) if args.outproj_norm
                   else o_BTRHP * F.silu(z_BTRHP))
        y_BTHP = ((y_BTRHP * upcast(mimo_o).transpose(0, 1)).sum(2) if args.mimo
                  else y_BTRHP[:, :, 0])
        return (y_BTHP, final) if return_final_state else y_BTHP


def _split_mamba_ssms_in_proj(mixer: "Mamba3Mixer", state_dict, prefix, *_) -> None:
    """A load_state_dict pre-hook: a state dict of mamba_ssm's module holds one in_proj [z | x |
    B | C | dd_dt | dd_A | trap | angles], whose rows go to the mixer's in_proj and bc_proj."""
    fused = state_dict.get(prefix + "in_proj.weight")
    sizes = mixer.args.in_proj_sizes(mixer.in_proj.in_features)
    if (prefix + "bc_proj.weight" in state_dict or fused is None
            or fused.shape[0] != sum(sizes.values())):
        return
    parts = dict(zip(sizes, fused.split(list(sizes.values())), strict=True))
    state_dict[prefix + "in_proj.weight"] = torch.cat([parts[p] for p in PER_HEAD_PARTS])
    state_dict[prefix + "bc_proj.weight"] = torch.cat([parts[p] for p in SHARED_PARTS])


class Mamba3Mixer(nn.Module):
    def __init__(self, *, dim: int, args: Mamba3Args) -> None:
        super().__init__()
        self.args = args
        heads, rank, state = args.n_heads(dim), args.rank(), args.d_state
        sizes = args.in_proj_sizes(dim)
        self.in_proj_parts = {part: sizes[part] for part in PER_HEAD_PARTS}
        self.in_proj = nn.Linear(dim, sum(self.in_proj_parts.values()), bias=False)
        self.bc_proj = nn.Linear(dim, sum(sizes[part] for part in SHARED_PARTS), bias=False)
        self.register_load_state_dict_pre_hook(_split_mamba_ssms_in_proj)
        self.dt_bias = nn.Parameter(torch.empty(heads, dtype=torch.float32))
        self.B_bias = nn.Parameter(torch.empty(heads, rank, state, dtype=torch.float32))
        self.C_bias = nn.Parameter(torch.empty(heads, rank, state, dtype=torch.float32))
        if args.mimo:  # the inputs' up-projection, the gate's and the output's scales
            self.mimo_x = nn.Parameter(torch.empty(heads, rank, args.head_dim))
            self.mimo_z = nn.Parameter(torch.empty(heads, rank, args.head_dim))
            self.mimo_o = nn.Parameter(torch.empty(heads, rank, args.head_dim))
        self.D = nn.Parameter(torch.empty(heads, dtype=torch.float32))
        self.B_norm = RMSNorm(state, eps=NORM_EPS)
        self.C_norm = RMSNorm(state, eps=NORM_EPS)
        if args.outproj_norm:  # per head, the norm before the gate
            self.norm = GatedGroupRMSNorm(args.d_inner(dim), group_size=args.head_dim,
                                          eps=NORM_EPS, norm_before_gate=True)
        self.out_proj = nn.Linear(args.d_inner(dim), dim, bias=False)
        self.core = Mamba3Core(args)
        if args.mimo:  # its kernels' package is probed only for a model that calls it
            request_kernel_package("tilelang")

    def tensor_parallel_layouts(self) -> dict[str, TPLayout]:
        """The heads split; B, C and the angles, which every head reads, replicated (one group
        under TP: validate_tensor_parallel), as are their norms: each rank's heads use them, so
        their gradients are partial sums over the ranks."""
        per_head = ("dt_bias", "B_bias", "C_bias", "D") + (
            ("mimo_x", "mimo_z", "mimo_o") if self.args.mimo else ()) + (
            ("norm.weight",) if self.args.outproj_norm else ())
        shared = ("bc_proj.weight", "B_norm.weight", "C_norm.weight")
        return {"in_proj.weight": sharded(0, {f".{part}": size for part, size
                                              in self.in_proj_parts.items()}),
                "out_proj.weight": sharded(1), **{name: sharded(0) for name in per_head},
                **{name: REPLICATED_ON_LOCAL_SHARDS for name in shared}}

    def forward(self, x_BTD: torch.Tensor, layout: TokenLayout | None = None) -> torch.Tensor:
        args = self.args
        # local sizes from the local tensors: under TP each rank holds some of the heads
        heads, p = self.D.shape[0], args.head_dim
        z, x, dd_dt, dd_A, trap = self.in_proj(x_BTD).split(
            [heads * p, heads * p, heads, heads, heads], -1)
        group_states = args.rank() * args.n_groups * args.d_state
        B, C, angles = self.bc_proj(x_BTD).split([group_states, group_states, args.angles()],
                                                 -1)
        # the B / C norms over N, per token, rank and group (token-wise: before the core)
        B, C = (norm(bc.unflatten(-1, (-1, args.d_state))).flatten(-2)
                for bc, norm in ((B, self.B_norm), (C, self.C_norm)))
        mimo = [getattr(self, name, None) for name in ("mimo_x", "mimo_z", "mimo_o")]
        norm_weight = self.norm.weight if args.outproj_norm else None
        y_BTHP = self.core(x, z, dd_dt, dd_A, trap, B, C, angles, self.dt_bias, self.B_bias,
                           self.C_bias, self.D, *mimo, norm_weight, layout)
        return self.out_proj(y_BTHP.flatten(-2).type_as(x_BTD))

    def init_weights(self, *, init_std: float, out_std: float) -> None:
        """mamba_ssm's initialisation: dt_bias the inverse softplus of a log-uniform step,
        B_bias / C_bias / D / the norms ones, MIMO's x and output scales 1 / R, its gate
        scale 1."""
        args = self.args
        init_linear(self.in_proj, std=init_std)
        init_linear(self.bc_proj, std=init_std)
        init_linear(self.out_proj, std=out_std)
        init_dt_bias(self.dt_bias, dt_min=args.dt_min, dt_max=args.dt_max,
                     dt_floor=args.dt_init_floor)
        for parameter in (self.B_bias, self.C_bias, self.D):
            nn.init.ones_(parameter)
        if args.mimo:
            nn.init.constant_(self.mimo_x, 1 / args.mimo_rank)
            nn.init.ones_(self.mimo_z)
            nn.init.constant_(self.mimo_o, 1 / args.mimo_rank)
        for norm in (self.B_norm, self.C_norm, getattr(self, "norm", None)):
            if norm is not None:
                norm.init_weights()


def _validate(args: Mamba3Args, dim: int) -> None:
    for field in ("d_state", "head_dim", "n_groups", "expand", "mimo_rank", "chunk_size"):
        if getattr(args, field) < 1:
            raise ValueError(f"mamba3: {field}={getattr(args, field)} must be at least 1")
    if args.rope_fraction not in ROPE_FRACTIONS:
        raise ValueError(f"mamba3: rope_fraction={args.rope_fraction} must be 0.5 or 1.0 (as "
                         "mamba_ssm's)")
    if args.angles() < 1:
        raise ValueError(f"mamba3: d_state={args.d_state} with rope_fraction="
                         f"{args.rope_fraction} rotates no pair of state entries")
    if args.d_inner(dim) % args.head_dim:
        raise ValueError(f"mamba3: d_inner = expand*dim = {args.d_inner(dim)} is not divisible "
                         f"by mamba3.head_dim={args.head_dim}")
    if args.n_heads(dim) % args.n_groups:
        raise ValueError(f"mamba3: nheads={args.n_heads(dim)} is not divisible by "
                         f"mamba3.n_groups={args.n_groups} (each group must own whole heads)")
    if args.a_floor <= 0:
        raise ValueError(f"mamba3: a_floor={args.a_floor} must be > 0 (A <= -a_floor)")


def _validate_tensor_parallel(args: Mamba3Args) -> None:
    if args.n_groups != 1:
        raise ValueError(f"mamba3.n_groups={args.n_groups} with tensor parallelism: Mamba-3's "
                         "B / C projection is replicated on every TP rank, so all heads must "
                         "read one group (n_groups = 1)")


def _head_channels(args: Mamba3Args, tensors: dict) -> HeadChannels:
    """Mamba3Core's arguments by head: x, z and the per-head gate inputs, B / C by group (rank
    by rank: their channels are [R, G, N]), the angles whole to every rank; the per-head
    parameters sliced; absent options (MIMO's scales, the output norm's weight: None) whole."""
    heads, rank, n = tensors["dt_bias"].shape[0], args.rank(), args.d_state
    per_head, channels = ((1, HEADS),), ((args.head_dim, HEADS),)
    by_group = ((n, GROUPS),) * rank
    exchanged = {"x_BTC": channels, "z_BTC": channels, "dd_dt_BTH": per_head,
                 "dd_A_BTH": per_head, "trap_BTH": per_head, "b_BTC": by_group,
                 "c_BTC": by_group, "angles_BTS": ((args.angles(), SHARED),)}
    optional = {"mimo_x": per_head, "mimo_z": per_head, "mimo_o": per_head,
                "norm_weight": channels}
    sliced = {name: per_head for name in ("dt_bias", "B_bias", "C_bias", "D")}
    sliced.update({name: parts for name, parts in optional.items()
                   if tensors[name] is not None})
    return HeadChannels(heads, tensors["b_BTC"].shape[-1] // (rank * n), exchanged=exchanged,
                        sliced=sliced, whole=tuple(name for name in optional
                                                   if tensors[name] is None))


def _core_flops(args: Mamba3Args, dim: int, seq_len: int) -> int:
    """The chunked scan per head per token, forward (ops/mamba3_scan.py, the products torch's
    FLOP counter sees): within a chunk, the scores q k^T over R x R rank pairs (2 Q R^2 N) and
    their product with the inputs (2 Q R^2 P); the chunk's state from its inputs (2 R P N),
    the read-out of the entering state (2 R P N), and the token's own term (2 R^2 (N + P))."""
    chunk, rank = min(args.chunk_size, seq_len), args.rank()
    n, p = args.d_state, args.head_dim
    return args.n_heads(dim) * (2 * chunk * rank * rank * (n + p) + 4 * rank * p * n
                                + 2 * rank * rank * (n + p))


KIND = LayerKind(
    symbol="M", variant=LayerSymbol(symbol="M", name="mamba3", title="Mamba-3", namespace=MIXER),
    args_type=Mamba3Args,
    build=lambda args, dim, norm_eps: Mamba3Mixer(dim=dim, args=args),
    mixes_sequence=True, validate=_validate, core_flops=_core_flops,
    tensor_parallel_sizes=lambda args, dim: [("mamba3.nheads", args.n_heads(dim))],
    validate_tensor_parallel=_validate_tensor_parallel,
    full_precision_params=("dt_bias", "B_bias", "C_bias", "D", "mimo_x", "mimo_z", "mimo_o"),
    context_parallel=ContextParallelRule(
        core="core",
        head_groups=lambda args, dim: (("mamba3.nheads", args.n_heads(dim)),
                                       ("mamba3.n_groups", args.n_groups)),
        head_channels=_head_channels),
)

"""The Mamba-3 mixer (titan_hybrid/model/mamba3.py) against a float64 per-token reference of the
whole layer written from mamba_ssm 2.3.2.post1's module (its in_proj split, norms, biases,
rotation pairs, trapezoid, gates; the scan's per-token recurrence: test_mamba3_scan.py), with
every parameter perturbed: SISO, MIMO, the output norm, groups, both rope fractions, packed
documents. Its parameters carry mamba_ssm's names and shapes; its FLOPs are what torch's FLOP
counter sees; what tensor parallelism cannot split (groups) is refused by name."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from tests.unit.test_mamba3_scan import packed, recurrence
from titan_hybrid.config.sections import ParallelismSection, TrainingSection
from titan_hybrid.model.args import resolve_model_args
from titan_hybrid.model.layout import TokenLayout
from titan_hybrid.model.mamba3 import KIND, Mamba3Args, Mamba3Mixer
from titan_hybrid.parallel.validate import validate_context_parallel, validate_tensor_parallel

DIM, LENGTH = 32, 19
OPTIONS = {
    "siso": dict(),
    "siso-norm-groups-rope1": dict(outproj_norm=True, n_groups=2, rope_fraction=1.0),
    "mimo": dict(mimo=True, mimo_rank=4),
    "mimo-norm-groups": dict(mimo=True, mimo_rank=2, outproj_norm=True, n_groups=2),
}


def mixer_of(options: dict, seed: int = 0) -> Mamba3Mixer:
    torch.manual_seed(seed)
    mixer = Mamba3Mixer(dim=DIM, args=Mamba3Args(d_state=8, head_dim=8, chunk_size=4,
                                                 **options)).double()
    mixer.init_weights(init_std=0.2, out_std=0.2)
    with torch.no_grad():
        for parameter in mixer.parameters():  # every parameter away from its init
            parameter.add_(0.3 * torch.randn_like(parameter))
    return mixer


def mamba_ssms_in_proj(mixer: Mamba3Mixer) -> torch.Tensor:
    """mamba_ssm's fused in_proj [z | x | B | C | dd_dt | dd_A | trap | angles] of the mixer's
    two projections (in_proj: the per-head parts; bc_proj: B, C and the angles)."""
    sizes = mixer.args.in_proj_sizes(DIM)
    z, x, dd_dt, dd_a, trap = mixer.in_proj.weight.split(
        [sizes[part] for part in ("z", "x", "dd_dt", "dd_A", "trap")])
    b, c, angles = mixer.bc_proj.weight.split([sizes[part] for part in ("b", "c", "angles")])
    return torch.cat([z, x, b, c, dd_dt, dd_a, trap, angles])


def rms(x, weight):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight


def reference(mixer: Mamba3Mixer, u: torch.Tensor, seq_idx=None) -> torch.Tensor:
    """The layer token by token (mamba_ssm's module read with its kernels' step: the angle
    summed per token, each pair rotated explicitly)."""
    args = mixer.args
    b, length, _ = u.shape
    heads, rank, p, n, g = mixer.D.shape[0], args.rank(), args.head_dim, args.d_state, \
        args.n_groups
    angles = args.angles()
    z, x, B, C, dd_dt, dd_A, trap, angle = (u @ mamba_ssms_in_proj(mixer).T).split(
        list(args.in_proj_sizes(DIM).values()), -1)
    B = rms(B.view(b, length, rank, g, n), mixer.B_norm.weight)
    C = rms(C.view(b, length, rank, g, n), mixer.C_norm.weight)
    group = torch.arange(heads) // (heads // g)
    k = B[:, :, :, group] + mixer.B_bias.transpose(0, 1)  # [b, t, r, h, n]
    q = C[:, :, :, group] + mixer.C_bias.transpose(0, 1)
    dt = F.softplus(dd_dt + mixer.dt_bias)
    A = torch.minimum(-F.softplus(dd_A), torch.tensor(-args.a_floor, dtype=u.dtype))
    pairs = ([(2 * i, 2 * i + 1) for i in range(angles)] if not args.mimo
             else [(i, i + n // 2) for i in range(angles)])
    theta = torch.zeros(b, heads, angles, dtype=u.dtype)
    rotated_q, rotated_k = torch.zeros_like(q), torch.zeros_like(k)
    for t in range(length):
        if seq_idx is not None and t > 0:
            theta = theta * (seq_idx[:, t] == seq_idx[:, t - 1]).to(u.dtype)[:, None, None]
        theta = theta + torch.tanh(angle[:, t])[:, None, :] * math.pi * dt[:, t, :, None]
        for out, vec in ((rotated_q, q), (rotated_k, k)):
            out[:, t] = vec[:, t]
            for i, (first, second) in enumerate(pairs):
                cos, sin = theta[:, None, :, i].cos(), theta[:, None, :, i].sin()
                out[:, t, :, :, first] = vec[:, t, :, :, first] * cos - vec[:, t, :, :, second] * sin
                out[:, t, :, :, second] = vec[:, t, :, :, first] * sin + vec[:, t, :, :, second] * cos
    x = x.view(b, length, heads, p)
    xr = x[:, :, None] * mixer.mimo_x.transpose(0, 1) if args.mimo else x[:, :, None]
    o, _ = recurrence(xr, rotated_q, rotated_k, dt, A * dt, torch.sigmoid(trap), mixer.D,
                      seq_idx)
    z = z.view(b, length, 1, heads, p)
    if args.mimo:
        z = z * mixer.mimo_z.transpose(0, 1)
    if args.outproj_norm:
        y = rms(o, mixer.norm.weight.view(heads, p)) * F.silu(z)
    else:
        y = o * F.silu(z)
    y = (y * mixer.mimo_o.transpose(0, 1)).sum(2) if args.mimo else y[:, :, 0]
    return y.flatten(-2) @ mixer.out_proj.weight.T


@pytest.mark.parametrize("options", list(OPTIONS.values()), ids=list(OPTIONS))
@pytest.mark.parametrize("documents", [False, True], ids=["one-document", "documents"])
def test_the_mixer_is_the_per_token_layer(options, documents):
    mixer = mixer_of(options)
    u = torch.randn(2, LENGTH, DIM, dtype=torch.float64)
    seq_idx = packed(2, LENGTH) if documents else None
    layout = None if seq_idx is None else TokenLayout(positions=None, seq_idx=seq_idx)
    torch.testing.assert_close(mixer(u, layout), reference(mixer, u, seq_idx), rtol=1e-9,
                               atol=1e-9)


@pytest.mark.parametrize("options", [OPTIONS["siso"], OPTIONS["mimo"]], ids=["siso", "mimo"])
def test_packed_documents_are_each_document_alone(options):
    """A document's first token restarts the state, the previous token's term and the angle."""
    mixer = mixer_of(options)
    lengths = (5, 1, 12, 4)
    x = torch.randn(1, sum(lengths), DIM, dtype=torch.float64)
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    packed_run = mixer(x, TokenLayout(positions=None, seq_idx=seq_idx))
    alone = torch.cat([mixer(part) for part in x.split(lengths, 1)], 1)
    torch.testing.assert_close(packed_run, alone, rtol=1e-10, atol=1e-10)


def test_the_parameters_are_mamba_ssms_and_its_state_dict_loads():
    """mamba_ssm's Mamba3(d_model=32, d_state=8, headdim=8, is_mimo=True, mimo_rank=2,
    is_outproj_norm=True, ngroups=2): its state dict's names and shapes (its parameter list,
    modules/mamba3.py; d_in_proj = 2 d_inner + 2 R G N + 3 H + S), but for in_proj, held as
    two projections. Its state dict, one fused in_proj, loads into a mixer of other weights,
    which then computes the same output; a state dict of the mixer's own loads as it is."""
    mixer = mixer_of(OPTIONS["mimo-norm-groups"])
    heads, inner = 8, 64
    theirs = {**mixer.state_dict(), "in_proj.weight": mamba_ssms_in_proj(mixer)}
    del theirs["bc_proj.weight"]
    assert {name: tuple(t.shape) for name, t in theirs.items()} == {
        "dt_bias": (heads,), "B_bias": (heads, 2, 8), "C_bias": (heads, 2, 8),
        "mimo_x": (heads, 2, 8), "mimo_z": (heads, 2, 8), "mimo_o": (heads, 2, 8),
        "D": (heads,), "in_proj.weight": (2 * inner + 2 * 2 * 2 * 8 + 3 * heads + 2, DIM),
        "B_norm.weight": (8,), "C_norm.weight": (8,), "norm.weight": (inner,),
        "out_proj.weight": (DIM, inner)}
    u = torch.randn(2, LENGTH, DIM, dtype=torch.float64)
    for state_dict in (theirs, mixer.state_dict()):
        other = mixer_of(OPTIONS["mimo-norm-groups"], seed=1)
        assert not torch.equal(other(u), mixer(u))
        other.load_state_dict(state_dict, strict=True)
        assert torch.equal(other(u), mixer(u))


def test_mfu_counts_the_chunked_scans_products():
    """What torch's FLOP counter sees of a forward, less 2 x the weights per token, is the
    core's count; SISO's own-token term multiplies the inputs by a scalar per head (rank 1),
    which the counter does not count (2 P per head)."""
    for options in (OPTIONS["siso"], OPTIONS["mimo"]):
        mixer = mixer_of(options)
        x = torch.randn(2, 64, DIM, dtype=torch.float64)
        with FlopCounterMode(display=False) as counter:
            mixer(x)
        weights = sum(p.numel() for name, p in mixer.named_parameters()
                      if name.endswith("weight") and p.dim() > 1)
        core = counter.get_total_flops() / (2 * 64) - 2 * weights
        args = mixer.args
        elementwise = 0 if args.mimo else 2 * args.head_dim * args.n_heads(DIM)
        assert core + elementwise == KIND.core_flops(args, DIM, 64)


def test_a_bad_option_or_layout_is_refused_by_name():
    for options, message in (
            (dict(rope_fraction=0.25), "mamba3: rope_fraction=0.25 must be 0.5 or 1.0"),
            (dict(head_dim=24), "not divisible by mamba3.head_dim=24"),
            (dict(n_groups=3), "mamba3.n_groups=3"),
            (dict(d_state=2), "mamba3: d_state=2 with rope_fraction=0.5 rotates no pair")):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
            KIND.validate(Mamba3Args(**options), DIM)
    args = resolve_model_args("debug_mamba3", seq_len=64)
    validate_tensor_parallel(args, 2, seq_len=64, sequence_parallel=True)  # one group: taken
    with pytest.raises(ValueError, match=r"mamba3\.nheads=16 is not divisible by "
                                         r"parallelism\.tensor_parallel_degree=32"):
        validate_tensor_parallel(args, 32, seq_len=64, sequence_parallel=False)
    grouped = dataclasses.replace(args, mamba3=dataclasses.replace(args.mamba3, n_groups=2))
    with pytest.raises(ValueError, match=r"mamba3\.n_groups=2 with tensor parallelism: "
                                         r"Mamba-3's B / C projection is replicated"):
        validate_tensor_parallel(grouped, 2, seq_len=64, sequence_parallel=False)
    def context_parallel(mode: str) -> None:
        validate_context_parallel(args, ParallelismSection(context_parallel_degree=2,
                                                           context_parallel_linear_mode=mode),
                                  TrainingSection(seq_len=64))

    for mode in ("head_a2a", "chunkwise"):  # taken
        context_parallel(mode)

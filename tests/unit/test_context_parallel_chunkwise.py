"""Chunkwise state passing (parallel/context_parallel_chunkwise.py) in one process: with a
CP group of one rank, the rank holds both zigzag pieces (0 and 1) of every row, so the halo,
the summaries and their chaining all run, and the pieces' outputs must equal the
whole-sequence core. Float64 through the torch paths; through mamba_ssm's and fla's kernels
(Triton's interpreter) against the torch path. The multi-rank cases: tests/distributed/
test_context_parallel.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.triton_kernels import kernels_on
from titan_hybrid.model.args import GDNArgs, MambaArgs
from titan_hybrid.model.gdn import GatedDeltaNet
from titan_hybrid.model.kda import KDAArgs, KimiDeltaAttention
from titan_hybrid.model.layout import TokenLayout
from titan_hybrid.model.mamba import Mamba2Mixer
from titan_hybrid.model.mamba1 import Mamba1Args, Mamba1Mixer
from titan_hybrid.model.mamba3 import Mamba3Args, Mamba3Mixer
from titan_hybrid.parallel.context_parallel_chunkwise import STATE_PASSING, ZigzagPieces


@pytest.fixture(scope="module")
def one_rank_group():
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    if owned:
        dist.destroy_process_group()


def mamba_inputs(dtype, seq_len=48, seed=0):
    torch.manual_seed(seed)
    mixer = Mamba2Mixer(dim=32, args=MambaArgs(d_state=8, head_dim=8, n_groups=2,
                                                 chunk_size=8))
    with torch.no_grad():
        mixer.init_weights(init_std=0.5, out_std=0.5)
    mixer.to(dtype)
    xbc = torch.randn(2, seq_len, mixer.conv1d.weight.shape[0], dtype=dtype)
    dt = torch.randn(2, seq_len, mixer.n_heads, dtype=dtype)
    params = [mixer.conv1d.weight.squeeze(1).detach(), mixer.conv1d.bias.detach(),
              mixer.A_log.detach(), mixer.D.detach(), mixer.dt_bias.detach()]
    return mixer.conv_and_scan, [t.clone().requires_grad_() for t in (xbc, dt, *params)]


def outputs_and_grads(core, inputs, layout):
    """The output and the gradient of every input (None: an absent option, skipped)."""
    y = core(*inputs, layout)
    y.backward(torch.cos(torch.arange(y.numel(), dtype=y.dtype)).view_as(y))
    given = [t for t in inputs if t is not None]
    grads = [t.grad.clone() for t in given]
    for t in given:
        t.grad = None
    return [y.detach(), *grads]


# Row 0: documents start inside piece 0 (5), inside piece 1 (30) and exactly at its start
# (24, row 1); row 1 has one document crossing the pieces until 24.
SEQ_IDX = torch.tensor([[0] * 5 + [1] * 25 + [2] * 18, [0] * 24 + [1] * 24])


def gdn_inputs(dtype, seq_len=48, seed=0):
    torch.manual_seed(seed)
    mixer = GatedDeltaNet(dim=32, args=GDNArgs(key_head_dim=8, value_head_dim=8,
                                               n_key_heads=2, n_value_heads=4))
    with torch.no_grad():
        mixer.init_weights(init_std=0.5, out_std=0.5)
    mixer.to(dtype)
    qkv = torch.randn(2, seq_len, mixer.conv1d.weight.shape[0], dtype=dtype)
    alpha, beta = (torch.randn(2, seq_len, 4, dtype=dtype) for _ in range(2))
    params = [mixer.conv1d.weight.squeeze(1).detach(), mixer.A_log.detach(),
              mixer.dt_bias.detach()]
    return mixer.conv_and_delta_rule, [t.clone().requires_grad_()
                                       for t in (qkv, alpha, beta, *params)]


def kda_inputs(dtype, seq_len=48, seed=0):
    torch.manual_seed(seed)
    mixer = KimiDeltaAttention(dim=32, args=KDAArgs(head_dim=8, n_heads=4))
    with torch.no_grad():
        mixer.init_weights(init_std=0.5, out_std=0.5)
    mixer.to(dtype)
    qkv, f = torch.randn(2, seq_len, 96, dtype=dtype), torch.randn(2, seq_len, 32, dtype=dtype)
    beta = torch.randn(2, seq_len, 4, dtype=dtype)
    conv_weight = torch.cat([mixer.get_submodule(f"{name}_conv1d").weight for name in "qkv"])
    params = [conv_weight.squeeze(1).detach(), mixer.A_log.detach(), mixer.dt_bias.detach()]
    return mixer.conv_and_delta_rule, [t.clone().requires_grad_()
                                       for t in (qkv, f, beta, *params)]


def mamba1_inputs(dtype, seq_len=48, seed=0):
    torch.manual_seed(seed)
    mixer = Mamba1Mixer(dim=16, args=Mamba1Args(d_state=4, expand=2, dt_bc_norm="weighted"))
    with torch.no_grad():
        mixer.init_weights(init_std=0.5, out_std=0.5)
        for norm in (mixer.dt_layernorm, mixer.b_layernorm, mixer.c_layernorm):
            norm.weight.normal_(1, 0.2)
    mixer.to(dtype)
    x, z = (torch.randn(2, seq_len, 32, dtype=dtype) for _ in range(2))
    params = [mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, mixer.x_proj.weight.t(),
              mixer.dt_proj.weight, mixer.dt_proj.bias, mixer.A_log, mixer.D,
              mixer.dt_layernorm.weight, mixer.b_layernorm.weight, mixer.c_layernorm.weight]
    return mixer.core, [t.detach().clone().requires_grad_() for t in (x, z, *params)]


def mamba3_inputs(dtype, seq_len=48, seed=0, **options):
    """Mamba3Core's arguments (mamba3.py's mixer order), every parameter away from its init."""
    torch.manual_seed(seed)
    mixer = Mamba3Mixer(dim=32, args=Mamba3Args(d_state=8, head_dim=8, chunk_size=8, **options))
    with torch.no_grad():
        mixer.init_weights(init_std=0.5, out_std=0.5)
        for parameter in mixer.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    mixer.to(dtype)
    args = mixer.args
    heads, states = 8, args.rank() * args.n_groups * 8
    per_token = [torch.randn(2, seq_len, size, dtype=dtype)
                 for size in (64, 64, heads, heads, heads, states, states, args.angles())]
    params = [getattr(mixer, name, None) for name in (
        "dt_bias", "B_bias", "C_bias", "D", "mimo_x", "mimo_z", "mimo_o")]
    params.append(mixer.norm.weight if args.outproj_norm else None)
    return mixer.core, [None if t is None else t.detach().clone().requires_grad_()
                        for t in (*per_token, *params)]


MAMBA3 = ["y", "x", "z", "dd_dt", "dd_A", "trap", "b", "c", "angles", "dt_bias", "B_bias",
          "C_bias", "D"]


# Each kind: its inputs and the names of (output, *inputs). The wrapper is the one of the
# state passing its core declares (model/recurrent.py): KDA's transition is GDN's with a
# decay per key channel, the same wrapper.
KINDS = {
    "mamba": (mamba_inputs,
              ["y", "xbc", "dt", "conv_weight", "conv_bias", "A_log", "D", "dt_bias"]),
    "gdn": (gdn_inputs, ["o", "qkv", "alpha", "beta", "conv_weight", "A_log", "dt_bias"]),
    "kda": (kda_inputs, ["o", "qkv", "f", "beta", "conv_weight", "A_log", "dt_bias"]),
    "mamba1": (mamba1_inputs, ["y", "x", "z", "conv_weight", "conv_bias", "x_proj", "dt_proj",
                               "dt_proj_bias", "A_log", "D", "dt_norm", "b_norm", "c_norm"]),
    "mamba3": (mamba3_inputs, MAMBA3),
    "mamba3_mimo": (lambda dtype, **kw: mamba3_inputs(dtype, mimo=True, mimo_rank=2,
                                                      n_groups=2, outproj_norm=True, **kw),
                    [*MAMBA3, "mimo_x", "mimo_z", "mimo_o", "norm"]),
}


def chunkwise(core, group):
    return STATE_PASSING[core.state_passing](core, group)


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("kind", list(KINDS))
def test_two_pieces_with_state_passing_equal_the_whole_sequence_float64(one_rank_group, kind,
                                                                        documents):
    make_inputs, names = KINDS[kind]
    core, inputs = make_inputs(torch.float64)
    layout = TokenLayout(positions=None, seq_idx=SEQ_IDX if documents else None)
    want = outputs_and_grads(core, inputs, layout)
    got = outputs_and_grads(chunkwise(core, one_rank_group), inputs, layout)
    for name, a, b in zip(names, got, want, strict=True):
        assert (a - b).abs().max() <= 1e-12 * b.abs().max(), name


@pytest.mark.parametrize("broken", ["the angle restarts at each piece",
                                    "the last token's second share is dropped"])
def test_mamba3s_pieces_need_the_angle_and_the_last_tokens_share(one_rank_group, monkeypatch,
                                                                  broken):
    """What Mamba-3's state passing carries besides the state, each shown to matter: zeroing
    the angle entering a piece, or the last token's key and input entering the next piece,
    moves the pieces' outputs far from the whole sequence's."""
    core, inputs = mamba3_inputs(torch.float64)
    want = core(*inputs, None).detach()
    h_size = 8 * 8 * 8  # heads x head dim x state: the state entering is [h | k | x]
    original, calls = ZigzagPieces.incoming_states, []

    def incoming_states(self, *args):
        entering = original(self, *args)
        calls.append(entering)
        if broken.startswith("the angle") and len(calls) == 1:
            return torch.zeros_like(entering)
        if broken.startswith("the last token") and len(calls) == 2:
            return torch.cat((entering[:, :h_size], torch.zeros_like(entering[:, h_size:])), 1)
        return entering

    monkeypatch.setattr(ZigzagPieces, "incoming_states", incoming_states)
    got = chunkwise(core, one_rank_group)(*inputs, None).detach()
    assert len(calls) == 2 and calls[0].abs().max() > 0 and calls[1][:, h_size:].abs().max() > 0
    assert (got - want).abs().max() > 1e-2 * want.abs().max()


@pytest.mark.triton_interpreter
# (Mamba-3's pieces run its torch path: mamba_ssm's SISO kernels take no angle entering a piece)
@pytest.mark.parametrize("kind", [kind for kind in KINDS if not kind.startswith("mamba3")])
def test_state_passing_through_the_kernels_matches_the_torch_path(one_rank_group, kind):
    """The pieces' scans run in the kernels, with documents, against the whole-sequence torch
    path, float32: mamba_ssm's (final states out, and their gradient in), and fla's (the
    identity columns enter as initial states and leave as final states, with gradients)."""
    make_inputs, _ = KINDS[kind]
    core, inputs = make_inputs(torch.float32, seq_len=64)
    seq_idx = torch.tensor([[0] * 5 + [1] * 37 + [2] * 22, [0] * 32 + [1] * 32])
    layout = TokenLayout(positions=None, seq_idx=seq_idx)
    want = outputs_and_grads(core, inputs, layout)
    with kernels_on():
        got = outputs_and_grads(chunkwise(core, one_rank_group), inputs, layout)
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()

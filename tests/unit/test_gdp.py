"""The gated DeltaProduct mixer (model/gdp.py), what `M` builds under `m_layers = "gdp"`:

- against a float64 reference written from Megatron's GatedDeltaProductMixer: its fused
  `zVKQba` projection split in Megatron's order, a causal depthwise SiLU conv over [V | K | Q],
  the recurrence token by token and step by step, the gated group norm norm(o * silu(z)) and
  out_proj: the output and every parameter's gradient;
- packed documents give each document's output alone;
- `M` builds GDP only when the option says so, with Megatron's split-key names;
- MFU's core FLOPs are what torch's FLOP counter sees the op do, for GDN and for GDP.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from titan_hybrid.model.args import GDPArgs, hybrid_flavors
from titan_hybrid.model.gdp import KIND, GatedDeltaProductMixer
from titan_hybrid.model.layout import TokenLayout
from titan_hybrid.model.model import HybridModel

DIM, T = 24, 13
ARGS = GDPArgs(num_householder=3, d_state=8, head_dim=6, n_groups=2, num_heads=4)


def mixer(args: GDPArgs = ARGS, seed: int = 0) -> GatedDeltaProductMixer:
    torch.manual_seed(seed)
    layer = GatedDeltaProductMixer(dim=DIM, args=args).double()
    with torch.no_grad():
        layer.init_weights(init_std=0.2, out_std=0.2)
        for param in layer.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return layer


def reference(layer: GatedDeltaProductMixer, x_BTD: torch.Tensor) -> torch.Tensor:
    """Megatron's GDP forward, from its equations, in float64."""
    args, n = layer.args, layer.args.num_householder
    heads, groups, N, P = args.num_heads, args.n_groups, args.d_state, args.head_dim
    inner = heads * P
    zVKQba = x_BTD @ layer.in_proj.weight.T
    z, VKQ, b, a = zVKQba.split([inner, n * inner + (n + 1) * groups * N, n * heads, heads], -1)
    width = layer.conv1d.weight.shape[-1]
    VKQ = F.silu(F.conv1d(F.pad(VKQ.transpose(1, 2), (width - 1, 0)), layer.conv1d.weight,
                          groups=VKQ.shape[-1]).transpose(1, 2))
    V, K, Q = VKQ.split([n * inner, n * groups * N, groups * N], -1)
    V = V.unflatten(-1, (n, heads, P))
    K, Q = (x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6)  # fla's l2norm (Megatron)
            for x in (K.unflatten(-1, (n, groups, N)), Q.unflatten(-1, (groups, N))))
    beta = torch.sigmoid(b.unflatten(-1, (n, heads)))
    g = -torch.exp(layer.A_log) * F.softplus(a + layer.dt_bias)
    out = torch.zeros(x_BTD.shape[0], T, heads, P, dtype=torch.float64)
    for batch in range(x_BTD.shape[0]):
        for h in range(heads):
            group = h // (heads // groups)
            state = torch.zeros(N, P, dtype=torch.float64)
            for t in range(T):
                state = torch.exp(g[batch, t, h]) * state
                for j in range(n):
                    key = K[batch, t, j, group]
                    state = (state - beta[batch, t, j, h] * torch.outer(key, key @ state)
                             + beta[batch, t, j, h] * torch.outer(key, V[batch, t, j, h]))
                out[batch, t, h] = state.T @ Q[batch, t, group] * N ** -0.5
    y = out.flatten(-2) * F.silu(z)  # norm_before_gate=False: the gate first
    y = y.unflatten(-1, (groups, -1))
    y = (y * torch.rsqrt(y.square().mean(-1, keepdim=True) + args.norm_eps)).flatten(-2)
    return (y * layer.norm.weight) @ layer.out_proj.weight.T


def assert_mixer_is_the_reference(ours, theirs, reference, x):
    """`ours(x)` equals `reference(theirs, x)` (two float64 copies of one mixer), and so does
    every parameter's gradient of one random projection of the output."""
    got, expected = ours(x), reference(theirs, x)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    weights = torch.randn_like(got)
    (got * weights).sum().backward()
    (expected * weights).sum().backward()
    for (name, mine), (_, reference_param) in zip(ours.named_parameters(),
                                                  theirs.named_parameters(), strict=True):
        torch.testing.assert_close(mine.grad, reference_param.grad, rtol=1e-9, atol=1e-11,
                                   msg=name)


def test_the_mixer_is_megatrons_gdp_forward_and_backward():
    x = torch.randn(2, T, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert_mixer_is_the_reference(mixer(), mixer(), reference, x)


def test_packed_documents_give_each_documents_output_alone():
    layer = mixer(seed=2)
    x = torch.randn(1, T, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    seq_idx = torch.tensor([[0] * 5 + [1] * 8])
    positions = torch.cat([torch.arange(5), torch.arange(8)])[None]
    packed = layer(x, TokenLayout(positions=positions, seq_idx=seq_idx))
    alone = torch.cat([layer(x[:, :5]), layer(x[:, 5:])], 1)
    torch.testing.assert_close(packed, alone, rtol=1e-10, atol=1e-12)


def test_m_builds_gdp_only_when_the_option_says_so():
    plain = HybridModel(dataclasses.replace(hybrid_flavors["debug"], dim=64))
    assert "layers.0.mamba.in_proj.weight_x" not in plain.state_dict()  # fused: one tensor
    assert type(plain.layers["0"].mixer).__name__ == "Mamba2Mixer"
    args = hybrid_flavors["debug_gdp"]
    model = HybridModel(args)
    assert type(model.layers["0"].mixer) is GatedDeltaProductMixer
    assert model.layers["0"].kind is KIND and KIND.name == "gdp"
    # Megatron's split keys of in_proj (zVKQba) and conv1d, in its order.
    assert list(model.layers["0"].mixer.fused_parts["in_proj.weight"]) == [
        ".z", ".V0", ".V1", ".K0", ".K1", ".Q", ".b0", ".b1", ".a"]
    assert list(model.layers["0"].mixer.fused_parts["conv1d.weight"]) == [
        ".V0", ".V1", ".K0", ".K1", ".Q"]
    with pytest.raises(ValueError,
                       match=r"^m_layers='gdn' is not one of \['mamba2', 'gdp', 'mamba1', 'mamba3'\]"):
        dataclasses.replace(args, m_layers="gdn").validate()
    with pytest.raises(ValueError, match=r"^gdp: num_householder=0 must be >= 1"):
        dataclasses.replace(args, gdp=GDPArgs(num_householder=0)).validate()
    from titan_hybrid.hf.families import check_hf_compatible

    with pytest.raises(ValueError, match=r"^gated DeltaProduct layers \(m_layers='gdp', "
                                         r"g_layers='gdn'\) are held by none of the Hugging"):
        check_hf_compatible(args)


@pytest.mark.parametrize("num_householder", [1, 2, 3])
def test_mfu_counts_what_the_op_computes(num_householder):
    """GDP's core FLOPs (and GDN's, at n = 1) are torch's FLOP counter's count of the op's
    forward per token."""
    from torch.utils.flop_counter import FlopCounterMode

    from titan_hybrid.model.gdn import KIND as GDN
    from titan_hybrid.model.gdn import GDNArgs
    from titan_hybrid.ops.gated_delta_product import chunk_gated_delta_product

    n, heads, key_dim, value_dim, tokens = num_householder, 2, 32, 16, 256
    q = torch.randn(1, tokens, heads, key_dim)
    k, v = torch.randn(1, tokens * n, heads, key_dim), torch.randn(1, tokens * n, heads, value_dim)
    g, beta = -torch.rand(1, tokens, heads), torch.rand(1, tokens * n, heads)
    with FlopCounterMode(display=False) as counter:
        chunk_gated_delta_product(q, k, v, g, beta, n, use_qk_l2norm_in_kernel=True)
    counted = counter.get_total_flops() / tokens
    args = GDPArgs(num_householder=n, d_state=key_dim, head_dim=value_dim, n_groups=heads,
                   num_heads=heads)
    assert KIND.core_flops(args, 64, tokens) == counted
    if n == 1:
        assert GDN.core_flops(GDNArgs(key_head_dim=key_dim, value_head_dim=value_dim,
                                      n_key_heads=heads, n_value_heads=heads), 64, tokens) == counted

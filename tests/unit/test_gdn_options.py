"""The gated DeltaNet's options for OLMo Hybrid against transformers' own layer
(OlmoHybridGatedDeltaNet): `gdn.allow_neg_eigval` (beta = 2 sigmoid(b), eigenvalues in
[-1, 1]) and `gdn.norm_eps` (its gated output norm's epsilon, 1e-5 there whatever the
model's). The same weights give the same output, and without the options ours differs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import OlmoHybridConfig
from transformers.models.olmo_hybrid.modeling_olmo_hybrid import OlmoHybridGatedDeltaNet

from titan_hybrid.model.gdn import GatedDeltaNet, GDNArgs

DIM, KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM = 32, 2, 4, 8, 12


def theirs_and_ours(args: GDNArgs, norm_eps: float):
    config = OlmoHybridConfig(hidden_size=DIM, num_attention_heads=4,
                              linear_num_key_heads=KEY_HEADS, linear_num_value_heads=VALUE_HEADS,
                              linear_key_head_dim=KEY_DIM, linear_value_head_dim=VALUE_DIM,
                              rms_norm_eps=norm_eps, num_hidden_layers=2,
                              layer_types=["linear_attention", "full_attention"])
    torch.manual_seed(0)
    theirs = OlmoHybridGatedDeltaNet(config, layer_idx=0).eval()
    with torch.no_grad():
        for param in theirs.parameters():
            param.add_(0.1 * torch.randn_like(param))
    ours = GatedDeltaNet(dim=DIM, args=args, norm_eps=norm_eps)
    with torch.no_grad():
        # Our in_proj is [q | k | v | z | beta | alpha]; theirs are separate projections.
        ours.in_proj.weight.copy_(torch.cat([theirs.q_proj.weight, theirs.k_proj.weight,
                                             theirs.v_proj.weight, theirs.g_proj.weight,
                                             theirs.b_proj.weight, theirs.a_proj.weight]))
        ours.conv1d.weight.copy_(theirs.conv1d.weight)
        ours.A_log.copy_(theirs.A_log)
        ours.dt_bias.copy_(theirs.dt_bias)
        ours.norm.weight.copy_(theirs.o_norm.weight)
        ours.out_proj.weight.copy_(theirs.o_proj.weight)
    return theirs, ours


@pytest.mark.parametrize("norm_eps", [1e-6, 0.3])  # 0.3: an epsilon large enough to show
def test_olmo_hybrid_gated_deltanet_options_match_transformers(norm_eps):
    args = GDNArgs(key_head_dim=KEY_DIM, value_head_dim=VALUE_DIM, n_key_heads=KEY_HEADS,
                   n_value_heads=VALUE_HEADS, allow_neg_eigval=True, norm_eps=1e-5)
    theirs, ours = theirs_and_ours(args, norm_eps)
    x = torch.randn(2, 24, DIM, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = theirs(x), ours(x)
    error = ((got - expected).norm() / expected.norm()).item()
    assert error <= 1e-5, error
    # Each option matters: without it the output moves.
    for change in (dict(allow_neg_eigval=False), dict(norm_eps=0.0)):
        if change == dict(norm_eps=0.0) and norm_eps == 1e-6:
            continue  # 1e-6 and 1e-5 round alike on these activations
        _, other = theirs_and_ours(dataclasses.replace(args, **change), norm_eps)
        with torch.no_grad():
            moved = ((other(x) - expected).norm() / expected.norm()).item()
        assert moved > 1e-3, (change, moved)

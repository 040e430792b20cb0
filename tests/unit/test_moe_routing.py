"""The MoE layer's routing and expert options against transformers' own MoE layers, on the same
weights: Nemotron 3's (squared-ReLU experts and shared expert, sigmoid scores with a
per-expert choice bias, group-limited routing, scaled and renormalised weights) and
DeepSeek-V3's (the same router over SwiGLU experts, SwiGLU shared experts)."""

from __future__ import annotations

import pytest
import torch
import transformers

from titan_hybrid.model.moe import MoE, MoEArgs

DIM, EXPERTS, HIDDEN = 32, 8, 16


def _perturbed(module: torch.nn.Module) -> None:
    torch.manual_seed(2)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            tensor.copy_(torch.randn_like(tensor) * 0.3)


def _outputs(ours: MoE, theirs: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(2, 24, DIM, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return ours(x)[0], theirs(x)


ROUTER = dict(score_func="sigmoid", score_correction_bias=True, n_group=2, topk_group=1,
              routed_scaling_factor=2.5, norm_topk_prob=True)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_nemotron_3_moe_matches_transformers(norm_topk_prob):
    config = transformers.NemotronHConfig(
        hidden_size=DIM, n_routed_experts=EXPERTS, num_experts_per_tok=2,
        moe_intermediate_size=HIDDEN, moe_shared_expert_intermediate_size=24, n_group=2,
        topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=norm_topk_prob,
        layers_block_type=["moe"])
    theirs = transformers.models.nemotron_h.modeling_nemotron_h.NemotronHMoE(config).eval()
    _perturbed(theirs)
    ours = MoE(dim=DIM, args=MoEArgs(num_experts=EXPERTS, top_k=2, hidden_dim=HIDDEN,
                                     shared_expert_hidden_dim=24, activation="relu2",
                                     **{**ROUTER, "norm_topk_prob": norm_topk_prob}))
    with torch.no_grad():
        ours.router.gate.weight.copy_(theirs.gate.weight)
        ours.router.e_score_correction_bias.copy_(theirs.gate.e_score_correction_bias)
        ours.experts.fc1.copy_(theirs.experts.up_proj)
        ours.experts.fc2.copy_(theirs.experts.down_proj)
        ours.shared_expert.fc1.weight.copy_(theirs.shared_experts.up_proj.weight)
        ours.shared_expert.fc2.weight.copy_(theirs.shared_experts.down_proj.weight)
    got, want = _outputs(ours, theirs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_deepseek_v3_moe_matches_transformers():
    config = transformers.DeepseekV3Config(
        hidden_size=DIM, n_routed_experts=EXPERTS, num_experts_per_tok=2,
        moe_intermediate_size=HIDDEN, n_shared_experts=2, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True)
    theirs = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE(config).eval()
    _perturbed(theirs)
    ours = MoE(dim=DIM, args=MoEArgs(num_experts=EXPERTS, top_k=2, hidden_dim=HIDDEN,
                                     shared_expert_hidden_dim=2 * HIDDEN, **ROUTER))
    with torch.no_grad():
        ours.router.gate.weight.copy_(theirs.gate.weight)
        ours.router.e_score_correction_bias.copy_(theirs.gate.e_score_correction_bias)
        ours.experts.fc1.copy_(theirs.experts.gate_up_proj)
        ours.experts.fc2.copy_(theirs.experts.down_proj)
        shared = theirs.shared_experts
        ours.shared_expert.fc1.weight.copy_(torch.cat((shared.gate_proj.weight,
                                                       shared.up_proj.weight)))
        ours.shared_expert.fc2.weight.copy_(shared.down_proj.weight)
    got, want = _outputs(ours, theirs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_group_limited_routing_keeps_each_token_in_its_best_groups():
    """With one group of four kept, every token's experts lie in the group whose two best
    biased scores sum highest."""
    args = MoEArgs(num_experts=EXPERTS, top_k=2, hidden_dim=HIDDEN, **ROUTER)
    ours = MoE(dim=DIM, args=args)
    _perturbed(ours)
    x = torch.randn(64, DIM, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, experts, _, _ = ours.router(x)
        choice = ours.router.gate(x).sigmoid() + ours.router.e_score_correction_bias
    best_group = choice.view(64, 2, 4).topk(2, dim=-1).values.sum(-1).argmax(-1)
    assert torch.equal(experts // 4, best_group[:, None].expand_as(experts))


@pytest.mark.parametrize("changes, message", [
    (dict(n_group=3), "n_group=3 must divide num_experts=8"),
    (dict(n_group=2, topk_group=3), "topk_group=3 must be in"),
    (dict(activation="gelu"), "activation 'gelu' is not"),
])
def test_routing_settings_that_cannot_work_are_named(changes, message):
    from titan_hybrid.model.moe import KIND

    with pytest.raises(ValueError, match=message):
        KIND.validate(MoEArgs(num_experts=EXPERTS, **changes), DIM)

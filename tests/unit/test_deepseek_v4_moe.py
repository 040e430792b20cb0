"""DeepSeek-V4's MoE layer as our `E` with its options (issue 49, item 3): the sqrtsoftplus
router (weights normalised over the chosen experts, times routed_scaling_factor, the choice
biased by e_score_correction_bias) and SwiGLU's clamp (`swiglu_limit`) in the routed experts and
the shared expert, against transformers' DeepseekV4SparseMoeBlock (float64, eager experts):
the output and every gradient."""

from __future__ import annotations

import pytest
import torch
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock

from titan_hybrid.model.mlp import MLPArgs, SwiGLU, build_mlp, swiglu
from titan_hybrid.model.moe import KIND, MoE, MoEArgs, router_scores

D, E, K, HIDDEN, LIMIT = 16, 4, 2, 8, 0.7


def _their_block() -> DeepseekV4SparseMoeBlock:
    config = DeepseekV4Config(hidden_size=D, moe_intermediate_size=HIDDEN, n_routed_experts=E,
                              num_experts_per_tok=K, routed_scaling_factor=1.5,
                              swiglu_limit=LIMIT, scoring_func="sqrtsoftplus",
                              num_hidden_layers=2, mlp_layer_types=["moe", "moe"],
                              experts_implementation="eager")
    generator = torch.Generator().manual_seed(0)
    block = DeepseekV4SparseMoeBlock(config, layer_idx=0).double()
    with torch.no_grad():
        for tensor in [*block.parameters(), block.gate.e_score_correction_bias]:
            tensor.copy_(torch.randn(tensor.shape, generator=generator, dtype=torch.float64))
    return block


def _ours_from(theirs: DeepseekV4SparseMoeBlock) -> MoE:
    args = MoEArgs(num_experts=E, top_k=K, hidden_dim=HIDDEN, score_func="sqrtsoftplus",
                   score_correction_bias=True, routed_scaling_factor=1.5,
                   shared_expert_hidden_dim=HIDDEN, swiglu_limit=LIMIT, aux_loss_coeff=0.0)
    ours = MoE(dim=D, args=args).double()
    shared = theirs.shared_experts
    with torch.no_grad():
        ours.router.gate.weight.copy_(theirs.gate.weight)
        ours.router.e_score_correction_bias.copy_(theirs.gate.e_score_correction_bias)
        ours.experts.fc1.copy_(theirs.experts.gate_up_proj)  # [gate ; up] rows, as ours
        ours.experts.fc2.copy_(theirs.experts.down_proj)
        ours.shared_expert.fc1.weight.copy_(torch.cat((shared.gate_proj.weight,
                                                       shared.up_proj.weight)))
        ours.shared_expert.fc2.weight.copy_(shared.down_proj.weight)
    return ours


def test_our_moe_with_v4s_options_is_transformers_deepseek_v4_block_forward_and_backward():
    theirs = _their_block()
    ours = _ours_from(theirs)
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64,
                    requires_grad=True)
    # A clamp that bites: some gate and up values are beyond the limit.
    assert (theirs.experts.gate_up_proj @ x.detach().reshape(-1, D).T).abs().max() > LIMIT
    out, _ = ours(x)
    expected = theirs(x)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2),
                          dtype=torch.float64)
    our_grads = torch.autograd.grad((out * weights).sum(), (x, ours.router.gate.weight,
                                                              ours.experts.fc1, ours.experts.fc2))
    their_grads = torch.autograd.grad((expected * weights).sum(),
                                      (x, theirs.gate.weight, theirs.experts.gate_up_proj,
                                       theirs.experts.down_proj))
    for a, b in zip(our_grads, their_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_sqrtsoftplus_scores_and_the_clamp_are_their_formulas():
    logits = torch.tensor([[-30.0, -1.0, 0.0, 2.0, 40.0]], dtype=torch.float64)
    assert torch.equal(router_scores(logits, "sqrtsoftplus"),
                       torch.log1p(torch.exp(logits)).where(logits < 20, logits).sqrt())
    mlp = build_mlp(MLPArgs(hidden_dim=3, swiglu_limit=0.5), 2)
    assert isinstance(mlp, SwiGLU) and mlp.limit == 0.5
    gate, up = torch.tensor([-2.0, 0.3, 4.0]), torch.tensor([-3.0, 0.2, 9.0])
    expected = torch.nn.functional.silu(torch.tensor([-2.0, 0.3, 0.5])) * torch.tensor(
        [-0.5, 0.2, 0.5])
    assert torch.equal(swiglu(gate, up, 0.5), expected)
    assert torch.equal(swiglu(gate, up), torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("args, message", [
    (MoEArgs(score_func="tanh"), "score_func 'tanh' is not one of"),
    (MoEArgs(swiglu_limit=-1.0), "swiglu_limit=-1.0 must be >= 0"),
    (MoEArgs(swiglu_limit=1.0, activation="relu2"), "0 unless activation is 'swiglu'"),
])
def test_moe_options_that_cannot_work_are_refused_by_name(args, message):
    with pytest.raises(ValueError, match=message):
        KIND.validate(args, D)


@pytest.mark.parametrize("changes, named", [
    ({"hc_mult": 4}, "hc_mult=4: hyper-connections"),
    ({"pattern": "M*EME", "moe": MoEArgs(score_func="sqrtsoftplus")},
     "moe.score_func='sqrtsoftplus'"),
    ({"pattern": "M*EME", "moe": MoEArgs(swiglu_limit=7.0)}, "moe.swiglu_limit=7.0"),
    ({"mlp": MLPArgs(swiglu_limit=7.0)}, "mlp.swiglu_limit=7.0"),
])
def test_an_hf_export_refuses_by_name_what_only_deepseek_v4_holds(changes, named):
    """An option only the DeepSeek-V4 format writes is never dropped silently by another: the
    export (and a job's last_save_in_hf, checked before training) is refused, naming it."""
    import dataclasses

    from titan_hybrid.hf.families import check_hf_compatible
    from titan_hybrid.model.args import hybrid_flavors

    args = dataclasses.replace(hybrid_flavors["debug_nemotron_h"], **changes)
    with pytest.raises(ValueError, match=f"^{named}.* is held only by the DeepSeek-V4 format, "
                       "and this model's HF format is nemotron_h"):
        check_hf_compatible(args)


def test_a_hash_routed_layer_is_transformers_deepseek_v4_hash_block_forward_and_backward():
    """The experts come from tid2eid[token id] (a random table here), the gate's sqrtsoftplus
    scores weigh them; no balance loss."""
    vocab = 11
    config = DeepseekV4Config(hidden_size=D, moe_intermediate_size=HIDDEN, n_routed_experts=E,
                              num_experts_per_tok=K, routed_scaling_factor=1.5,
                              swiglu_limit=LIMIT, scoring_func="sqrtsoftplus", vocab_size=vocab,
                              num_hidden_layers=2, mlp_layer_types=["hash_moe", "moe"],
                              experts_implementation="eager")
    generator = torch.Generator().manual_seed(3)
    theirs = DeepseekV4SparseMoeBlock(config, layer_idx=0).double()
    assert theirs.is_hash
    with torch.no_grad():
        for tensor in theirs.parameters():
            tensor.copy_(torch.randn(tensor.shape, generator=generator, dtype=torch.float64))
        theirs.gate.tid2eid.copy_(torch.randint(0, E, (vocab, K), generator=generator))
    args = MoEArgs(num_experts=E, top_k=K, hidden_dim=HIDDEN, score_func="sqrtsoftplus",
                   routed_scaling_factor=1.5, shared_expert_hidden_dim=HIDDEN,
                   swiglu_limit=LIMIT, hash_vocab_size=vocab)
    ours = MoE(dim=D, args=args).double()
    assert ours.routes_by_token and not hasattr(ours.router, "e_score_correction_bias")
    shared = theirs.shared_experts
    with torch.no_grad():
        ours.router.gate.weight.copy_(theirs.gate.weight)
        ours.router.tid2eid.copy_(theirs.gate.tid2eid)
        ours.experts.fc1.copy_(theirs.experts.gate_up_proj)
        ours.experts.fc2.copy_(theirs.experts.down_proj)
        ours.shared_expert.fc1.weight.copy_(torch.cat((shared.gate_proj.weight,
                                                       shared.up_proj.weight)))
        ours.shared_expert.fc2.weight.copy_(shared.down_proj.weight)
    ids = torch.randint(0, vocab, (2, 5), generator=generator)
    x = torch.randn(2, 5, D, generator=generator, dtype=torch.float64, requires_grad=True)
    out, aux_loss = ours(x, ids)
    expected = theirs(x, ids)
    assert aux_loss.item() == 0.0
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    weights = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad((out * weights).sum(), (x, ours.router.gate.weight)),
                    torch.autograd.grad((expected * weights).sum(), (x, theirs.gate.weight)),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="needs the batch's token ids"):
        ours(x)


def test_the_first_hash_layers_moe_layers_route_by_token_and_hold_a_round_robin_table():
    import dataclasses

    from titan_hybrid.model.args import hybrid_flavors
    from titan_hybrid.model.model import HybridModel

    args = hybrid_flavors["debug_hash_moe"]  # M*EME/*-: layers 2 (hash) and 4 (top-k)
    assert args.hash_routed(args.parsed_pattern.main) == [False, False, True, False, False]
    model = HybridModel(args)
    model.init_weights()
    assert [key for key in model.state_dict() if "tid2eid" in key] == [
        "layers.2.moe.router.tid2eid"]
    table = model.layers["2"].moe.router.tid2eid
    assert table.shape == (args.vocab_size, args.moe.top_k) and table.dtype == torch.int64
    assert table[5].tolist() == [5 % 8, 6 % 8]  # Megatron's (id + k) mod E
    assert not model.layers["4"].moe.routes_by_token
    with pytest.raises(ValueError, match=r"moe.hash_layers=3 must be in \[0, the pattern's 2"):
        dataclasses.replace(args, moe=dataclasses.replace(args.moe, hash_layers=3)).validate()


def test_a_loaded_hash_table_naming_an_expert_out_of_range_is_one_clear_error():
    from titan_hybrid.model.args import hybrid_flavors
    from titan_hybrid.model.model import HybridModel

    model = HybridModel(hybrid_flavors["debug_hash_moe"])
    model.init_weights()
    state = {key: value.clone() for key, value in model.state_dict().items()}
    model.load_state_dict(state)  # its own table: fine
    state["layers.2.moe.router.tid2eid"][7, 1] = 8
    with pytest.raises(ValueError, match=r"^moe.router.tid2eid names expert 8, but the layer "
                                         r"has 8 experts \(ids 0 to 7\)"):
        model.load_state_dict(state)

"""The one collector of layer-kind statistics (titan_hybrid.training.kind_statistics): MoE
router and DSA indexer counters read, reset, set aside and logged through the kinds'
KindStatistics give what reading the modules directly gives. The reductions over ranks run in the distributed
tests (test_expert_parallel: moe/*, test_mla_dsa: dsa/indexer_loss, under PP and CP)."""

from __future__ import annotations

import dataclasses

import torch

from titan_hybrid.model.args import DSAArgs, MLPArgs, MoEArgs, hybrid_flavors
from titan_hybrid.model.dsa import DeepSeekSparseAttention
from titan_hybrid.model.kind_counters import (
    reset_statistics,
    statistics_layers,
    statistics_set_aside,
)
from titan_hybrid.model.model import HybridModel
from titan_hybrid.model.moe import MoE
from titan_hybrid.training.kind_statistics import StatisticsCollector

DIM, VOCAB, SEQ = 32, 64, 24


def model_with_moe_and_dsa() -> HybridModel:
    # MoE layers in a bracket group, in the main part and in the MTP depth; two DSA layers
    # whose indexer trains and picks fewer keys than a row has.
    args = dataclasses.replace(
        hybrid_flavors["debug_dsa"], pattern="[ME]D-ED-/-E", dim=DIM, vocab_size=VOCAB,
        max_seq_len=SEQ, mlp=MLPArgs(hidden_dim=16),
        moe=MoEArgs(num_experts=4, top_k=2, hidden_dim=8),
        dsa=DSAArgs(n_heads=2, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
                    qk_rope_head_dim=4, v_head_dim=8, index_n_heads=2, index_head_dim=8,
                    index_topk=4, indexer_loss_coeff=0.1))
    torch.manual_seed(0)
    model = HybridModel(args)
    model.init_weights()
    return model


def train_forward(model: HybridModel, seed: int) -> None:
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))
    out = model(tokens)
    (out[0].float().square().mean() + out[1]).backward()


def modules(model, cls) -> list:
    return [m for m in model.modules() if isinstance(m, cls)]


def expected_metrics(model) -> dict[str, float]:
    """What the metrics logged before the collector, read from the modules themselves."""
    moes, dsas = modules(model, MoE), modules(model, DeepSeekSparseAttention)
    counts_LE = torch.stack([moe.routed_tokens for moe in moes]).double()
    aux_L2 = torch.stack([moe.aux_loss_sum for moe in moes]).double()
    load_LE = counts_LE / counts_LE.mean(dim=1, keepdim=True).clamp(min=1)
    metrics = {"moe/max_expert_load": load_LE.max().item(),
               "moe/min_expert_load": load_LE.min().item(),
               "moe/aux_loss": (aux_L2[:, 0] / aux_L2[:, 1].clamp(min=1)).mean().item()}
    if dsas:
        loss_sum, count = sum(layer.indexer_loss_sum.double() for layer in dsas).tolist()
        metrics["dsa/indexer_loss"] = loss_sum / count
    return metrics


def counters(model) -> list[torch.Tensor]:
    return [t.clone() for m in modules(model, MoE) for t in (m.routed_tokens, m.aux_loss_sum)] \
        + [m.indexer_loss_sum.clone() for m in modules(model, DeepSeekSparseAttention)]


def test_the_collector_finds_every_layer_with_statistics():
    model = model_with_moe_and_dsa()
    layers = statistics_layers([model])
    # 3 MoE (group, main, MTP) and 2 DSA layers, in module order, each once.
    assert [kind.name for kind, _ in layers] == ["moe", "dsa", "moe", "dsa", "moe"]
    assert statistics_layers([model, model]) == layers
    assert {id(mixer) for _, mixer in layers} == {
        id(m) for m in modules(model, MoE) + modules(model, DeepSeekSparseAttention)}


def test_collect_logs_what_the_modules_hold_and_resets_them():
    model = model_with_moe_and_dsa()
    for seed in range(2):
        train_forward(model, seed)
    expected = expected_metrics(model)
    assert all(c.any() for c in counters(model))  # every layer counted something
    metrics = StatisticsCollector().collect([model])
    assert metrics == expected  # bit for bit
    assert not any(c.any() for c in counters(model))
    assert StatisticsCollector().collect([model]) == {
        "moe/max_expert_load": 0.0, "moe/min_expert_load": 0.0, "moe/aux_loss": 0.0}


def test_forwards_set_aside_do_not_count_for_any_kind():
    model = model_with_moe_and_dsa()
    train_forward(model, 0)
    before = counters(model)
    with statistics_set_aside([model]):
        train_forward(model, 1)  # with gradients: the DSA indexer records its loss too
        with torch.no_grad():
            model.eval()
            model(torch.zeros(2, SEQ, dtype=torch.long))
            model.train()
        changed = counters(model)
    assert not any(torch.equal(a, b) for a, b in zip(before, changed))  # every kind counted
    assert all(torch.equal(a, b) for a, b in zip(before, counters(model)))
    reset_statistics([model])  # as after the pipeline's shape inference
    assert not any(c.any() for c in counters(model))


def test_a_stage_without_a_kinds_layers_logs_the_others_and_takes_part_in_its_sums():
    model = model_with_moe_and_dsa()
    train_forward(model, 0)
    for key, layer in list(model.layers.items()):  # a pipeline stage holding no DSA layer
        if getattr(layer, "kind", None) is not None and layer.kind.name == "dsa":
            del model.layers[key]
    assert not modules(model, DeepSeekSparseAttention)
    expected = expected_metrics(model)
    # No DSA layer here: its sums are zeros (from the counters' shapes on the meta device),
    # so nothing is logged for it on this rank; the MoE layers log as before.
    assert StatisticsCollector().collect([model]) == expected
    assert set(expected) == {"moe/max_expert_load", "moe/min_expert_load", "moe/aux_loss"}

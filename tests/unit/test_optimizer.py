"""Weight decay skips SSM dynamics parameters, norms and biases."""

import copy

import torch

import titan_hybrid.torchtitan_plugin  # noqa: F401  (TrainSpec, dataset; CPU runtime)
from titan_hybrid.config.sections import OptimizerSection as OptimizerConfig
from titan_hybrid.model.args import hybrid_flavors
from titan_hybrid.model.model import HybridModel
from titan_hybrid.parallel.plan import ParallelPlan
from titan_hybrid.training.optimizer import build_hybrid_optimizers


def build_model():
    args = copy.deepcopy(hybrid_flavors["debug_moe"])
    args.pattern = "M*EG-"
    model = HybridModel(args)
    with torch.no_grad():
        model.init_weights()
    return model


def test_param_groups_split_by_role():
    model = build_model()
    optimizers = build_hybrid_optimizers([model], OptimizerConfig(weight_decay=0.1),
                                         ParallelPlan.unparallelized([model]))
    (optimizer,) = optimizers.optimizers
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    decay_names = {names[id(p)] for p in decay["params"]}
    for suffix in ("mamba.A_log", "mamba.D", "mamba.dt_bias", "mamba.norm.weight",
                   "mamba.conv1d.bias", "gdn.A_log", "gdn.dt_bias", "gdn.norm.weight",
                   "attention_norm.weight", "norm.weight"):
        assert any(n.endswith(suffix) for n in no_decay_names), suffix
    for suffix in ("mamba.in_proj.weight", "mamba.conv1d.weight", "attention.wq.weight",
                   "moe.experts.fc1", "moe.router.gate.weight", "tok_embeddings.weight",
                   "output.weight"):
        assert any(n.endswith(suffix) for n in decay_names), suffix
    assert len(decay_names) + len(no_decay_names) == len(list(model.parameters()))


def test_no_decay_parameters_are_untouched_by_decay_alone():
    model = build_model()
    optimizers = build_hybrid_optimizers(
        [model], OptimizerConfig(lr=0.1, weight_decay=0.5, implementation="for-loop"),
        ParallelPlan.unparallelized([model]))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizers.step()
    after = dict(model.named_parameters())
    a_log = next(n for n in before if n.endswith("mamba.A_log"))
    wq = next(n for n in before if n.endswith("attention.wq.weight"))
    assert torch.equal(before[a_log], after[a_log])
    # AdamW's decoupled decay alone shrinks decayed weights by (1 - lr * wd).
    torch.testing.assert_close(after[wq], before[wq] * (1 - 0.1 * 0.5))

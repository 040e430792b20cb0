"""Pipeline stages of a HybridModel: which modules each stage keeps, how many stages a rank
runs for each schedule, the layout errors raised before any process group exists, and that a
chain of stage copies computes exactly what the whole model computes (bitwise)."""

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn
from torchtitan.config import ConfigManager

import titan_hybrid.torchtitan_plugin  # noqa: F401  (TrainSpec, dataset; CPU runtime)
from titan_hybrid.loss import hybrid_loss
from titan_hybrid.model.args import hybrid_flavors
from titan_hybrid.model.model import HybridModel
from titan_hybrid.parallel.pipeline import module_names_per_stage, stages_per_rank
from titan_hybrid.parallel.validate import validate_layout

CONFIG = Path(__file__).resolve().parents[2] / "train_configs" / "hybrid_moe.toml"


def job(*args):
    return ConfigManager().parse_args(["--job.config_file", str(CONFIG), *args])


def model_args(pattern):
    return dataclasses.replace(hybrid_flavors["debug_moe"], pattern=pattern, dim=64,
                               vocab_size=128, max_seq_len=32)


def test_stages_follow_segments_and_put_embedding_head_and_mtp_at_the_ends():
    names = module_names_per_stage(model_args("M*E|[ME]-/*-"), pp=2, virtual_stages=1)
    assert names == [["tok_embeddings", "layers.0", "layers.1", "layers.2"],
                     ["layers.3", "layers.4", "norm", "output", "mtp.0"]]
    # Without '|': an even split of the physical layers (a group counts its sub-layers).
    names = module_names_per_stage(model_args("[M*]E-M*E-"), pp=2, virtual_stages=2)
    assert names == [["tok_embeddings", "layers.0"], ["layers.1", "layers.2"],
                     ["layers.3", "layers.4"], ["layers.5", "layers.6", "norm", "output"]]


@pytest.mark.parametrize("schedule, pattern, expected", [
    ("1F1B", "M*EM", 1), ("GPipe", "M*|EM", 1), ("Interleaved1F1B", "M*EM", 2),
    ("Interleaved1F1B", "M|*|E|M|E|-", 3), ("DualPipeV", "M*EM", 2)])
def test_stages_per_rank(schedule, pattern, expected):
    config = job("--parallelism.pipeline_parallel_degree", "2",
                 "--parallelism.pipeline_parallel_schedule", schedule)
    assert stages_per_rank(config, model_args(pattern)) == expected


@pytest.mark.parametrize("args, pattern, message", [
    (("--parallelism.pipeline_parallel_schedule", "1F1B"), "M|*|E|M",
     "runs one stage per rank, but the pattern / layers_per_stage give 2"),
    (("--parallelism.pipeline_parallel_schedule", "DualPipeV"), "M|*|E|M|E|-",
     "needs exactly 2 stages per rank, the pattern gives 3"),
    (("--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"), "M*|EM",
     "needs at least 2 stages per rank, the pattern gives 1"),
    ((), "M*E", "3 physical layers cannot be split evenly into 2 pipeline stages"),
    ((), "[M*E]M", "opens a group that an even split into 2 stages"),
    (("--training.local_batch_size", "6", "--parallelism.pipeline_parallel_microbatch_size",
      "4"), "M*EM", "local_batch_size=6 is not divisible by parallelism.pipeline_parallel_"),
    (("--parallelism.pipeline_parallel_schedule", "1F1B", "--training.local_batch_size", "2"),
     "M*EM", "'1F1B' needs at least as many microbatches as stages: 1 microbatches"),
    (("--parallelism.pipeline_parallel_schedule", "DualPipeV"), "M*EM",
     "'DualPipeV' needs an accelerator" if not torch.accelerator.is_available() else
     "'DualPipeV' needs at least as many microbatches as stages: 2 microbatches"),
])
def test_impossible_pipeline_layouts_are_refused_by_field(args, pattern, message):
    config = job("--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4",
                 "--parallelism.pipeline_parallel_microbatch_size", "2", *args)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        validate_layout(config, model_args(pattern), world_size=2)


def stage_copy(model: nn.Module, kept: list[str]) -> nn.Module:
    """What torchtitan's pipeline_module_split builds: a copy with other stages' parts gone."""
    stage = copy.deepcopy(model)
    layer_keys = {name.split(".", 1)[1] for name in kept if name.startswith("layers.")}
    for key in list(stage.layers):
        if key not in layer_keys:
            del stage.layers[key]
    stage.mtp = nn.ModuleList(d for i, d in enumerate(stage.mtp) if f"mtp.{i}" in kept)
    for name in ("tok_embeddings", "norm", "output"):
        if name not in kept:
            setattr(stage, name, None)
    return stage


@pytest.mark.parametrize("pattern", ["M*E|ME/*-", "M-|*-", "[M*]|[-E]/*-/*-"])
def test_chained_stages_compute_the_whole_model_bitwise(pattern):
    args = model_args(pattern)
    model = HybridModel(args)
    model.init_weights()
    names = module_names_per_stage(args, pp=2, virtual_stages=1)
    stages = [stage_copy(model, kept) for kept in names]
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(tokens, -1, 1)

    whole = hybrid_loss(model(tokens), labels)
    whole.backward()
    carried = stages[0](tokens)
    carried = carried if isinstance(carried, tuple) else (carried,)
    staged = hybrid_loss(stages[1](*carried), labels)
    staged.backward()
    assert torch.equal(whole, staged)
    stage_params = dict(stages[0].named_parameters()) | dict(stages[1].named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, stage_params[name].grad), name

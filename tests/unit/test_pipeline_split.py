"""Pipeline stages: how a pattern splits into stages, which modules of a HybridModel each stage
keeps, how many stages a rank runs for each schedule, the layout errors raised before any process
group exists, and that a chain of stage copies computes exactly what the whole model computes
(bitwise)."""

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

import titan_hybrid.torchtitan_plugin  # noqa: F401  (TrainSpec, dataset; CPU runtime)
from tests.run_configs import run_from_args
from titan_hybrid.model.args import hybrid_flavors
from titan_hybrid.model.model import HybridModel
from titan_hybrid.model.pattern import parse_hybrid_pattern
from titan_hybrid.parallel.pipeline_split import (
    PipelineStage,
    module_names_per_stage,
    pipeline_stages,
    stages_per_rank,
)
from titan_hybrid.parallel.validate import validate_layout
from titan_hybrid.training.loss import hybrid_loss

CONFIG = Path(__file__).resolve().parents[2] / "train_configs" / "hybrid_moe.toml"


def job(*args, model=None):
    return run_from_args(*args, model=model, config_file=CONFIG)


def model_args(pattern):
    return dataclasses.replace(hybrid_flavors["debug_moe"], pattern=pattern, dim=64,
                               vocab_size=128, max_seq_len=32)


# --- stages of a pattern -----------------------------------------------------

def _summary(stages):
    return [(s.index, s.pp_rank, s.virtual_stage, s.items, s.first_logical_index,
             s.first_physical_index) for s in stages]


def test_pipe_segments_one_per_rank():
    stages = pipeline_stages(parse_hybrid_pattern("M*|[M*]E"), 2)
    assert all(isinstance(s, PipelineStage) for s in stages)
    assert _summary(stages) == [
        (0, 0, 0, ["M", "*"], 0, 0),
        (1, 1, 0, [("M", "*"), "E"], 2, 2),
    ]


def test_pipe_segments_virtual_stages():
    p = parse_hybrid_pattern("M[M*]|*|E|[GE]-")
    assert _summary(pipeline_stages(p, 2)) == [
        (0, 0, 0, ["M", ("M", "*")], 0, 0),
        (1, 1, 0, ["*"], 2, 3),
        (2, 0, 1, ["E"], 3, 4),
        (3, 1, 1, [("G", "E"), "-"], 4, 5),
    ]
    assert _summary(pipeline_stages(p, 2, num_virtual_stages=2)) == _summary(
        pipeline_stages(p, 2))
    # pp 1 with 4 segments: 4 virtual stages, all on rank 0.
    stages = pipeline_stages(p, 1)
    assert [(s.pp_rank, s.virtual_stage) for s in stages] == [(0, 0), (0, 1), (0, 2), (0, 3)]


def test_pipe_empty_segments_are_empty_stages():
    stages = pipeline_stages(parse_hybrid_pattern("M||*|"), 4)
    assert _summary(stages) == [
        (0, 0, 0, ["M"], 0, 0),
        (1, 1, 0, [], 1, 1),
        (2, 2, 0, ["*"], 1, 1),
        (3, 3, 0, [], 2, 2),
    ]


def test_pipe_segments_ignore_mtp():
    stages = pipeline_stages(parse_hybrid_pattern("M|*/-/-"), 2)
    assert [s.items for s in stages] == [["M"], ["*"]]


def test_pipe_segments_not_divisible():
    p = parse_hybrid_pattern("M|*|-")
    with pytest.raises(ValueError, match=r"3 pipeline segments.*pp_size=2.*divisible"):
        pipeline_stages(p, 2)


def test_pipe_segments_wrong_virtual_stages():
    p = parse_hybrid_pattern("M|*|-|E")
    with pytest.raises(ValueError, match=r"num_virtual_stages=1.*4 segments.*pp_size=2.*2"):
        pipeline_stages(p, 2, num_virtual_stages=1)


def test_even_split():
    stages = pipeline_stages(parse_hybrid_pattern("M*M-[M*]E-"), 2)
    assert _summary(stages) == [
        (0, 0, 0, ["M", "*", "M", "-"], 0, 0),
        (1, 1, 0, [("M", "*"), "E", "-"], 4, 4),
    ]


def test_even_split_single_stage():
    p = parse_hybrid_pattern("M[M*]-")
    assert _summary(pipeline_stages(p, 1)) == [(0, 0, 0, ["M", ("M", "*"), "-"], 0, 0)]


def test_even_split_virtual_stages():
    stages = pipeline_stages(parse_hybrid_pattern("MM[*E]-*G-"), 2, num_virtual_stages=2)
    assert _summary(stages) == [
        (0, 0, 0, ["M", "M"], 0, 0),
        (1, 1, 0, [("*", "E")], 2, 2),
        (2, 0, 1, ["-", "*"], 3, 4),
        (3, 1, 1, ["G", "-"], 5, 6),
    ]


def test_even_split_uneven_error():
    p = parse_hybrid_pattern("M*-M*")
    with pytest.raises(ValueError, match=r"5 physical layers.*2 pipeline stages.*'\|'"):
        pipeline_stages(p, 2)
    with pytest.raises(ValueError, match=r"5 physical layers.*6 pipeline stages"):
        pipeline_stages(p, 3, num_virtual_stages=2)


def test_even_split_counts_physical_layers():
    # 3 logical but 4 physical layers: splits by physical count.
    stages = pipeline_stages(parse_hybrid_pattern("[M*]-E"), 2)
    assert [s.items for s in stages] == [[("M", "*")], ["-", "E"]]
    with pytest.raises(ValueError, match="4 physical layers"):
        pipeline_stages(parse_hybrid_pattern("[M*]-E"), 3)


def test_even_split_through_group_error():
    p = parse_hybrid_pattern("M[M*]-")
    with pytest.raises(ValueError, match=r"'\[' at position 1.*\|.*explicitly"):
        pipeline_stages(p, 2)


def test_bad_pp_size():
    p = parse_hybrid_pattern("M*")
    with pytest.raises(ValueError, match="pp_size"):
        pipeline_stages(p, 0)
    with pytest.raises(ValueError, match="num_virtual_stages"):
        pipeline_stages(p, 1, num_virtual_stages=0)


# --- stages of a model -------------------------------------------------------

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
    assert stages_per_rank(config.parallelism, model_args(pattern)) == expected


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
                 "--parallelism.pipeline_parallel_microbatch_size", "2", *args,
                 model=model_args(pattern))
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        validate_layout(config, world_size=2)


def test_a_tied_head_is_refused_under_pipeline_parallelism():
    config = job("--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4",
                 "--parallelism.pipeline_parallel_microbatch_size", "2",
                 model=dataclasses.replace(model_args("M*EM"), enable_weight_tying=True))
    with pytest.raises(ValueError, match="pipeline_parallel_degree=2 with a model whose LM head "
                                         "shares the embedding's weight"):
        validate_layout(config, world_size=2)


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


@pytest.mark.parametrize("pattern", ["M*E|ME/*-", "M-|*-", "[M*]|[ME]/*-/*-"])
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

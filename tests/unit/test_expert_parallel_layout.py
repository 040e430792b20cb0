"""Expert parallelism and the EP-overlap schedule: impossible or unsupported layouts fail with a
ValueError naming the field before any process group exists; the dispatch's regrouping of
received slots is exact."""

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.run_configs import run_from_args
from titan_hybrid.model.args import hybrid_flavors
from titan_hybrid.parallel.expert_parallel import _group_by_local_expert
from titan_hybrid.parallel.validate import validate_layout

CONFIG = Path(__file__).resolve().parents[2] / "train_configs" / "hybrid_moe.toml"
MOE = dataclasses.replace(hybrid_flavors["debug_moe"])
EP2 = ("--parallelism.expert_parallel_degree", "2")
TWO_MICROBATCHES = ("--training.local_batch_size", "2", "--training.global_batch_size", "8")


def job(*args, model):
    return run_from_args(*args, model=model, config_file=CONFIG)


@pytest.mark.parametrize("args, world, message", [
    ((*EP2, "--parallelism.tensor_parallel_degree", "2"), 4,
     "expert_tensor_parallel_degree=1 with tensor_parallel_degree=2 and "
     "expert_parallel_degree=2: experts are split like the dense layers (ETP = TP)"),
    ((*EP2, "--parallelism.data_parallel_sharding_strategy", "no_shard"), 2,
     "data_parallel_sharding_strategy 'no_shard' with expert_parallel_degree=2"),
    (("--parallelism.expert_parallel_degree", "4"), 2,
     "expert_parallel_degree=4 must divide data_parallel_shard_degree=2"),
    (("--parallelism.expert_parallel_overlap", *TWO_MICROBATCHES), 2,
     "expert_parallel_overlap needs expert_parallel_degree > 1"),
    ((*EP2, "--parallelism.expert_parallel_overlap", "--training.local_batch_size", "2"), 2,
     r"needs >= 2 microbatches per step: training.global_batch_size=4"),
    ((*EP2, "--parallelism.expert_parallel_overlap", *TWO_MICROBATCHES,
      "--parallelism.pipeline_parallel_degree", "2", "--hybrid.pattern", "M*E|ME/*-",
      "--parallelism.pipeline_parallel_schedule", "GPipe"), 4,
     "expert_parallel_overlap with pipeline_parallel_schedule='GPipe' is not supported"),
])
def test_unsupported_expert_layouts_are_named(args, world, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_layout(job(*args, model=MOE), world)


def test_supported_expert_layouts_pass():
    validate_layout(job(*EP2, model=MOE), 2)
    validate_layout(job(*EP2, "--parallelism.tensor_parallel_degree", "2",
                        "--parallelism.expert_tensor_parallel_degree", "2", model=MOE), 4)
    validate_layout(job(*EP2, "--parallelism.expert_parallel_overlap", *TWO_MICROBATCHES,
                        model=MOE), 2)
    staged = dataclasses.replace(MOE, pattern="M*E|ME/*-")
    validate_layout(job(*EP2, "--parallelism.pipeline_parallel_degree", "2", model=staged), 4)
    validate_layout(job(*EP2, "--parallelism.pipeline_parallel_degree", "2",
                        "--parallelism.expert_parallel_overlap", model=staged), 4)


def test_received_slots_regroup_by_local_expert():
    # 2 source ranks x 3 local experts; source s sent counts[s][e] slots for local expert e.
    counts = torch.tensor([[2, 0, 1], [1, 3, 0]])
    # Received layout: s0: e0 e0 e2 | s1: e0 e1 e1 e1  (positions 0..6)
    order = _group_by_local_expert(counts)
    assert order.tolist() == [0, 1, 3, 4, 5, 6, 2]

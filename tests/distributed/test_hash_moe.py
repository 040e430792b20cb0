"""Hash-routed MoE (`debug_hash_moe`: DeepSeek-V4's first MoE layer chooses its experts by the
token id, with its sqrtsoftplus router and SwiGLU clamp) in the real trainer: the one-process
curve under EP2 and, in the extended run, FSDP2, TP2 + SP, PP2 with the hash layer on the
second stage (which reads the token ids from the batch's kwargs) and CP2 (whose zigzag shard
takes the token ids with the tokens). The layer-level check against transformers' hash router
is tests/unit/test_deepseek_v4_moe.py."""

from __future__ import annotations

import pytest

from tests.launch import run_training

JOB = ("--model.flavor", "debug_hash_moe", "--training.steps", "3", "--training.seq_len", "64",
       "--training.local_batch_size", "4", "--training.global_batch_size", "8")
WHOLE_BATCH = ("--training.local_batch_size", "8")
SPLIT = ("--hybrid.pattern", "M*M|EME")  # the hash layer (the first E) on the second stage
NO_MTP = ("--hybrid.pattern", "M*EME")  # CP refuses MTP depths
LAYOUTS = {
    "ep2": ((), ("--parallelism.expert_parallel_degree", "2"), 1e-5),
    "fsdp2": ((), (), 1e-5),
    # TP's reductions in another order, through the top-k layer's choices and the clamp: 2.5e-5
    # after two updates (plain debug_moe: 5e-6); the first step, before any update, within
    # 1e-6 (token ids sharded with the sequence-parallel rows would change it at 1e-2).
    "tp2": ((), ("--parallelism.tensor_parallel_degree", "2", *WHOLE_BATCH), 1e-4),
    "pp2": (SPLIT, ("--parallelism.pipeline_parallel_degree", "2", *WHOLE_BATCH,
                    "--parallelism.pipeline_parallel_microbatch_size", "4"), 1e-5),
    # The top-k layer's balance loss is each CP rank's over its own tokens (measured: 2e-5
    # after two updates, 7e-6 without hash routing): the first step's loss is the same.
    "cp2": (NO_MTP, ("--parallelism.context_parallel_degree", "2", *WHOLE_BATCH), 1e-4),
}


@pytest.mark.parametrize("name", [
    "ep2", *(pytest.param(name, marks=pytest.mark.extended)
             for name in ("fsdp2", "tp2", "pp2", "cp2"))])
def test_hash_routing_gives_the_one_process_curve(tmp_path, reference_run, name):
    pattern, layout, rel = LAYOUTS[name]
    single = reference_run(*JOB, *pattern, config="hybrid_moe.toml").losses
    got = run_training(tmp_path, *JOB, *pattern, *layout, nproc=2,
                       config="hybrid_moe.toml").check().losses
    assert len(got) == len(single) == 3
    assert got[0] == pytest.approx(single[0], rel=1e-6)
    for a, b in zip(single, got, strict=True):
        assert b == pytest.approx(a, rel=rel)

"""Hash-routed MoE (`debug_hash_moe`: DeepSeek-V4's first MoE layer chooses its experts by the
token id, with its sqrtsoftplus router and SwiGLU clamp) in the real trainer: the one-process
curve under EP2 and, in the extended run, FSDP2, TP2 + SP, PP2 with the hash layer on the
second stage (which reads the token ids from the batch's kwargs) and CP2 (whose zigzag shard
takes the token ids with the tokens); a TP2 checkpoint, table included, resumed at TP1. The layer-level check against transformers' hash router
is tests/unit/test_deepseek_v4_moe.py."""

from __future__ import annotations

import shutil

import pytest
import torch.distributed.checkpoint as dcp

from tests.launch import run_training

# No gradient clipping (max_norm 1e6): its coefficient max_norm / |g| rounds with the layout,
# and the top-k layer can turn that 1e-7 into another expert for a token near a tie (measured on
# torch 2.11: TP2 1e-5 apart at step 3 with clipping, 1.1e-7 without; tests/distributed/
# test_hf_import.py says the same). Without it the layouts' own arithmetic is compared.
JOB = ("--model.flavor", "debug_hash_moe", "--training.steps", "3", "--training.seq_len", "64",
       "--training.local_batch_size", "4", "--training.global_batch_size", "8",
       "--training.max_norm", "1e6")
WHOLE_BATCH = ("--training.local_batch_size", "8")
SPLIT = ("--hybrid.pattern", "M*M|EME")  # the hash layer (the first E) on the second stage
NO_MTP = ("--hybrid.pattern", "M*EME")  # CP refuses MTP depths
# EP overlap pairs two microbatches per rank: two rows each, in the one-process run too.
MICROBATCHES_OF_2 = ("--training.local_batch_size", "2")
# Without data parallelism TP2 and CP2 accumulate the same two microbatches of 4 rows as one
# process does: the balance loss is a microbatch's (and under CP the whole sequence's slot
# counts: parallel/context_parallel.py), so a whole batch of 8 rows would be another loss.
# name: (arguments of both runs, the layout's own)
LAYOUTS = {
    "ep2": ((), ("--parallelism.expert_parallel_degree", "2")),
    "ep2_overlap": (MICROBATCHES_OF_2, ("--parallelism.expert_parallel_degree", "2",
                                        "--parallelism.expert_parallel_overlap")),
    "fsdp2": ((), ()),
    # The first step within 1e-6: token ids sharded with the sequence-parallel rows would
    # change it at 1e-2.
    "tp2": ((), ("--parallelism.tensor_parallel_degree", "2")),
    "pp2": (SPLIT, ("--parallelism.pipeline_parallel_degree", "2", *WHOLE_BATCH,
                    "--parallelism.pipeline_parallel_microbatch_size", "4")),
    "cp2": (NO_MTP, ("--parallelism.context_parallel_degree", "2")),
}


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.extended)
    for name in ("ep2", "ep2_overlap", "fsdp2", "tp2", "pp2", "cp2")])
def test_hash_routing_gives_the_one_process_curve(tmp_path, reference_run, name):
    both, layout = LAYOUTS[name]
    single = reference_run(*JOB, *both, config="hybrid_moe.toml").losses
    got = run_training(tmp_path, *JOB, *both, *layout, nproc=2,
                       config="hybrid_moe.toml").check().losses
    assert len(got) == len(single) == 3
    assert got[0] == pytest.approx(single[0], rel=1e-6)
    assert got == pytest.approx(single, rel=1e-5)


@pytest.mark.extended
def test_a_tp2_checkpoint_with_a_hash_table_resumes_at_tp1(tmp_path):
    """The table is a buffer like any other: saved whole under TP2 and read back at TP1, where
    the run continues the TP2 curve."""
    checkpoint = ("--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.folder",
                  "ck", "--checkpoint.no_last_save_model_only", "--training.steps", "4")
    job = (*JOB, *WHOLE_BATCH, *checkpoint)
    saved = run_training(tmp_path / "tp2", *job, "--parallelism.tensor_parallel_degree", "2",
                         nproc=2, config="hybrid_moe.toml").check()
    outputs = tmp_path / "tp2" / "outputs"
    shutil.rmtree(outputs / "ck" / "step-4")
    keys = dcp.FileSystemReader(str(outputs / "ck" / "step-2")).read_metadata().state_dict_metadata
    assert tuple(keys["layers.2.moe.router.tid2eid"].size) == (2048, 2)
    shutil.copytree(outputs, tmp_path / "tp1" / "outputs")
    resumed = run_training(tmp_path / "tp1", *job, config="hybrid_moe.toml").check()
    assert "Training starts at step 3" in resumed.output
    assert resumed.losses == pytest.approx(saved.losses[2:], rel=1e-5)

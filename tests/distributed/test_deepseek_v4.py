"""DeepSeek-V4 attention in the real trainer: the loss curve of one process under FSDP2, TP2 +
SP, PP2 (2 processes each) and full activation checkpointing with compile (aot_eager), for a
model with all three kinds, compressed sparse (`C`), heavily compressed (`H`) and sliding-window
(`W`) attention, and MoE; a TP2 checkpoint resumes at TP1.

debug_v4_all_moe ("MC-MHEMWE") has 64-token rows, 8-token windows in C and H and a 16-token one
in W, blocks of 4 tokens (16 compressed rows a row, most of them beyond a query's window), a C
indexer that keeps 6 rows a query and trains (its KL joins the auxiliary loss), and MoE layers
after H and W. (debug_v4_all, "MC-MH-MW-", ran every layout too until issue 45: the same
attention layers with dense MLPs, which every other layout test covers.) The layers' float64 checks
(reference, transformers, TP split by hand) are in tests/unit/test_deepseek_v4*.py; their
float64 CP2 / CP4 parity in tests/distributed/test_context_parallel.py. CP2 here: W's key halo,
C's and H's rows gathered, with and without packed documents."""

from __future__ import annotations

import shutil

import pytest
import torch.distributed.checkpoint as dcp

from tests.launch import TOP_K_CURVE_REL, run_training

# Two microbatches of 4 rows per step: one process accumulates what two DP ranks compute.
STEPS = ("--training.steps", "4", "--training.seq_len", "64",
         "--training.local_batch_size", "4", "--training.global_batch_size", "8")
LAYOUTS = {
    "fsdp2": (),
    "tp2": ("--parallelism.tensor_parallel_degree", "2"),
    # the same layers in two stages (STAGED)
    "pp2": ("--parallelism.pipeline_parallel_degree", "2",
            "--parallelism.pipeline_parallel_microbatch_size", "2"),
    "ac + compile": ("--activation_checkpoint.mode", "full", "--compile.enable",
                     "--compile.backend", "aot_eager"),
}
STAGED = {"debug_v4_all_moe": "MC-MHE|MWE"}


# Activation checkpointing with compile: the longest cases, out of the default suite.
EXTENDED = pytest.mark.extended


@pytest.mark.parametrize("flavor", ["debug_v4_all_moe"])
# FSDP2 in the default suite, the other layouts in the extended one
@pytest.mark.parametrize("layout", [layout if layout == "fsdp2" else
                                    pytest.param(layout, marks=EXTENDED) for layout in LAYOUTS])
def test_two_process_layouts_give_the_one_process_curve(tmp_path, reference_run, layout, flavor):
    job = ("--model.flavor", flavor, *STEPS)
    reference_job = job
    if layout == "pp2":
        job += ("--hybrid.pattern", STAGED[flavor])
        # MoE's load-balancing loss is per microbatch: the reference accumulates the
        # pipeline's 2-row microbatches (tests/distributed/test_pipeline.py).
        reference_job = (*job, "--training.local_batch_size", "2")
    single = reference_run(*reference_job).losses
    result = run_training(tmp_path, *job, *LAYOUTS[layout], nproc=2).check()
    if layout == "tp2":
        assert "Applied tensor parallel (sequence parallel: True)" in result.output
    assert len(result.losses) == len(single) == 4
    for a, b in zip(single, result.losses, strict=True):
        assert b == pytest.approx(a, rel=TOP_K_CURVE_REL)  # C's top-k (tests/launch.py)


CHECKPOINT = ("--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.folder", "ck",
              "--checkpoint.no_last_save_model_only")


@EXTENDED
def test_a_tp2_checkpoint_resumes_at_tp1(tmp_path, reference_run):
    """Heads and output groups are split under TP; the checkpoint holds whole tensors, so a
    TP2 save resumes in one process onto the uninterrupted curve."""
    job = ("--model.flavor", "debug_v4_all_moe", *STEPS, *CHECKPOINT)
    uninterrupted = reference_run("--model.flavor", "debug_v4_all_moe", *STEPS).losses
    run_training(tmp_path, *job, "--parallelism.tensor_parallel_degree", "2", nproc=2).check()
    shutil.rmtree(tmp_path / "outputs" / "ck" / "step-4")
    keys = dcp.FileSystemReader(str(tmp_path / "outputs" / "ck" / "step-2")).read_metadata()
    for layer, kind in ((1, "compressed_sparse_attention"), (4, "heavily_compressed_attention")):
        shape = keys.state_dict_metadata[f"layers.{layer}.{kind}.q_b_proj.weight"]
        assert tuple(shape.size)[0] == 4 * 32  # all heads, whatever the TP degree
    resumed = run_training(tmp_path, *job).check()
    assert "Training starts at step 3" in resumed.output
    assert resumed.losses == pytest.approx(uninterrupted[2:], rel=TOP_K_CURVE_REL)


@pytest.mark.parametrize("documents, extra", [
    pytest.param(False, (), id="plain", marks=EXTENDED),
    pytest.param(True, (), id="documents", marks=EXTENDED),
    pytest.param(True, ("--activation_checkpoint.mode", "full", "--compile.enable",
                        "--compile.backend", "aot_eager"), id="documents-ac-compile",
                 marks=EXTENDED)])
def test_cp2_gives_the_one_process_curve(tmp_path, reference_run, documents, extra):
    """Each rank's pieces read the window's last keys from the piece before them (W's 16-token
    window over 16-token pieces), and the C and H rows of every piece are gathered (blocks of 4
    tokens, C's top-k over all of them, its indexer training); also under full activation
    checkpointing with compile."""
    job = ("--model.flavor", "debug_v4_all", *STEPS,
           *(("--hybrid.document_masking",) if documents else ()))
    single = reference_run(*job).losses
    result = run_training(tmp_path, *job, "--parallelism.context_parallel_degree", "2",
                          *extra, nproc=2).check()
    assert "Applied context parallel over 2 ranks" in result.output
    assert result.losses == pytest.approx(single, rel=TOP_K_CURVE_REL)

"""MLA (`+`) and DSA (`D`) hybrids in the real trainer: the loss curve of one process under
FSDP2, TP2 + SP, PP2 and CP2, and a checkpoint saved under TP2 resumed under TP1 and FSDP2.

DSA's indexer picks 16 of the up to 64 keys a query sees and trains (debug_dsa), so its
top-k and its loss are exercised under every layout. Layer-level float64 checks of TP and CP
are in test_tensor_parallel.py / test_context_parallel.py."""

from __future__ import annotations

import shutil

import pytest
import torch.distributed.checkpoint as dcp

from tests.launch import INDEXER_LOSS_REL, TOP_K_CURVE_REL, run_training

# Two microbatches of 4 rows per step: one process accumulates what two DP ranks compute.
JOB = ("--training.steps", "4", "--training.seq_len", "64", "--training.local_batch_size", "4",
       "--training.global_batch_size", "8")
CHECKPOINT = ("--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.folder", "ck",
              "--checkpoint.no_last_save_model_only")
LAYOUTS = {
    "fsdp2": (),
    "pp2": ("--parallelism.pipeline_parallel_degree", "2"),
    "cp2": ("--parallelism.context_parallel_degree", "2"),
}
TP2 = ("--parallelism.tensor_parallel_degree", "2")


def _assert_same_curve(expected, got, rel=1e-5):
    assert len(got) == len(expected) == 4
    for a, b in zip(expected, got, strict=True):
        assert b == pytest.approx(a, rel=rel)


def _indexer_losses(result) -> list[float]:
    return [record["dsa/indexer_loss"] for record in result.records if "dsa/indexer_loss" in record]


def _assert_same_run(single, result, flavor):
    """The same loss curve (within TOP_K_CURVE_REL through DSA's top-k), and for DSA the same
    logged indexer loss (the KL before its coefficient, averaged over the layers and over the
    data / context / pipeline ranks)."""
    _assert_same_curve(single.losses, result.losses,
                       rel=TOP_K_CURVE_REL if flavor == "debug_dsa" else 1e-5)
    assert _indexer_losses(result) == pytest.approx(_indexer_losses(single), rel=INDEXER_LOSS_REL)


# DSA's every-layout run (18 s) in the extended run, which every CI leg runs too (the default
# suite's 12 minutes); MLA's, whose layouts DSA's share, in the default suite.
@pytest.mark.parametrize("flavor", [pytest.param(flavor, marks=pytest.mark.extended)
                                    for flavor in ("debug_mla", "debug_dsa")])
def test_every_layout_gives_the_one_process_curve_and_tp2_checkpoints_resume_anywhere(
        tmp_path, reference_run, flavor):
    job = ("--model.flavor", flavor, *JOB)
    reference = reference_run(*job)
    single = reference.losses
    indexer_losses = _indexer_losses(reference)
    assert len(indexer_losses) == (4 if flavor == "debug_dsa" else 0)
    assert all(0 < loss < 1 for loss in indexer_losses)
    for name, layout in LAYOUTS.items():
        _assert_same_run(reference, run_training(tmp_path / name, *job, *layout, nproc=2).check(),
                         flavor)
    saved = run_training(tmp_path / "tp2", *job, *TP2, *CHECKPOINT, nproc=2).check()
    assert "Applied tensor parallel (sequence parallel: True)" in saved.output
    _assert_same_run(reference, saved, flavor)
    if flavor == "debug_mla":
        return  # the checkpoint path is the same for both kinds; DSA adds the indexer
    outputs = tmp_path / "tp2" / "outputs"
    shutil.rmtree(outputs / "ck" / "step-4")
    keys = dcp.FileSystemReader(str(outputs / "ck" / "step-2")).read_metadata().state_dict_metadata
    # Heads are rows of the up-projections: a TP2 save holds the global tensors, the same
    # as transformers' (kv_b_proj: heads x (k_nope + v) rows by kv_lora_rank).
    assert tuple(keys["layers.1.dsa.kv_b_proj.weight"].size) == (4 * (32 + 32), 32)
    assert tuple(keys["layers.1.dsa.q_b_proj.weight"].size) == (4 * (32 + 16), 64)
    assert tuple(keys["layers.1.dsa.o_proj.weight"].size) == (256, 4 * 32)
    assert "optimizer.state.layers.4.dsa.indexer.wq_b.weight.exp_avg" in keys
    for name, (layout, nproc) in {"tp1": ((), 1), "fsdp2": ((), 2)}.items():
        resumed_in = tmp_path / f"resume_{name}"
        shutil.copytree(outputs, resumed_in / "outputs")
        resumed = run_training(resumed_in, *job, *CHECKPOINT, *layout, nproc=nproc).check()
        assert "Training starts at step 3" in resumed.output
        assert resumed.losses[0] == pytest.approx(single[2], rel=TOP_K_CURVE_REL)
        assert resumed.losses[1] == pytest.approx(single[3], rel=TOP_K_CURVE_REL)

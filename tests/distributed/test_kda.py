"""KDA (`K`, model/kda.py) in the real trainer: `MK-*K-` (debug_kda) gives the one-process
loss curve under 2-process FSDP2, TP2 + SP, PP2, CP2 in both linear modes (with packed
documents), and full activation checkpointing with compile; a TP2 checkpoint resumes at TP1.
The layer's float64 checks (transformers' module, the recurrence) are in tests/unit/test_kda*.py,
its CP2 float64 parity in tests/distributed/test_context_parallel.py."""

from __future__ import annotations

import shutil

import pytest
import torch.distributed.checkpoint as dcp

from tests.launch import run_training

# Two microbatches of 4 rows per step: one process accumulates what two DP ranks compute.
STEPS = ("--model.flavor", "debug_kda", "--training.steps", "4", "--training.seq_len", "64",
         "--training.local_batch_size", "4", "--training.global_batch_size", "8")
DOCUMENTS = ("--hybrid.document_masking",)
CP2 = ("--parallelism.context_parallel_degree", "2")
LAYOUTS = {
    "fsdp2": (),
    "tp2": ("--parallelism.tensor_parallel_degree", "2"),
    "pp2": ("--parallelism.pipeline_parallel_degree", "2",
            "--parallelism.pipeline_parallel_microbatch_size", "2", "--hybrid.pattern",
            "MK-|*K-"),
    "cp2 head_a2a": (*CP2, *DOCUMENTS),
    "cp2 chunkwise": (*CP2, *DOCUMENTS, "--parallelism.context_parallel_linear_mode",
                      "chunkwise"),
    "ac + compile": ("--activation_checkpoint.mode", "full", "--compile.enable",
                     "--compile.backend", "aot_eager"),
}
# float32 reductions in another order: measured 6.3e-8 (FSDP2, AC + compile), 1.2e-7 (TP2),
# 2.3e-7 (PP2), 1.3e-7 (CP2 head_a2a), 2.0e-7 (CP2 chunkwise) at most over the 4 steps
CURVE_REL = 1e-5


# The default suite runs FSDP2 (CP2's float64 layer parity is in tests/distributed/
# test_context_parallel.py); the other layouts and the TP2 checkpoint run in every CI leg's
# extended run (the default suite's 12 minutes).
DEFAULT_LAYOUTS = ("fsdp2",)


@pytest.mark.parametrize("layout", [
    layout if layout in DEFAULT_LAYOUTS else pytest.param(layout, marks=pytest.mark.extended)
    for layout in LAYOUTS])
def test_two_process_layouts_give_the_one_process_curve(tmp_path, reference_run, layout):
    extra = LAYOUTS[layout]
    reference_job = (*STEPS, *(DOCUMENTS if "cp2" in layout else ()))
    single = reference_run(*reference_job).losses
    result = run_training(tmp_path, *STEPS, *extra, nproc=2).check()
    if layout.startswith("cp2"):
        assert "Applied context parallel over 2 ranks" in result.output
    assert len(result.losses) == len(single) == 4
    assert result.losses == pytest.approx(single, rel=CURVE_REL)


CHECKPOINT = ("--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.folder", "ck",
              "--checkpoint.no_last_save_model_only")


@pytest.mark.extended
def test_a_tp2_checkpoint_resumes_at_tp1(tmp_path, reference_run):
    """Heads are split under TP (projections, convs, A_log, dt_bias); the checkpoint holds
    whole tensors, so a TP2 save resumes in one process onto the uninterrupted curve."""
    uninterrupted = reference_run(*STEPS).losses
    run_training(tmp_path, *STEPS, *CHECKPOINT, "--parallelism.tensor_parallel_degree", "2",
                 nproc=2).check()
    shutil.rmtree(tmp_path / "outputs" / "ck" / "step-4")
    metadata = dcp.FileSystemReader(str(tmp_path / "outputs" / "ck" / "step-2")).read_metadata()
    for name, shape in (("q_conv1d.weight", (128, 1, 4)), ("A_log", (4,)), ("dt_bias", (128,)),
                        ("f_b_proj.weight", (128, 32))):
        assert tuple(metadata.state_dict_metadata[f"layers.1.kda.{name}"].size) == shape
    resumed = run_training(tmp_path, *STEPS, *CHECKPOINT).check()
    assert "Training starts at step 3" in resumed.output
    assert resumed.losses == pytest.approx(uninterrupted[2:], rel=CURVE_REL)

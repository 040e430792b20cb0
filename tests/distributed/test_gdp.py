"""Gated DeltaProduct (`debug_gdp`: `M-*-M-` with `m_layers = "gdp"`, 2 Householder steps a
token) in the real trainer: the one-process curve under FSDP2, TP2 + SP (heads and key groups
split), PP2, and CP2 in both linear modes (chunkwise: each piece's summary is its transition
over all its tokens' steps); a TP2 checkpoint resumes at TP1; full AC with compile, and FP8, for
GDP and GDN2 alike. The mixer against Megatron's equations in float64 is
tests/unit/test_gdp.py."""

from __future__ import annotations

import shutil

import pytest
import torch.distributed.checkpoint as dcp

from tests.launch import run_training

# Two microbatches of 4 rows a step; no gradient clipping (its coefficient rounds with the
# layout: tests/distributed/test_hf_import.py).
JOB = ("--model.flavor", "debug_gdp", "--training.steps", "4", "--training.seq_len", "64",
       "--training.local_batch_size", "4", "--training.global_batch_size", "8",
       "--training.max_norm", "1e6")
LAYOUTS = {
    "fsdp2": (),
    "cp2_chunkwise": ("--parallelism.context_parallel_degree", "2",
                      "--parallelism.context_parallel_linear_mode", "chunkwise"),
}
# The default suite's time is near its budget: these, with the TP2 -> TP1 resume, run in the
# extended run (CI's first leg).
EXTENDED_LAYOUTS = {
    "tp2": ("--parallelism.tensor_parallel_degree", "2"),
    "pp2": ("--parallelism.pipeline_parallel_degree", "2", "--hybrid.pattern", "M-*|-M-"),
    "cp2_head_a2a": ("--parallelism.context_parallel_degree", "2"),
}
CHECKPOINT = ("--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.folder", "ck",
              "--checkpoint.no_last_save_model_only")


@pytest.mark.extended
def test_fsdp2_and_chunkwise_cp2_give_the_one_process_curve(tmp_path, reference_run):
    single = reference_run(*JOB).losses
    for name, layout in LAYOUTS.items():
        got = run_training(tmp_path / name, *JOB, *layout, nproc=2).check().losses
        assert got == pytest.approx(single, rel=1e-5), name


@pytest.mark.extended
def test_tp2_pp2_and_head_exchange_cp2_give_the_curve_and_tp2_checkpoints_resume_at_tp1(
        tmp_path, reference_run):
    single = reference_run(*JOB).losses
    for name, layout in EXTENDED_LAYOUTS.items():
        got = run_training(tmp_path / name, *JOB, *layout, nproc=2).check().losses
        assert got == pytest.approx(single, rel=1e-5), name
    saved = run_training(tmp_path / "tp2_saved", *JOB, *EXTENDED_LAYOUTS["tp2"], *CHECKPOINT,
                         nproc=2).check()
    outputs = tmp_path / "tp2_saved" / "outputs"
    shutil.rmtree(outputs / "ck" / "step-4")
    keys = dcp.FileSystemReader(str(outputs / "ck" / "step-2")).read_metadata().state_dict_metadata
    # Megatron's split keys: the TP2 checkpoint holds each component whole.
    assert tuple(keys["layers.0.gdp.in_proj.weight.K1"].size) == (2 * 32, 256)
    assert "layers.0.gdp.conv1d.weight.Q" in keys
    shutil.copytree(outputs, tmp_path / "tp1" / "outputs")
    resumed = run_training(tmp_path / "tp1", *JOB, *CHECKPOINT).check()
    assert "Training starts at step 3" in resumed.output
    assert resumed.losses == pytest.approx(saved.losses[2:], rel=1e-5)


@pytest.mark.extended
@pytest.mark.parametrize("flavor", ["debug_gdp", "debug_gdn2"])
def test_activation_checkpointing_with_compile_and_fp8_train_gdp_and_gdn2(tmp_path,
                                                                         reference_run, flavor):
    """Full AC with compile gives the one-process curve (each op compiles with its documents:
    tests/unit/test_gated_delta_product.py, test_gdn2.py); emulated FP8 Linears stay within
    FP8's rounding of it (measured 1.5e-4 for GDP, 1.0e-4 for GDN2), and move it."""
    job = ("--model.flavor", flavor, *JOB[2:])
    single = reference_run(*job).losses
    compiled = run_training(tmp_path / "ac", *job, "--activation_checkpoint.mode", "full",
                            "--compile.enable").check().losses
    assert compiled == pytest.approx(single, rel=1e-5)
    fp8 = run_training(tmp_path / "fp8", *job, "--model.converters", "quantize.linear.float8",
                       "--quantize.linear.float8.emulate").check()
    assert fp8.losses == pytest.approx(single, rel=2e-3) and fp8.losses != single

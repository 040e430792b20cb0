"""Hyper-connections (`--hybrid.hc_mult 4`: four residual streams) in the real trainer: the loss
curve of one process under FSDP2, TP2 + SP, PP2 (the stage boundary carries [B, T, 4, D]) and
CP2 in both linear modes, and for an MoE + MTP pattern under EP2, EP overlap, full and per-op
selective activation checkpointing and compile; a checkpoint saved under TP2 resumes under TP1 onto the
one-process curve, and weights under Megatron's mHC keys start a run as ours do. The
layer-level checks against transformers' DeepSeek-V4 modules and a
float64 reference are tests/unit/test_hyper_connections.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.launch import run_training

HC = ("--hybrid.hc_mult", "4")
# Two microbatches of 4 rows per step: one process accumulates what two DP ranks compute. No
# gradient clipping (max_norm 1e6): its coefficient max_norm / |g| rounds with the layout
# (measured on torch 2.11: TP2 5.7e-5 apart at step 4 with clipping, and 1.2e-5 without
# hyper-connections; bitwise equal without clipping), so the layouts' own arithmetic is what is
# compared (tests/distributed/test_hf_import.py says the same).
JOB = (*HC, "--training.steps", "4", "--training.seq_len", "64",
       "--training.local_batch_size", "4", "--training.global_batch_size", "8",
       "--training.max_norm", "1e6")
WHOLE_BATCH = ("--training.local_batch_size", "8")  # layouts without data parallelism
CHECKPOINT = ("--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.folder", "ck",
              "--checkpoint.no_last_save_model_only")
DENSE_LAYOUTS = {
    "fsdp2": (),
    "pp2": ("--parallelism.pipeline_parallel_degree", "2", *WHOLE_BATCH),
    "cp2_chunkwise": ("--parallelism.context_parallel_degree", "2", *WHOLE_BATCH,
                      "--parallelism.context_parallel_linear_mode", "chunkwise"),
    "cp2_head_a2a": ("--parallelism.context_parallel_degree", "2", *WHOLE_BATCH),
}
TP2 = ("--parallelism.tensor_parallel_degree", "2", *WHOLE_BATCH)
MOE = ("--model.flavor", "debug_moe")  # M*EME/*-: MoE layers and an MTP depth (V4's form)
MOE_LAYOUTS = {
    "ep2": (2, ("--parallelism.expert_parallel_degree", "2")),
    "ac_full": (1, ("--activation_checkpoint.mode", "full")),
    "ac_op": (1, ("--activation_checkpoint.mode", "selective",
                  "--activation_checkpoint.selective_ac_option", "op")),
    "compile": (1, ("--compile.enable",)),
}
# EP overlap pairs two microbatches per rank: two rows each, in the one-process run too.
MICROBATCHES_OF_2 = ("--training.local_batch_size", "2")
EP_OVERLAP = ("--parallelism.expert_parallel_degree", "2",
              "--parallelism.expert_parallel_overlap")


def _assert_same_curve(expected: list[float], got: list[float], rel: float = 1e-5) -> None:
    assert len(got) == len(expected) == 4
    for a, b in zip(expected, got, strict=True):
        assert b == pytest.approx(a, rel=rel)


@pytest.mark.extended
def test_every_layout_gives_the_one_process_curve_and_tp2_checkpoints_resume_at_tp1(
        tmp_path, reference_run):
    single = reference_run(*JOB)
    for name, layout in DENSE_LAYOUTS.items():
        _assert_same_curve(single.losses,
                           run_training(tmp_path / name, *JOB, *layout, nproc=2).check().losses)
    saved = run_training(tmp_path / "tp2", *JOB, *TP2, *CHECKPOINT, nproc=2).check()
    assert "Applied tensor parallel (sequence parallel: True)" in saved.output
    _assert_same_curve(single.losses, saved.losses)
    outputs = tmp_path / "tp2" / "outputs"
    shutil.rmtree(outputs / "ck" / "step-4")
    keys = dcp.FileSystemReader(str(outputs / "ck" / "step-2")).read_metadata().state_dict_metadata
    assert tuple(keys["layers.0.hyper_connection.fn"].size) == ((2 + 4) * 4, 4 * 256)
    assert tuple(keys["hc_head.hc_fn"].size) == (4, 4 * 256)
    assert "optimizer.state.layers.3.hyper_connection.scale.exp_avg" in keys
    resumed_in = tmp_path / "resume_tp1"
    shutil.copytree(outputs, resumed_in / "outputs")
    resumed = run_training(resumed_in, *JOB, *CHECKPOINT).check()
    assert "Training starts at step 3" in resumed.output
    assert resumed.losses == pytest.approx(single.losses[2:], rel=1e-5)


MEGATRON_NAMES = {"fn": "mapping_proj.weight", "base": "bias"}


@pytest.mark.extended
def test_a_checkpoint_under_megatrons_mhc_keys_starts_a_run_as_ours_does(tmp_path):
    """The same weights under NVIDIA/Megatron-LM#6401's names (checkpoint/state.py reads them
    as a logical-key form) give a run started from them the curve of one started from ours,
    bit for bit: `inner_layer` dropped, the three alphas written into `scale`."""
    run_training(tmp_path / "saved", *JOB, *CHECKPOINT).check()
    ours = tmp_path / "saved" / "outputs" / "ck" / "step-2"
    megatron = tmp_path / "megatron_form"
    _write_in_megatron_mhc_form(ours, megatron)
    starts = [run_training(tmp_path / f"start_{name}", *JOB, "--training.steps", "2",
                           "--checkpoint.enable", "--checkpoint.initial_load_path",
                           str(folder)).check().losses
              for name, folder in (("ours", ours), ("megatron", megatron))]
    assert starts[0] == starts[1]
    fresh = run_training(tmp_path / "fresh", *JOB, "--training.steps", "1").check().losses
    assert starts[0][0] != pytest.approx(fresh[0], rel=1e-3)  # the trained weights loaded


def _write_in_megatron_mhc_form(ours: Path, folder: Path) -> None:
    """The model tensors of a checkpoint of ours under NVIDIA/Megatron-LM#6401's mHC names:
    each layer nested under `inner_layer`, its hyper-connection's `mapping_proj.weight`, `bias`
    and `alpha_pre` / `alpha_post` / `alpha_res` ([1] each), and the head's `hc_head_fn`,
    `hc_head_base`, `hc_head_scale`."""
    stored = dcp.FileSystemReader(str(ours)).read_metadata().state_dict_metadata
    state = {key: torch.empty(entry.size, dtype=entry.properties.dtype)
             for key, entry in stored.items()
             if key.startswith(("tok_embeddings.", "layers.", "hc_head.", "norm.", "output."))}
    dcp.load(state, checkpoint_id=str(ours), no_dist=True)
    megatron = {}
    for key, value in state.items():
        layer, _, name = key.partition(".hyper_connection.")
        if name == "scale":
            for index, alpha in enumerate(("alpha_pre", "alpha_post", "alpha_res")):
                megatron[f"{layer}.hyper_connection.{alpha}"] = value[index:index + 1].clone()
        elif name:
            megatron[f"{layer}.hyper_connection.{MEGATRON_NAMES[name]}"] = value
        elif key.startswith("hc_head.hc_"):
            megatron["hc_head_" + key[len("hc_head.hc_"):]] = value
        elif key.startswith("layers."):
            _, index, rest = key.split(".", 2)
            megatron[f"layers.{index}.inner_layer.{rest}"] = value
        else:
            megatron[key] = value
    assert not any(key.endswith((".fn", ".base", ".scale")) for key in megatron)
    dcp.save(megatron, checkpoint_id=str(folder), no_dist=True)


# The MoE / MTP layouts (6 runs, about 40 s) in the extended run, which CI's first leg runs: the
# default suite's time is near its budget; the dense layouts above stay in it.
@pytest.mark.extended
def test_moe_and_mtp_with_hyper_connections_give_the_one_process_curve_under_ep_ac_and_compile(
        tmp_path, reference_run):
    single = reference_run(*MOE, *JOB)
    for name, (nproc, layout) in MOE_LAYOUTS.items():
        _assert_same_curve(single.losses, run_training(tmp_path / name, *MOE, *JOB, *layout,
                                                       nproc=nproc).check().losses)
    # EP overlap runs one microbatch's forward with the other's backward: the hyper head
    # is a unit of its own, never gathered by both (parallel/data_parallel.py).
    single = reference_run(*MOE, *JOB, *MICROBATCHES_OF_2)
    _assert_same_curve(single.losses, run_training(
        tmp_path / "ep_overlap", *MOE, *JOB, *MICROBATCHES_OF_2, *EP_OVERLAP,
        nproc=2).check().losses)

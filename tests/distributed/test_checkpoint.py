"""Checkpoints move between layouts: save under one, resume under another (gloo, real ranks).

Fused tensors are stored as logical components, so the saved weights do not depend on the
layout; the resumed losses equal the uninterrupted run to float32 rounding of the new layout's
reductions (measured: at most 4.8e-7 absolute on losses around 7.5; often bitwise).
"""

import shutil

import pytest
import torch.distributed.checkpoint as dcp

from tests.launch import run_training

STEPS = ("--training.local_batch_size", "4", "--training.global_batch_size", "8",
         "--training.seq_len", "128")
CHECKPOINT = ("--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.folder", "ck",
              "--checkpoint.no_last_save_model_only")
LAYOUTS = {
    "1": ((), 1),
    "tp2": (("--parallelism.tensor_parallel_degree", "2"), 2),
    "fsdp2": ((), 2),
    "no_shard2": (("--parallelism.data_parallel_sharding_strategy", "no_shard"), 2),
    "zero1_2": (("--parallelism.data_parallel_sharding_strategy", "optim"), 2),
    "fsdp2_tp2": (("--parallelism.tensor_parallel_degree", "2"), 4),
    "cp2_chunkwise": (("--parallelism.context_parallel_degree", "2",
                       "--parallelism.context_parallel_linear_mode", "chunkwise"), 2),
}


@pytest.fixture(scope="module")
def uninterrupted(reference_run):
    return reference_run("--training.steps", "4", *STEPS).losses


@pytest.fixture(scope="module")
def saved_in_one_process(tmp_path_factory):
    """The 4-step job with checkpoints at steps 2 and 4, in one process: the saving run of
    more than one test here (each works on its own copy of the outputs)."""
    tmp = tmp_path_factory.mktemp("saved_in_one_process")
    run_training(tmp, "--training.steps", "4", *STEPS, *CHECKPOINT).check()
    return tmp / "outputs"


def save_then_resume(tmp_path, saved_under: str, resumed_under: str, saved_in_one_process):
    save_args, save_nproc = LAYOUTS[saved_under]
    load_args, load_nproc = LAYOUTS[resumed_under]
    # The same 4-step job (the LR schedule depends on it), interrupted after step 2: its
    # step-4 checkpoint is removed so the resumed job starts from step 2.
    if saved_under == "1":
        shutil.copytree(saved_in_one_process, tmp_path / "outputs")
    else:
        run_training(tmp_path, "--training.steps", "4", *STEPS, *CHECKPOINT, *save_args,
                     nproc=save_nproc).check()
    shutil.rmtree(tmp_path / "outputs" / "ck" / "step-4")
    metadata = dcp.FileSystemReader(str(tmp_path / "outputs" / "ck" / "step-2")).read_metadata()
    resumed = run_training(tmp_path, "--training.steps", "4", *STEPS, *CHECKPOINT, *load_args,
                           nproc=load_nproc).check()
    assert "Training starts at step 3" in resumed.output
    return metadata, resumed.losses


def check_resumed(losses, uninterrupted):
    assert len(losses) == 2
    assert losses[0] == pytest.approx(uninterrupted[2], rel=1e-6)
    assert losses[1] == pytest.approx(uninterrupted[3], rel=1e-5)


@pytest.mark.parametrize("saved_under, resumed_under", [
    pytest.param("1", "tp2", marks=pytest.mark.extended), ("fsdp2", "1"),
    # Chunkwise CP keeps nothing layout-dependent: its checkpoint resumes in one process.
    pytest.param("cp2_chunkwise", "1", marks=pytest.mark.extended),
    # Same code paths in the other direction, or through ZeRO-1: kept for the slow run.
    pytest.param("zero1_2", "tp2", marks=pytest.mark.slow),
    pytest.param("tp2", "1", marks=pytest.mark.slow),
    pytest.param("no_shard2", "fsdp2", marks=pytest.mark.slow)])
def test_resume_under_another_layout(tmp_path, uninterrupted, saved_under, resumed_under,
                                     request):
    # The one-process save is a fixture only where it is used (it would run for nothing in a
    # selection without a "1" save).
    saved = request.getfixturevalue("saved_in_one_process") if saved_under == "1" else None
    metadata, losses = save_then_resume(tmp_path, saved_under, resumed_under, saved)
    keys = metadata.state_dict_metadata
    # Components in global coordinates, never the (layout-dependent) fused tensor.
    assert "layers.0.mamba.in_proj.weight" not in keys
    z = keys["layers.0.mamba.in_proj.weight.z"]
    assert tuple(z.size) == (512, 256)  # d_inner x dim, whatever the TP degree
    assert "layers.1.mlp.fc1.weight_w" in keys and "layers.6.gdn.in_proj.weight.beta" in keys
    assert "optimizer.state.layers.1.mlp.fc1.weight_v.exp_avg" in keys
    check_resumed(losses, uninterrupted)


@pytest.mark.slow
def test_four_process_fsdp_x_tp_checkpoint_loads_in_one_process(tmp_path, uninterrupted):
    _, losses = save_then_resume(tmp_path, "fsdp2_tp2", "1", None)
    check_resumed(losses, uninterrupted)


@pytest.mark.extended
def test_grouped_pattern_saves_logical_keys_and_resumes_under_tp(tmp_path):
    grouped = ("--hybrid.pattern", "[M*][M-][G-]")
    saving = run_training(tmp_path, "--training.steps", "4", *STEPS, *CHECKPOINT, *grouped).check()
    shutil.rmtree(tmp_path / "outputs" / "ck" / "step-4")
    keys = dcp.FileSystemReader(str(tmp_path / "outputs" / "ck" / "step-2")).read_metadata()
    keys = keys.state_dict_metadata
    # Every sub-layer of group 0 carries the group's logical index.
    for key in ("layers.0.mamba.in_proj.weight.z", "layers.0.attention.wq.weight",
                "layers.0.attention_norm.weight", "layers.2.gdn.in_proj.weight.query",
                "optimizer.state.layers.1.mlp.fc1.weight_w.exp_avg"):
        assert key in keys, key
    assert not any(".layers." in key.split("layers.", 1)[-1] for key in keys if "layers." in key)
    resumed = run_training(tmp_path, "--training.steps", "4", *STEPS, *CHECKPOINT, *grouped,
                           "--parallelism.tensor_parallel_degree", "2", nproc=2).check()
    check_resumed(resumed.losses, saving.losses)


@pytest.mark.parametrize("pattern, message", [
    ("M-*-M-G-*", "key(s) missing from the checkpoint: layers.8.attention.wk.weight"),
    pytest.param("M-*-M-", "checkpoint key(s) the model does not have: layers.6.gdn.A_log",
                 marks=pytest.mark.slow),
])
def test_mismatched_checkpoint_fails_before_training_naming_keys(tmp_path, pattern, message):
    run_training(tmp_path, "--training.steps", "2", *STEPS, *CHECKPOINT).check()
    result = run_training(tmp_path, "--training.steps", "4", *STEPS, *CHECKPOINT,
                          "--hybrid.pattern", pattern)
    assert result.returncode != 0
    assert "does not match the model" in result.output and message in result.output
    assert "Training starts at step" not in result.output


def test_unfinished_save_is_not_taken_as_the_latest(tmp_path, saved_in_one_process):
    shutil.copytree(saved_in_one_process, tmp_path / "outputs")  # a finished 4-step run
    folder = tmp_path / "outputs" / "ck"
    # A save killed mid-way: data files written, DCP's .metadata (written last) missing.
    shutil.copytree(folder / "step-4", folder / "step-6")
    (folder / "step-6" / ".metadata").unlink()
    (folder / "step-6" / "__0_0.distcp").write_bytes(b"truncated")
    resumed = run_training(tmp_path, "--training.steps", "6", *STEPS, *CHECKPOINT).check()
    assert "Training starts at step 5" in resumed.output
    assert len(resumed.losses) == 2


@pytest.mark.extended
def test_transformer_checkpoint_loads_into_grouped_and_hybrid_patterns_by_order(tmp_path):
    flat, grouped = ("--hybrid.pattern", "*-*-"), ("--hybrid.pattern", "[*-][*-]")
    run_training(tmp_path / "flat", "--training.steps", "2", *STEPS, *CHECKPOINT, *flat).check()
    source = str(tmp_path / "flat" / "outputs" / "ck" / "step-2")
    initial = ("--checkpoint.enable", "--checkpoint.initial_load_path", source,
               "--checkpoint.folder", "fresh", "--training.steps", "1", *STEPS)
    # The same weights seen through the flat and the grouped model: identical first loss.
    same = run_training(tmp_path / "same", *initial, *flat).check()
    into_grouped = run_training(tmp_path / "grouped", *initial, *grouped,
                                "--hybrid.load_layers_by_order").check()
    assert into_grouped.losses == same.losses
    # Without the option the keys differ and the load is refused, naming them.
    refused = run_training(tmp_path / "refused", *initial, *grouped)
    assert refused.returncode != 0 and "layers.0.mlp.fc1.weight_w" in refused.output
    # A hybrid pattern takes the attention and MLP layers; its Mamba layers keep fresh init.
    hybrid = run_training(tmp_path / "hybrid", *initial, "--hybrid.pattern", "M*-M*-",
                          "--hybrid.load_layers_by_order").check()
    assert "['mamba'] layers keep their fresh init" in hybrid.output
    ambiguous = run_training(tmp_path / "ambiguous", *initial, "--hybrid.pattern", "*-*-*-",
                             "--hybrid.load_layers_by_order")
    assert ambiguous.returncode != 0
    assert "the model has 3 attention layer(s) [0, 2, 4], the checkpoint 2 [0, 2]" in ambiguous.output

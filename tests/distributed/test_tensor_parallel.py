"""Tensor (+sequence) parallelism against one device: logical weights, logits, every gradient,
and the trainer's loss curve (gloo, real ranks)."""

from pathlib import Path

import pytest

from tests.launch import run_training, run_worker

WORKER = Path(__file__).with_name("tp_worker.py")


def check_against_single_device(result: dict) -> None:
    # Initial weights are layout-independent bit for bit (logical values, fused tensors
    # de-interleaved); logits and gradients differ only by float32 reduction order.
    assert max(result["weights"].values()) == 0.0
    assert result["logits"] < 1e-5
    worst = max(result["grads"], key=result["grads"].get)
    assert result["grads"][worst] < 2e-5, (worst, result["grads"][worst])


@pytest.mark.parametrize("flavor, sequence_parallel, pattern", [
    ("debug", "1", ""), ("debug", "0", ""), ("debug_moe", "1", ""), ("debug_grouped", "1", ""),
    ("debug", "1", "M+-MD-")])
def test_tp2_matches_single_device(flavor, sequence_parallel, pattern):
    result = run_worker(WORKER, "--flavor", flavor, "--sequence-parallel", sequence_parallel,
                        "--pattern", pattern)
    check_against_single_device(result)
    # Inside the regions the model read local views; the registry kept the DTensors.
    assert result["rewritten_parameters"] == []
    shapes = result["local_shapes"]
    if pattern == "M+-MD-":
        # Megatron's MLA plan: query / KV up-projections split by heads (dim 0), the output
        # projection by its input (dim 1); down-projections, latent norms and DSA's indexer
        # replicated (the indexer's target is summed over the TP ranks' heads).
        for layer in ("layers.1.mla", "layers.4.dsa"):
            for name, split_dim in (("q_b_proj", 0), ("kv_b_proj", 0), ("o_proj", 1)):
                local, full = shapes[f"{layer}.{name}.weight"]
                assert local[split_dim] * 2 == full[split_dim], name
            for name in ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm"):
                local, full = shapes[f"{layer}.{name}.weight"]
                assert local == full, name
        indexer = [name for name in shapes if ".indexer." in name]
        assert len(indexer) == 5 and all(shapes[n][0] == shapes[n][1] for n in indexer)
    if flavor == "debug" and not pattern:
        # Sharded by the parameter's own annotation, including the gated norm ("Norm" by name).
        for name in ("layers.0.mamba.in_proj.weight", "layers.0.mamba.A_log",
                     "layers.0.mamba.norm.weight", "layers.0.mamba.conv1d.weight",
                     "layers.6.gdn.in_proj.weight", "layers.2.attention.wk.weight"):
            local, full = shapes[name]
            assert local[0] * 2 == full[0], name
        for name in ("layers.0.mamba.out_proj.weight", "layers.2.attention.wo.weight"):
            local, full = shapes[name]
            assert local[1] * 2 == full[1], name
        # Replicated: GDN's shared per-head norm and the residual-stream norms.
        for name in ("layers.6.gdn.norm.weight", "layers.0.mamba_norm.weight", "norm.weight"):
            local, full = shapes[name]
            assert local == full, name


@pytest.mark.slow
@pytest.mark.parametrize("flavor, pattern", [("debug", ""), ("debug_moe", ""),
                                             ("debug", "M+-MD-")])
def test_fsdp2_x_tp2_matches_single_device(flavor, pattern):
    check_against_single_device(run_worker(WORKER, "--flavor", flavor, "--pattern", pattern,
                                           "--dp", "2", nproc=4))


def test_trainer_loss_curve_tp2_sp_matches_single_process(tmp_path, reference_run):
    args = ("--training.steps", "4", "--training.seq_len", "128")
    single = reference_run(*args)
    tp = run_training(tmp_path, *args, "--parallelism.tensor_parallel_degree", "2",
                      nproc=2).check()
    assert "Applied tensor parallel (sequence parallel: True)" in tp.output
    for a, b in zip(single.losses, tp.losses, strict=True):
        assert a == pytest.approx(b, rel=1e-5)


@pytest.mark.slow
def test_trainer_loss_curve_fsdp2_x_tp2_matches_single_process(tmp_path, reference_run):
    args = ("--training.steps", "4", "--training.local_batch_size", "4")
    single = reference_run(*args, "--training.global_batch_size", "8")
    mixed = run_training(tmp_path, *args, "--parallelism.tensor_parallel_degree", "2",
                         "--parallelism.data_parallel_shard_degree", "2", nproc=4).check()
    for a, b in zip(single.losses, mixed.losses, strict=True):
        assert a == pytest.approx(b, rel=1e-5)


def test_tp_divisibility_is_checked_before_any_process_group(tmp_path):
    result = run_training(tmp_path, "--training.steps", "1", "--parallelism.tensor_parallel_degree",
                          "2", "--hybrid.pattern", "G-", "--training.seq_len", "255", nproc=2)
    assert result.returncode != 0
    assert ("training.seq_len (sequence parallel)=255 is not divisible by "
            "parallelism.tensor_parallel_degree=2") in result.output
    assert "Building device mesh" not in result.output


@pytest.mark.slow
def test_trainer_moe_mtp_with_tp2_and_activation_checkpointing(tmp_path):
    args = ("--training.steps", "3")
    single = run_training(tmp_path, *args, config="hybrid_moe.toml").check()
    tp = run_training(tmp_path, *args, "--parallelism.tensor_parallel_degree", "2",
                      "--activation_checkpoint.mode", "full", nproc=2,
                      config="hybrid_moe.toml").check()
    for a, b in zip(single.losses, tp.losses, strict=True):
        assert a == pytest.approx(b, rel=1e-5)

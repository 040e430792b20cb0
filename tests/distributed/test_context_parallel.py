"""Context parallelism: zigzag shards, all-gathered K/V for attention, sequence <-> head
all-to-alls around the Mamba / GDN conv and scan. Layer-level runs compare float64 logits and
gradients with one device; trainer runs compare loss curves with one process."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launch import run_training, run_worker

WORKER = Path(__file__).with_name("cp_worker.py")


def _check(results):
    for pattern, result in results.items():
        for case in ("plain", "packed"):
            assert result[case]["logits"] < 1e-12 * result[case]["logit_scale"], (pattern, result)
            assert result[case]["grads"] < 1e-12, (pattern, result)


def test_cp2_layers_match_one_device():
    """Mamba (4 heads, 2 groups per rank pair), GDN, attention and MLP; MLA and DSA (6 of up
    to 32 keys per query, with the indexer's loss); KDA; plain and packed rows."""
    results = run_worker(WORKER, "--pattern", "M*G-M,M+-D-,MK-*K-,MZ-*Z-", nproc=2)
    # MZ-*Z-: tests/throwaway_kind.py, a recurrent kind that only the tests register
    assert list(results) == ["M*G-M", "M+-D-", "MK-*K-", "MZ-*Z-"]
    _check(results)


@pytest.mark.slow
def test_cp4_with_fewer_groups_than_ranks_matches_one_device():
    """cp=4 > Mamba's 2 groups and GDN's 2 key heads: ranks share a group."""
    _check(run_worker(WORKER, "--pattern", "M*G-M,M+-D-", "--mamba-groups", "2", nproc=4))


def _assert_same_curve(single, parallel):
    assert len(single.losses) == len(parallel.losses) == 4
    for a, b in zip(single.losses, parallel.losses, strict=True):
        assert a == pytest.approx(b, rel=1e-6)


def test_trainer_cp2_with_packed_documents_matches_one_process(tmp_path, reference_run):
    """The real trainer on packed pydoc rows (document masking): CP=2 with FSDP over the CP
    ranks gives the loss curve of one process."""
    args = ("--training.steps", "4", "--training.local_batch_size", "4", "--hybrid.document_masking")
    single = reference_run(*args)
    cp = run_training(tmp_path, *args, "--parallelism.context_parallel_degree", "2",
                      nproc=2).check()
    assert "Applied context parallel over 2 ranks" in cp.output
    assert "Applied data parallel 'optim_grads_params' over ('fsdp',)" in cp.output
    _assert_same_curve(single, cp)


@pytest.mark.slow
def test_trainer_cp2_x_tp2_matches_one_process(tmp_path, reference_run):
    args = ("--training.steps", "4", "--training.local_batch_size", "4", "--hybrid.document_masking")
    single = reference_run(*args)
    cp_tp = run_training(tmp_path, *args, "--parallelism.context_parallel_degree", "2",
                         "--parallelism.tensor_parallel_degree", "2", nproc=4).check()
    _assert_same_curve(single, cp_tp)


@pytest.mark.slow
def test_trainer_cp2_plain_rows_matches_one_process(tmp_path, reference_run):
    args = ("--training.steps", "4", "--training.seq_len", "128")
    single = reference_run(*args)
    _assert_same_curve(single, run_training(
        tmp_path, *args, "--parallelism.context_parallel_degree", "2", nproc=2).check())


@pytest.mark.slow
def test_trainer_pp2_x_cp2_matches_one_process(tmp_path, reference_run):
    """positions / seq_idx travel as extra_kwargs, which torch's schedule hands every stage."""
    args = ("--training.steps", "4", "--training.local_batch_size", "4", "--hybrid.document_masking")
    single = reference_run(*args)
    _assert_same_curve(single, run_training(
        tmp_path, *args, "--parallelism.context_parallel_degree", "2",
        "--parallelism.pipeline_parallel_degree", "2",
        "--parallelism.pipeline_parallel_microbatch_size", "2",
        "--parallelism.pipeline_parallel_schedule", "1F1B", nproc=4).check())


# ---- chunkwise state passing (--parallelism.context_parallel_linear_mode chunkwise)

def test_cp2_chunkwise_layers_match_one_device():
    """Mamba, GDN and KDA with state passing between pieces, next to attention, MLA and DSA;
    packed rows zigzagged as a whole, so documents start inside pieces, exactly at a piece's
    start, and span several pieces and both ranks."""
    results = run_worker(WORKER, "--pattern", "M*G-M,M+-D-,MW-,MC-MH-W-,MK-*K-,MZ-*Z-",
                         "--linear-mode", "chunkwise", nproc=2)
    # MW-: DeepSeek-V4's window key halo; MC-MH-W-: its compressors' rows gathered (blocks
    # straddling pieces, C's top-k and trained indexer); MK-*K-: KDA's state passing;
    # MZ-*Z-: a recurrent kind that only the tests register (tests/throwaway_kind.py), which
    # the recurrent-core contract alone carries through both CP modes.
    assert list(results) == ["M*G-M", "M+-D-", "MW-", "MC-MH-W-", "MK-*K-", "MZ-*Z-"]
    _check(results)


@pytest.mark.slow
def test_cp4_chunkwise_layers_match_one_device():
    _check(run_worker(WORKER, "--pattern", "M*G-M,MW-,MC-MH-W-", "--mamba-groups", "1",
                      "--linear-mode", "chunkwise", nproc=4))


@pytest.mark.parametrize("mode", ["head_a2a", "chunkwise"])
def test_counted_mamba_traffic_is_the_benchs_formula(mode):
    """bench/context_parallel_traffic.py's bytes per M layer, byte for byte against what the
    collectives received in a real CP2 forward and backward (float64, 2 rows)."""
    from bench.context_parallel_traffic import mamba_layer_bytes
    from titan_hybrid.model.args import MambaArgs

    counted = run_worker(WORKER, "--count-traffic", "--linear-mode", mode, nproc=2)
    mamba = MambaArgs(d_state=4, head_dim=8, n_groups=2, chunk_size=8)
    for case in ("plain", "packed"):
        assert counted[case] == mamba_layer_bytes(
            mode, 2, counted["args"]["seq_len"], mamba, 32, batch=counted["args"]["batch"],
            documents=case == "packed", act_bytes=8, state_bytes=8), case


# M*-G- with 6 GDN value heads over 2 key heads: head_a2a refuses CP 4 and CP 2 x TP 2 for
# them (per TP rank 6 or 3 value heads do not split), chunkwise takes every layout.
ODD_HEADS = ("--model.flavor", "debug_odd_heads", "--training.steps", "4",
             "--training.local_batch_size", "4", "--hybrid.document_masking")
CHUNKWISE = ("--parallelism.context_parallel_linear_mode", "chunkwise")


@pytest.mark.extended
def test_trainer_cp2_chunkwise_matches_one_process(tmp_path, reference_run):
    single = reference_run(*ODD_HEADS)
    cp = run_training(tmp_path, *ODD_HEADS, *CHUNKWISE,
                      "--parallelism.context_parallel_degree", "2", nproc=2).check()
    assert "Mamba2 / GDN / KDA: chunkwise" in cp.output
    _assert_same_curve(single, cp)


@pytest.mark.slow
def test_trainer_cp4_chunkwise_matches_one_process(tmp_path, reference_run):
    single = reference_run(*ODD_HEADS)
    _assert_same_curve(single, run_training(
        tmp_path, *ODD_HEADS, *CHUNKWISE, "--parallelism.context_parallel_degree", "4",
        nproc=4).check())


@pytest.mark.slow
def test_trainer_cp2_chunkwise_x_tp2_matches_one_process(tmp_path, reference_run):
    single = reference_run(*ODD_HEADS)
    _assert_same_curve(single, run_training(
        tmp_path, *ODD_HEADS, *CHUNKWISE, "--parallelism.context_parallel_degree", "2",
        "--parallelism.tensor_parallel_degree", "2", nproc=4).check())


@pytest.mark.slow
def test_trainer_pp2_x_cp2_chunkwise_matches_one_process(tmp_path, reference_run):
    staged = (*ODD_HEADS, "--hybrid.pattern", "M*-|G-")  # the same layers, in two stages
    single = reference_run(*staged)
    _assert_same_curve(single, run_training(
        tmp_path, *staged, *CHUNKWISE, "--parallelism.context_parallel_degree", "2",
        "--parallelism.pipeline_parallel_degree", "2",
        "--parallelism.pipeline_parallel_microbatch_size", "2",
        "--parallelism.pipeline_parallel_schedule", "1F1B", nproc=4).check())

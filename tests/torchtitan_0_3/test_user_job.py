"""titan_hybrid's model in a torchtitan 0.3 job of the user's own (README, "Using the model
from any torchtitan job"): the README's registry block as written (an MoE + MTP flavor, 0.3's
default SPMD backend, torchtitan's trainer, optimizer, data loader, metrics and checkpointer,
titan_hybrid's HybridLoss), every flavor of the flavor table, the one-process curve under TP2
and FSDP2, a resume from torchtitan's own checkpointer, and one line for what cannot run.

Collected only in the torchtitan 0.3 venv (tests/conftest.py; CI's 0.3 leg)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.launch import REPO_ROOT
from tests.torchtitan_0_3.test_adapter import (
    logged_losses,
    readme_registry,
    readme_user_command,
    user_job_run,
)
from titan_hybrid.model.args import hybrid_flavors

# The layout-independent batches: every layout reads the same global batch.
OURS = ('dataloader=HuggingFaceTextDataLoader.Config(dataset="pydoc")',
        'dataloader=HybridDataLoader(dataset="pydoc")')


def registry_with(*replacements: tuple[str, str]) -> str:
    source = readme_registry()
    for old, new in replacements:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    return source.replace("import HybridLoss, model_spec",
                          "import HybridDataLoader, HybridLoss, model_spec")


# The debug flavors as they are, the GPU-sized ones (0.9-2B parameters) at width 256 on one row
# of 64 tokens, their layers and sections otherwise as they are. In two parts of about equal
# time, so that the leg's two workers can share them (.ci/run steals work between them): the
# GPU-sized ones take ~19 s each, the debug ones ~4 s (measured: 86 s for the 21 debug ones,
# 173 s for the 9 GPU-sized ones), so the debug ones go with two GPU-sized ones.
FLAVOR_ENTRIES = [name if args.dim <= 256 else f"{name}:dim=256:local_batch_size=1"
                  for name, args in hybrid_flavors.items()]
GPU_SIZED = [entry for entry in FLAVOR_ENTRIES if ":" in entry]
FLAVOR_HALVES = {"debug_and_two_gpu_sized": [e for e in FLAVOR_ENTRIES if e not in GPU_SIZED[2:]],
                 "gpu_sized": GPU_SIZED[2:]}


@pytest.mark.parametrize("half", FLAVOR_HALVES)
def test_every_flavor_trains_a_step_in_a_users_job(tmp_path, half):
    """The README's registry with each flavor of the flavor table, one step each in one
    process."""
    flavors = FLAVOR_HALVES[half]
    (tmp_path / "my_registry.py").write_text(readme_registry())
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO_ROOT)])}
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tests" / "torchtitan_0_3" / "user_job_flavors.py"),
         str(tmp_path / "out"), *flavors], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=900, cwd=REPO_ROOT, env=env)  # one stream: the markers in order
    assert result.returncode == 0, result.stdout[-3000:]
    output = re.sub(r"\x1b\[[0-9;]*m", "", result.stdout)
    runs = re.split(r"^== ", output, flags=re.MULTILINE)[1:]
    assert [run.split()[0] for run in runs] == [f.split(":")[0] for f in flavors]
    for run in runs:
        flavor = run.split()[0]
        loss = re.search(r"step:\s+1\s+loss:\s+([0-9.]+)", run)
        assert loss and 0 < float(loss.group(1)) < 20, flavor
        assert f"{flavor} trained" in run


def test_the_readmes_block_trains_an_moe_mtp_flavor_on_0_3s_default_backend(tmp_path):
    """As written (debug_moe on spmd_types, torchtitan's loader): one process and TP2 (the
    README's command) give the same curve. (FSDP2 on this backend: the next test, on a loader
    whose global batch is the same under every layout.)"""
    assert 'model_spec("debug_moe")' in readme_registry()
    assert "spmd_backend" not in readme_registry()  # 0.3's default
    one = user_job_run(tmp_path / "one", nproc=1)
    tp2 = user_job_run(tmp_path / "tp2", command=readme_user_command())
    for result in (one, tp2):
        assert result.returncode == 0, result.stderr[-3000:]
    losses = logged_losses(one.stdout + one.stderr)
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert logged_losses(tp2.stdout + tp2.stderr) == losses


def test_fsdp2_and_tp2_give_the_one_process_curve(tmp_path):
    """The MoE + MTP flavor on the same global batch of 8 rows in microbatches of 4 (the
    load-balancing loss is one per microbatch): one process accumulating 2 microbatches, FSDP2
    (one a rank) and TP2 (2 processes on each) give the same curve on 0.3's default backend,
    spmd_types. (partial_dtensor, titan_hybrid's registry's backend: test_adapter.py's
    layouts.)"""
    registry = registry_with(OURS)
    # float32 parameters: 0.3's FSDP computes in bf16 by default (mixed_precision_param),
    # which one process and TP do not
    job = ("--training.local_batch_size", "4", "--training.global_batch_size", "8",
           "--training.mixed_precision_param", "float32")
    one = user_job_run(tmp_path / "one", *job, nproc=1, registry=registry)
    fsdp2 = user_job_run(tmp_path / "fsdp2", *job, nproc=2, registry=registry)
    tp2 = user_job_run(tmp_path / "tp2", *job, "--parallelism.tensor_parallel_degree", "2",
                       nproc=2, registry=registry)
    for result in (one, fsdp2, tp2):
        assert result.returncode == 0, result.stderr[-3000:]
    losses = logged_losses(one.stdout + one.stderr)
    assert len(losses) == 3 and losses[-1] < losses[0]
    for layout in (fsdp2, tp2):
        assert logged_losses(layout.stdout + layout.stderr) == pytest.approx(losses, rel=1e-5)


@pytest.mark.parametrize("layout", [("--training.local_batch_size", "4"),
                                    ("--parallelism.tensor_parallel_degree", "2")],
                         ids=["fsdp2", "tp2"])
def test_torchtitans_checkpointer_resumes_onto_the_straight_curve(tmp_path, layout):
    """torchtitan's own CheckpointManager in the user's job (full state: the interval saves
    keep the optimizer): 4 steps straight, saving at steps 2 and 4, and a resume to 4 from a
    copy of the step-2 checkpoint alone give the same steps 3 and 4."""
    registry = registry_with(OURS)
    checkpoint = ("--checkpoint.enable", "--checkpoint.interval", "2",
                  "--checkpoint.no-last-save-model-only", "--training.steps", "4")
    straight = user_job_run(tmp_path / "straight", *layout, *checkpoint, nproc=2,
                            registry=registry)
    assert straight.returncode == 0, straight.stderr[-3000:]
    saved = tmp_path / "straight" / "out" / "checkpoint"
    assert sorted(path.name for path in saved.iterdir()) == ["step-2", "step-4"]
    shutil.copytree(saved / "step-2", tmp_path / "resumed" / "out" / "checkpoint" / "step-2")
    resumed = user_job_run(tmp_path / "resumed", *layout, *checkpoint, nproc=2,
                           registry=registry)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert re.search(r"[Ll]oad.*step[- ]2|step[- ]2.*load", resumed.stdout + resumed.stderr)
    want = logged_losses(straight.stdout + straight.stderr)
    got = logged_losses(resumed.stdout + resumed.stderr)
    assert len(want) == 4 and len(got) == 2, (want, got)
    assert got == pytest.approx(want[2:], rel=1e-5)


def _user_job_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("error: ")]


def test_a_loss_that_cannot_take_the_flavors_outputs_is_one_line(tmp_path):
    registry = readme_registry().replace("loss=HybridLoss.Config()",
                                         "loss=CrossEntropyLoss.Config()").replace(
        "from torchtitan.trainer import Trainer",
        "from torchtitan.components.loss import CrossEntropyLoss\n"
        "from torchtitan.trainer import Trainer")
    result = user_job_run(tmp_path, nproc=1, registry=registry)
    assert result.returncode != 0  # the worker's status is 2, torchrun's own 1
    assert _user_job_lines(result) == [
        "error: loss: CrossEntropyLoss takes logits, but model_spec('debug_moe') with pattern "
        "'M*EME/*-' also returns an auxiliary loss (MoE / indexer layers) and MTP logits; set "
        "loss=HybridLoss.Config() (from titan_hybrid.config_registry import HybridLoss)"]
    assert "AttributeError" not in result.stderr


@pytest.mark.parametrize("args, line", [
    (("--parallelism.spmd_backend", "full_dtensor"),
     "error: parallelism.spmd_backend='full_dtensor': titan_hybrid's layers take plain "
     "tensors, not full_dtensor's DTensor inputs; use 'spmd_types' (0.3's default) or "
     "'partial_dtensor'"),
    (("--parallelism.context_parallel_degree", "2"),
     "error: parallelism.context_parallel_degree=2 with parallelism.spmd_backend='spmd_types': "
     "titan_hybrid's context parallelism runs on 'partial_dtensor' (set it in your config)"),
], ids=["full_dtensor", "spmd_types-cp2"])
def test_what_a_backend_cannot_run_is_one_line_on_each_rank(tmp_path, args, line):
    # torchrun's launcher: forked workers would be stopped as soon as the first one fails
    result = user_job_run(tmp_path, *args, nproc=2, fork_workers=False)
    assert result.returncode != 0
    # both ranks print it (their lines may interleave in the one stderr pipe)
    assert result.stderr.count(line) == 2, result.stderr[-3000:]

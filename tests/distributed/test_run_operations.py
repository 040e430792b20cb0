"""Operating a run: extend it, kill it, damage its checkpoints, let it diverge (real processes).

One small job (seq_len 128, 2 sequences a step) keeps each launch short; its curve in one
process is deterministic, so every resumed curve must equal the uninterrupted one bit for bit.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import REPO_ROOT, run_training, wait_for

SMALL = ("--training.local_batch_size", "2", "--training.seq_len", "128")
CHECKPOINT = ("--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.folder", "ck")
STEPS = 8


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    return run_training(tmp, "--training.steps", str(STEPS), *SMALL).check().losses


def checkpoints(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "outputs" / "ck").iterdir())


@pytest.fixture(scope="module")
def extended(tmp_path_factory):
    """6 steps with checkpoints, then the same command with 8 steps."""
    tmp = tmp_path_factory.mktemp("extended")
    run_training(tmp, "--training.steps", "6", *SMALL, *CHECKPOINT).check()
    return run_training(tmp, "--training.steps", str(STEPS), *SMALL, *CHECKPOINT).check()


def test_finished_run_extends_with_more_steps(extended):
    assert "Training starts at step 7" in extended.output
    assert len(extended.losses) == 2


@pytest.mark.extended
def test_model_only_checkpoint_needs_the_fresh_optimizer_flag(tmp_path, extended):
    run_training(tmp_path, "--training.steps", "6", *SMALL, *CHECKPOINT,
                 "--checkpoint.last_save_model_only").check()
    refused = run_training(tmp_path, "--training.steps", str(STEPS), *SMALL, *CHECKPOINT)
    assert refused.returncode == 2
    assert "holds model weights only" in refused.output
    assert "--checkpoint.resume_with_fresh_optimizer" in refused.output
    assert "Traceback" not in refused.output
    fresh = run_training(tmp_path, "--training.steps", str(STEPS), *SMALL, *CHECKPOINT,
                         "--checkpoint.resume_with_fresh_optimizer").check()
    assert "Training starts at step 7" in fresh.output
    # The weights and the data position of step 6 (the first loss comes before any update),
    # then a different optimizer state (Adam's moments start from zero).
    assert fresh.losses[0] == extended.losses[0]
    assert fresh.losses[1] != extended.losses[1]


def _damage(kind: str, folder: Path) -> None:
    data = folder / "__0_0.distcp"
    if kind == "truncated":
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    elif kind == "deleted":
        data.unlink()
    elif kind == "flipped":
        with open(data, "r+b") as f:
            f.seek(data.stat().st_size // 2)
            f.write(bytes(64 * 1024))  # zeros over real float bytes: same size, new content
    elif kind == "metadata":
        (folder / ".metadata").write_bytes(b"not a pickle")


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A finished 8-step run with checkpoints at steps 2, 4, 6, 8."""
    tmp = tmp_path_factory.mktemp("saved")
    run_training(tmp, "--training.steps", str(STEPS), *SMALL, *CHECKPOINT).check()
    return tmp


# Every kind of damage is told apart by tests/unit/test_checkpoint_integrity.py; end to end, the
# default suite runs the one only checksums can see.
@pytest.mark.parametrize("kind", [pytest.param("truncated", marks=pytest.mark.slow),
                                  pytest.param("deleted", marks=pytest.mark.slow), "flipped",
                                  pytest.param("metadata", marks=pytest.mark.slow)])
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, saved_run,
                                                                  uninterrupted, kind):
    shutil.copytree(saved_run / "outputs" / "ck", tmp_path / "outputs" / "ck")
    shutil.rmtree(tmp_path / "outputs" / "ck" / "step-8")  # interrupted after step 6's save
    _damage(kind, tmp_path / "outputs" / "ck" / "step-6")
    resumed = run_training(tmp_path, "--training.steps", str(STEPS), *SMALL, *CHECKPOINT).check()
    assert f"Checkpoint {tmp_path}/outputs/ck/step-6 is damaged" in resumed.output
    assert "Training starts at step 5" in resumed.output
    assert resumed.losses == uninterrupted[4:]
    # The damaged folder was set aside (removed at the next start); step 6 was saved anew.
    assert checkpoints(tmp_path) == ["step-2", "step-4", "step-6", "step-6.damaged", "step-8"]


def test_no_intact_checkpoint_stops_with_a_clear_message(tmp_path, saved_run):
    shutil.copytree(saved_run / "outputs" / "ck", tmp_path / "outputs" / "ck")
    for folder in (tmp_path / "outputs" / "ck").iterdir():
        _damage("truncated", folder)
    result = run_training(tmp_path, "--training.steps", str(STEPS), *SMALL, *CHECKPOINT)
    assert result.returncode == 2
    assert "error: no intact checkpoint in checkpoint.folder" in result.output
    assert "step-8: __0_0.distcp has" in result.output
    assert "Traceback" not in result.output and "Training starts" not in result.output


def test_load_step_names_exactly_one_checkpoint(tmp_path, saved_run):
    shutil.copytree(saved_run / "outputs" / "ck", tmp_path / "outputs" / "ck")
    result = run_training(tmp_path, "--training.steps", str(STEPS), *SMALL, *CHECKPOINT,
                          "--checkpoint.load_step", "5")
    assert result.returncode == 2
    assert f"error: checkpoint.load_step=5 but '{tmp_path}/outputs/ck/step-5' does not exist" \
        in result.output


def test_keep_latest_k_keeps_the_last_intact_checkpoint(tmp_path, saved_run):
    shutil.copytree(saved_run / "outputs" / "ck", tmp_path / "outputs" / "ck")
    for step in (8, 6):
        shutil.rmtree(tmp_path / "outputs" / "ck" / f"step-{step}")
    shutil.copytree(saved_run / "outputs" / "ck" / "step-6", tmp_path / "outputs" / "ck" / "step-6")
    _damage("truncated", tmp_path / "outputs" / "ck" / "step-6")
    # Resumes from step 4, saves only at step 8: the damaged step-6 must not count as one of
    # the 2 kept, or step-4 (the last intact one before step-8) would go (torchtitan's rule).
    run_training(tmp_path, "--training.steps", str(STEPS), *SMALL, "--checkpoint.enable",
                 "--checkpoint.folder", "ck", "--checkpoint.interval", "8",
                 "--checkpoint.keep_latest_k", "2").check()
    assert checkpoints(tmp_path) == ["step-4", "step-6.damaged", "step-8"]


def test_divergence_stops_before_the_step_is_applied_or_saved(tmp_path):
    result = run_training(tmp_path, "--training.steps", "6", *SMALL, "--optimizer.lr", "1e4",
                          "--checkpoint.enable", "--checkpoint.interval", "1",
                          "--checkpoint.folder", "ck")
    assert result.returncode == 3
    assert "error: training diverged at step 2: loss = nan on rank 0" in result.output
    assert "Traceback" not in result.output and "Training completed" not in result.output
    assert len(result.losses) == 1  # step 2 was never logged
    assert checkpoints(tmp_path) == ["step-1"]


def test_divergence_on_any_pipeline_stage_stops_every_rank(tmp_path):
    result = run_training(tmp_path, "--training.steps", "4", *SMALL, "--optimizer.lr", "1e4",
                          "--parallelism.pipeline_parallel_degree", "2", nproc=2)
    assert result.returncode == 3
    assert "error: training diverged at step 2:" in result.output
    assert "gradient norm = nan on rank 0" in result.output  # the first stage's gradients too
    assert "Traceback" not in result.output


# ---- kill -9 ---------------------------------------------------------------------------------


def _launch(tmp_path: Path, steps: int, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "titan_hybrid.launch",
               "--job.config_file", str(REPO_ROOT / "train_configs" / "hybrid.toml"),
               "--job.dump_folder", str(tmp_path / "outputs"),
               "--training.steps", str(steps), *SMALL, *CHECKPOINT,
               "--hybrid.loss_curve_file", "curve.jsonl", *extra]
    return subprocess.Popen(command, cwd=REPO_ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _kill_everything_of(tmp_path: Path, launcher: subprocess.Popen) -> None:
    """kill -9 of the launcher's process group and of every worker (torchrun starts workers in
    sessions of their own): what a crashed node leaves behind."""
    os.killpg(launcher.pid, signal.SIGKILL)
    marker = str(tmp_path / "outputs").encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(int(pid), signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # the process ended while we looked
    launcher.wait()


def _curve(tmp_path: Path) -> list[float]:
    lines = (tmp_path / "outputs" / "curve.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if "loss" in json.loads(line)]


ASYNC = ("--checkpoint.async_mode", "async")


def _saving(ck: Path) -> bool:
    """A save is being written: its .partial folder exists."""
    return ck.is_dir() and any(p.name.endswith(".partial") for p in ck.iterdir())


def _losses_logged(tmp_path: Path) -> int:
    """Steps in the loss curve file so far (whole lines only: the run may be writing one)."""
    path = tmp_path / "outputs" / "curve.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return sum('"loss":' in line for line in lines)


# Where each trial's kill lands: a state of the run (never a guessed time), one that lasts a
# step or a save, so the watcher below cannot miss it.
MOMENTS = {
    # the first steps: a loss is logged, no save has begun (the restart starts over)
    "early": lambda tmp_path, ck: (_losses_logged(tmp_path) >= 1
                                   and not (ck.is_dir() and any(ck.iterdir()))),
    # between saves: step-4 is committed, a later step is logged, no save is being written
    "after_steps": lambda tmp_path, ck: ((ck / "step-4").is_dir() and not _saving(ck)
                                         and 5 <= _losses_logged(tmp_path) < STEPS),
    # while a save is written (in the step, or in the background with async_mode)
    "mid_save": lambda tmp_path, ck: _saving(ck),
    "mid_async_save": lambda tmp_path, ck: _saving(ck),
}


def _stop_at(launcher: subprocess.Popen, moment) -> None:
    """Wait for MOMENT(), then stop the run where it is (SIGSTOP to its process group: with one
    process the launcher is the worker) and check that MOMENT() still holds, so the kill -9
    that follows lands at that moment of a run that is still going. A moment that passed
    before the stop (a save that ended meanwhile) is waited for again."""
    while True:
        assert wait_for(lambda: moment() or launcher.poll() is not None)
        assert launcher.poll() is None, "the run ended before the moment to kill it came"
        os.killpg(launcher.pid, signal.SIGSTOP)
        if moment():
            return
        os.killpg(launcher.pid, signal.SIGCONT)


@pytest.mark.parametrize("trial", ["mid_save", *(pytest.param(trial, marks=pytest.mark.extended)
                                                for trial in ("after_steps", "early",
                                                              "mid_async_save"))])
def test_kill_9_at_any_moment_resumes_onto_the_uninterrupted_curve(tmp_path, uninterrupted,
                                                                   trial):
    ck = tmp_path / "outputs" / "ck"
    extra = ASYNC if trial == "mid_async_save" else ()
    launcher = _launch(tmp_path, STEPS, *extra)
    _stop_at(launcher, lambda: MOMENTS[trial](tmp_path, ck))
    _kill_everything_of(tmp_path, launcher)
    assert launcher.returncode == -signal.SIGKILL
    # The same command again (through run_training: a fresh process tree, forked rather than
    # started from a new interpreter; the killed run above was a real `python -m` process).
    restarted = run_training(tmp_path, "--training.steps", str(STEPS), *SMALL, *CHECKPOINT,
                             "--hybrid.loss_curve_file", "curve.jsonl", *extra)
    assert restarted.returncode == 0, restarted.output[-6000:]
    assert _curve(tmp_path) == uninterrupted
    assert not any(p.name.endswith(".partial") for p in ck.iterdir())


def test_async_saves_commit_intact_checkpoints_and_leave_the_curve_unchanged(tmp_path):
    from titan_hybrid.checkpoint import integrity

    (tmp_path / "plain").mkdir()
    plain = run_training(tmp_path / "plain", "--training.steps", str(STEPS), *SMALL,
                         nproc=2).check()
    run = run_training(tmp_path, "--training.steps", str(STEPS), *SMALL, *CHECKPOINT, *ASYNC,
                       "--checkpoint.keep_latest_k", "2", nproc=2).check()
    assert run.losses == plain.losses and len(run.losses) == STEPS
    # Every background save was committed (checksummed, renamed), keep_latest_k applied after.
    assert checkpoints(tmp_path) == ["step-6", "step-8"]
    for name in checkpoints(tmp_path):
        assert integrity.verify(tmp_path / "outputs" / "ck" / name) is None


def _groups_readme_documents(async_mode: str) -> list[str]:
    """The rank-connecting process groups the "Process groups" table lists (docs/operating.md,
    the README's until issue 48) for a run with `--checkpoint.async_mode async_mode`."""
    text = (REPO_ROOT / "docs" / "operating.md").read_text()
    rows = re.findall(r"^  \| `(\w+)` \| [^|]+ \| (.+) \|$",
                      text[text.index("**Process groups.**"):], re.M)
    return [name for name, when in rows
            if when == "always" or f"`--checkpoint.async_mode {async_mode}`" in when]


@pytest.mark.extended
@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_a_run_makes_each_process_group_once_as_the_readme_lists(tmp_path, async_mode):
    run = run_training(tmp_path, "--training.steps", "4", *SMALL, *CHECKPOINT,
                       "--checkpoint.async_mode", async_mode, nproc=2).check()
    logged = re.findall(r"\[rank(\d)\].*Process groups: (\d+): (.*)", run.output)
    assert sorted(rank for rank, _, _ in logged) == ["0", "1"]
    for _, count, listing in logged:
        groups = [re.fullmatch(r"(\w+) \((\w+), (\d+)\)", entry).groups()
                  for entry in listing.split("; ")]
        assert len(groups) == int(count)
        # fake groups (size 1, unused mesh dimensions) open no connection.
        connecting = [name for name, backend, _ in groups if backend != "fake"]
        assert connecting == _groups_readme_documents(async_mode)
    assert checkpoints(tmp_path) == ["step-2", "step-4"]

"""Runs that span nodes and heal themselves (titan_hybrid.runtime.cluster, run_train.sh's
environment): two launches on this host sharing a rendezvous endpoint are two nodes; workers are
killed with kill -9 while the launcher (torchrun's elastic agent) lives."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import REPO_ROOT, SMALL_JOB, _descendants, run_training, wait_for
from titan_hybrid.runtime.cluster import cluster_from_env

CHECKPOINT = ("--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.folder", "ck",
              "--checkpoint.no_last_save_model_only")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(tmp_path: Path, name: str, *args: str,
           entry: tuple[str, ...] = ("-m", "titan_hybrid.launch"), **env: str) -> subprocess.Popen:
    """`python -m titan_hybrid.launch` (run_train.sh's command; or another ENTRY) with ENV,
    output to NAME.log."""
    log = (tmp_path / f"{name}.log").open("w")
    command = [sys.executable, *entry,
               "--job.config_file", str(REPO_ROOT / "train_configs" / "hybrid.toml"),
               "--job.dump_folder", str(tmp_path / "outputs"),
               "--metrics.disable_color_printing", "--hybrid.loss_curve_file", "curve.jsonl",
               *args]
    return subprocess.Popen(command, cwd=REPO_ROOT, start_new_session=True, stdout=log,
                            stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **env})


def finish(proc: subprocess.Popen, timeout: float = 300) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        for pid in _descendants(proc.pid):
            os.kill(pid, signal.SIGKILL)
        raise


def curve(tmp_path: Path) -> list[float]:
    lines = (tmp_path / "outputs" / "curve.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


@pytest.mark.extended
@pytest.mark.parametrize("layout", [
    (), pytest.param(("--parallelism.tensor_parallel_degree", "2"), marks=pytest.mark.slow)],
    ids=["fsdp2", "fsdp2_tp2"])
def test_two_nodes_of_two_give_the_curve_of_one_node_of_four(tmp_path, layout):
    job = ("--training.steps", "3", *SMALL_JOB[2:], *layout)
    (tmp_path / "one").mkdir()
    one_node = run_training(tmp_path / "one", *job, nproc=4).check()
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [launch(tmp_path, f"node{rank}", *job, NNODES="2", NODE_RANK=str(rank),
                    RDZV_ENDPOINT=endpoint, NGPU="2") for rank in (0, 1)]
    codes = [finish(node) for node in nodes]
    assert codes == [0, 0], [(tmp_path / f"node{r}.log").read_text()[-3000:] for r in (0, 1)]
    assert len(one_node.losses) == 3
    assert curve(tmp_path) == one_node.losses  # bitwise: the same ranks, the same layout


def agent_log(tmp_path: Path, node: int = 0) -> Path:
    return tmp_path / "outputs" / "launcher" / f"node{node}.log"


@pytest.mark.extended
def test_a_node_that_never_arrives_ends_the_rendezvous_with_one_line(tmp_path):
    lonely = launch(tmp_path, "node0", *SMALL_JOB, NNODES="2", NODE_RANK="0", NGPU="2",
                    RDZV_ENDPOINT=f"127.0.0.1:{free_port()}", RDZV_TIMEOUT="3")
    assert finish(lonely, timeout=120) == 1
    output = (tmp_path / "node0.log").read_text()
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "not all NNODES=2 nodes joined within RDZV_TIMEOUT=3 s" \
        in errors[0], output[-3000:]
    assert "Traceback" not in output
    # The agent's own account is kept, in the file the line names: the node joined the
    # rendezvous, and the rendezvous timed out.
    assert errors[0].endswith(f"the agent's log: {agent_log(tmp_path)})"), errors
    log = agent_log(tmp_path).read_text()
    assert "attempts to join the next round of the rendezvous" in log, log[-3000:]
    assert "RendezvousTimeoutError" in log, log[-3000:]


def _steps_logged(tmp_path: Path) -> int:
    path = tmp_path / "outputs" / "curve.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _kill_a_worker(tmp_path: Path, launcher: subprocess.Popen, steps: int) -> int:
    """kill -9 of one worker process (a child of the launcher), not of the launcher, while the
    run provably has steps left: the worker is stopped first (SIGSTOP; its peers then wait for
    it at their next collective), the run checked, then killed."""
    workers = [pid for pid in _descendants(launcher.pid)
               if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
               == str(launcher.pid)]
    assert workers, "no worker to kill"
    victim = max(workers)
    os.kill(victim, signal.SIGSTOP)
    assert launcher.poll() is None and _steps_logged(tmp_path) < steps
    os.kill(victim, signal.SIGKILL)
    return victim


def test_a_killed_worker_is_restarted_and_resumes_onto_the_uninterrupted_curve(tmp_path):
    job = ("--training.steps", "8", *SMALL_JOB[2:], *CHECKPOINT)
    (tmp_path / "reference").mkdir()
    uninterrupted = run_training(tmp_path / "reference", *job, nproc=2).check().losses
    launcher = launch(tmp_path, "job", *job, NGPU="2", MAX_RESTARTS="1", LOG_RANK="0,1")
    assert wait_for(lambda: (tmp_path / "outputs" / "ck" / "step-4").is_dir()
                    and _steps_logged(tmp_path) >= 5)
    victim = _kill_a_worker(tmp_path, launcher, 8)
    assert finish(launcher) == 0, (tmp_path / "job.log").read_text()[-4000:]
    output = (tmp_path / "job.log").read_text()
    assert f"(pid {victim}), killed by signal 9" in output, output[-4000:]
    assert "restart 1 of MAX_RESTARTS=1" in output
    resumed = [line for line in output.splitlines() if "restart 1: resumed from step" in line]
    assert resumed and int(resumed[0].rsplit(" ", 1)[1]) >= 4, output[-4000:]
    assert curve(tmp_path) == uninterrupted  # bitwise, as if nothing had happened


@pytest.mark.extended
def test_after_max_restarts_failures_the_job_stops_with_one_line(tmp_path):
    job = ("--training.steps", "40", *SMALL_JOB[2:], *CHECKPOINT)
    launcher = launch(tmp_path, "job", *job, NGPU="2", MAX_RESTARTS="1")
    log = tmp_path / "job.log"
    assert wait_for(lambda: _steps_logged(tmp_path) >= 2)
    _kill_a_worker(tmp_path, launcher, 40)
    assert wait_for(lambda: "restart 1: resumed from step" in log.read_text()
                    or "restart 1: no checkpoint yet" in log.read_text())
    _kill_a_worker(tmp_path, launcher, 40)
    assert finish(launcher) == 1
    errors = [line for line in log.read_text().splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "after 1 restart(s) (MAX_RESTARTS)" in errors[0], errors
    # The killed worker is named (not a peer that failed after it), and so is the agent's log.
    assert "killed" in errors[0] and str(agent_log(tmp_path)) in errors[0], errors
    assert "restart worker group" in agent_log(tmp_path).read_text()


@pytest.mark.extended
def test_a_bug_in_one_worker_is_named_with_its_rank_and_exception(tmp_path):
    # Rank 1 raises as step 2 begins; rank 0, waiting for it in step 2's first collective,
    # fails on the broken connection milliseconds later. The first failure is named.
    job = ("--training.steps", "4", *SMALL_JOB[2:])
    launcher = launch(tmp_path, "job", *job, NGPU="2", LOG_RANK="0,1",
                      entry=("-m", "tests.distributed.failing_launch", "1", "2"))
    assert finish(launcher) == 1
    output = (tmp_path / "job.log").read_text()
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: training failed: rank 1 exited with status 1: RuntimeError: a bug on rank 1 at "
        "step 2 (its traceback is above; with NGPU > 1 set LOG_RANK to see other ranks; the "
        f"agent's log: {agent_log(tmp_path)})"], output[-4000:]
    traceback = output[:output.index("\nerror: training failed")]
    assert "RuntimeError: a bug on rank 1 at step 2" in traceback
    # The line printed as the agent finds a failed worker names the same one.
    failed = [line for line in output.splitlines() if line.startswith("worker failed:")]
    assert len(failed) == 1 and re.fullmatch(
        r"worker failed: node 0 local rank 1 \(pid \d+\), exit status 1: RuntimeError: a bug "
        r"on rank 1 at step 2", failed[0]), failed
    assert "failed (exitcode: 1)" in agent_log(tmp_path).read_text()


@pytest.mark.parametrize("env, message", [
    ({"NNODES": "2"}, "RDZV_ENDPOINT='' must be host:port"),
    ({"NNODES": "2", "NODE_RANK": "2", "RDZV_ENDPOINT": "h:1"}, "NODE_RANK=2 must be below"),
    ({"NNODES": "two"}, "NNODES=two must be an integer >= 1"),
    ({"MAX_RESTARTS": "-1"}, "MAX_RESTARTS=-1 must be an integer >= 0"),
])
def test_cluster_settings_are_checked_by_name(env, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        cluster_from_env(env, "outputs")


def test_every_node_derives_the_same_rendezvous_id_from_the_dump_folder():
    env = {"NNODES": "2", "RDZV_ENDPOINT": "node0:29500"}
    first = cluster_from_env({**env, "NODE_RANK": "0"}, "/shared/run1")
    second = cluster_from_env({**env, "NODE_RANK": "1"}, "/shared/run1")
    assert first.rdzv_id == second.rdzv_id != cluster_from_env(env, "/shared/run2").rdzv_id
    assert "is_host=1" in " ".join(first.torchrun_args())
    assert "is_host=0" in " ".join(second.torchrun_args())

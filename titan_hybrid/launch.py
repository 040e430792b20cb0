"""Launch a training job: `python -m titan_hybrid.launch [--nproc N] --job.config_file F ...`.

What `run_train.sh` runs. The job is parsed and checked here, in the launching process, so a
user error costs a second or two and prints one line (`error: <field>=<value> <rule>`), with
exit status 2, before torchrun starts any worker. A good job is handed to torchrun's elastic
agent (`torch.distributed.run`, the same code as the `torchrun` command: rendezvous, per-rank
environment, `--local-ranks-filter` / `--tee` output, stopping every rank when one fails) with
workers running `titan_hybrid.train`. A one-process job runs its worker in the launcher's own
process. On a host without an accelerator the workers are forked from the launcher (torchrun's
`--start-method fork` with a function entrypoint), so they inherit its imports of torch,
torchtitan and the trainer instead of paying seconds each to import them again; each forked
worker starts a session of its own, as torchrun's worker processes do, and takes
`OMP_NUM_THREADS` (1 unless set) as its thread count. With an accelerator (CUDA is not
fork-safe) every worker is a fresh `python -m titan_hybrid.train` process.

A worker that stops on a user error found later (e.g. a checkpoint that does not fit the model)
or on divergence reports its message through a file (titan_hybrid.runtime.errors); the
launcher prints it once in place of torchrun's failure banner and exits with the worker's
status. A worker that crashes on a bug keeps its traceback, and the launcher says which rank
failed first (each worker records its own failure: titan_hybrid.runtime.errors).

torchrun's agent logs what it does (the rendezvous, worker starts and failures, restarts, and
why a rendezvous did not close) to `<dump_folder>/launcher/node<N>.log` rather than to the
terminal, whose failure lines are the launcher's own; the launcher's one-line errors name that
file.

Options before the job's own arguments: `--nproc N` (processes, default $NGPU or 1) and
`--log-rank R[,R]` (ranks whose output is shown, default $LOG_RANK or 0). Several nodes, the
rendezvous and restarts come from the environment (titan_hybrid.runtime.cluster: NNODES, NODE_RANK,
RDZV_ENDPOINT, RDZV_ID, RDZV_TIMEOUT, MAX_RESTARTS); the pre-flight check then checks the
whole world size (nodes x processes). A worker that fails while restarts are left is reported
in one line (its local rank, pid and exit status, and the restart); the restarted workers
resume from the newest intact checkpoint.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.launcher.api import elastic_launch

from titan_hybrid import train
from titan_hybrid.adapters.installed import front_end
from titan_hybrid.compat.elastic import AgentEvents, agent_logs_to
from titan_hybrid.runtime import cpu
from titan_hybrid.runtime.cluster import Cluster, cluster_from_env
from titan_hybrid.runtime.errors import (
    ERROR_DIR_ENV,
    EXIT_USER_ERROR,
    failures_recorded,
    first_failure,
    first_reported_error,
)
from titan_hybrid.training.preflight import check_run

# What ended a launch, in full, beside the agent's records in its log file.
logger = logging.getLogger("titan_hybrid.launch")  # not __name__: "__main__" under -m


def preflight(job_args: list[str], nproc: int) -> tuple[Cluster | None, str, str | None]:
    """Parse and check the job and this launch's place in the cluster, in this process:
    (the cluster, the job's dump folder, None) when they are fine, else (None, "", the
    message)."""
    try:
        adapter = front_end
        run = adapter.run_config(adapter.parse_job(job_args))
        cluster = cluster_from_env(dict(os.environ), run.dump_folder)
        check_run(run, cluster.nnodes * nproc)
    except ValueError as error:
        return None, "", str(error)
    return cluster, run.dump_folder, None


def _exit_of(exitcode: int) -> str:
    return f"exited, killed by signal {-exitcode}" if exitcode < 0 else (
        f"exited with status {exitcode}")


def _cause(exitcode: int | None, summary: str | None) -> str:
    if exitcode is None and summary is None:
        return "ended without an exception (killed, or a crash outside Python)"
    exitcode = 1 if exitcode is None else exitcode  # an uncaught exception's status
    cause = f"killed by signal {-exitcode}" if exitcode < 0 else f"exit status {exitcode}"
    return cause if summary is None else f"{cause}: {summary}"


class FailureReports:
    """The launcher's lines about failed workers and restarts. torchrun's agent polls its
    workers every 0.1 s and names whichever failed one it finds first; a worker's peers fail
    milliseconds after it on their broken connections, so that is often a peer. The workers'
    own records (titan_hybrid.runtime.errors, in ERROR_DIR) say which failed first."""

    def __init__(self, node_rank: int, error_dir: Path) -> None:
        self.node_rank, self.error_dir = node_rank, error_dir
        self.exit_statuses: dict[int, int] = {}  # pid -> exit status, as reported

    def listen(self) -> None:
        AgentEvents(self.on_failure, self.on_restart).listen()

    def on_failure(self, local_rank: int, exitcode: int, pid: int) -> None:
        """The agent found failed worker PID; the records may know an earlier failure."""
        first = first_failure(self.error_dir)
        summary = None
        if first is not None and first.pid:
            if first.pid != pid:
                local_rank, pid, exitcode = first.local_rank, first.pid, first.exitcode
            summary = first.summary
        if exitcode is not None:
            self.exit_statuses[pid] = exitcode
        print(f"worker failed: node {self.node_rank} local rank {local_rank} (pid {pid}), "
              f"{_cause(exitcode, summary)}", file=sys.stderr, flush=True)

    @staticmethod
    def on_restart(restart: int, max_restarts: int) -> None:
        print(f"restarting the worker group: restart {restart} of MAX_RESTARTS={max_restarts};"
              " the workers resume from the newest intact checkpoint", file=sys.stderr,
              flush=True)

    def final_line(self, failure: ChildFailedError, after: str, log: Path) -> str:
        """The one-line error for workers that failed on something they did not report."""
        first = first_failure(self.error_dir)
        if first is None:  # no worker raised (e.g. one was killed): torchrun's account
            rank, process = failure.get_first_failure()
            what = _exit_of(process.exitcode)
            hint = ""
        else:
            rank = first.rank
            exitcode = (failure.failures[rank].exitcode if rank in failure.failures
                        else self.exit_statuses.get(first.pid, first.exitcode))
            if first.summary is None:  # it ended without an exception, the others after it
                how = ("without an exception (killed, or a crash outside Python)"
                       if exitcode is None else _cause(exitcode, None))
                what = f"exited first, {how}; the other ranks failed after it"
                hint = ""
            else:
                what = f"{_exit_of(1 if exitcode is None else exitcode)}: {first.summary}"
                hint = "its traceback is above; with NGPU > 1 set LOG_RANK to see other ranks; "
        return (f"error: training failed{after}: rank {rank} {what} "
                f"({hint}the agent's log: {log})")


def fork_worker(job_args: list[str]) -> None:
    """A forked worker (torchrun's function entrypoint): `titan_hybrid.train` without a fresh
    interpreter. Returns on success (torchrun collects the return value; the process then
    leaves through `os._exit`, skipping the teardown that can abort in gloo, see
    titan_hybrid.train); a reported error leaves with its status (titan_hybrid.runtime.errors), and
    a bug is recorded for the launcher, prints its traceback to this rank's stderr and leaves
    with status 1, as an uncaught exception ends a worker process."""
    # As a torchrun worker process: a session of its own (a Ctrl-C reaches the launcher, which
    # stops the workers) and default signal handling (not the launcher's handlers, inherited).
    os.setsid()
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    # The OpenMP runtime read OMP_NUM_THREADS when the launcher imported torch, before torchrun
    # set it; apply it to this process explicitly.
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
    code = 1
    try:
        with failures_recorded():  # the launcher names the first failure from these records
            front_end.activate()
            train.run(job_args)
        code = 0
    except SystemExit as error:  # what the interpreter makes of it at the end of a process
        code = error.code if isinstance(error.code, int) else int(error.code is not None)
        if not isinstance(error.code, (int, type(None))):
            print(error.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    if code != 0:
        os._exit(code)


def run_workers(job_args: list[str], nproc: int, log_ranks: str, cluster: Cluster,
                agent_log: Path) -> int:
    # Forked workers inherit this process's imports (torch, torchtitan, the trainer: imported
    # at the top of this module, once, before the fork).
    fork = not cpu.accelerator_available()
    # Workers get a fresh TCPStore per rendezvous round (rank 0 hosts it) instead of sharing
    # the agent's: in the shared store a restarted group can read the previous group's
    # process-group keys (the dead workers' addresses: "Gloo connectFullMesh failed ...
    # Connection refused").
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # What torchrun's agent logs (the rendezvous, worker starts, each failure at ERROR level,
    # the stopping of the other workers, restarts) goes to AGENT_LOG, with what ended the
    # launch in full; the terminal gets the launcher's own lines (_report_agent_events, below),
    # and each one-line error names the log.
    with (agent_logs_to(agent_log, logger.name),
          tempfile.TemporaryDirectory(prefix="titan_hybrid_errors_") as error_dir):
        logger.info("---- launch: %s (pid %d)", " ".join(sys.argv), os.getpid())
        os.environ[ERROR_DIR_ENV] = error_dir
        reports = FailureReports(cluster.node_rank, Path(error_dir))
        reports.listen()
        # One node: `--standalone`, spelled out (torchrun.run() applies it, config_from_args()
        # does not).
        args = torchrun.parse_args([
            *cluster.torchrun_args(), f"--nproc-per-node={nproc}",
            "--local-ranks-filter", log_ranks, "--role", "rank", "--tee", "3",
            *(["--start-method", "fork"] if fork else []),
            "-m", "titan_hybrid.train", *job_args])
        config, command, command_args = torchrun.config_from_args(args)
        try:
            if fork:
                elastic_launch(config=config, entrypoint=fork_worker)(job_args)
            else:
                elastic_launch(config=config, entrypoint=command)(*command_args)
        except RendezvousError as error:
            logger.error("the rendezvous failed", exc_info=error)
            print(f"error: rendezvous at RDZV_ENDPOINT={cluster.endpoint} failed: not all "
                  f"NNODES={cluster.nnodes} nodes joined within RDZV_TIMEOUT={cluster.timeout} s "
                  f"(every node needs the same RDZV_ENDPOINT and RDZV_ID; {type(error).__name__}; "
                  f"the agent's log: {agent_log})", file=sys.stderr)
            return 1
        except ChildFailedError as failure:
            logger.error("the workers failed:\n%s", failure.format_msg())
            reported = first_reported_error(Path(error_dir))
            if reported is not None:
                code, message = reported
                print(message, file=sys.stderr)
                return code
            after = (f" after {cluster.max_restarts} restart(s) (MAX_RESTARTS)"
                     if cluster.max_restarts else "")
            print(reports.final_line(failure, after, agent_log), file=sys.stderr)
            return 1
    return 0


def set_one_process_environment() -> None:
    """torchrun's environment contract for one worker in this process, on a free port."""
    with socket.socket() as probe:  # a free port for the one-member process group
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def run_here(job_args: list[str]) -> None:
    """One process: the worker runs in this process under torchrun's environment contract,
    which saves a second interpreter start and import of torch and torchtitan (seconds)."""
    set_one_process_environment()
    train.main(job_args)  # leaves the process itself on success and on a reported error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m titan_hybrid.launch", add_help=False)
    parser.add_argument("--nproc", type=int, default=int(os.environ.get("NGPU", "1")))
    parser.add_argument("--log-rank", default=os.environ.get("LOG_RANK", "0"))
    options, job_args = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if options.nproc < 1:
        print(f"error: --nproc (NGPU)={options.nproc} must be >= 1", file=sys.stderr)
        return EXIT_USER_ERROR
    cluster, dump_folder, message = preflight(job_args, options.nproc)
    if message is not None:
        print(f"error: {message}", file=sys.stderr)
        return EXIT_USER_ERROR
    # Triton keeps its autotuning results beside the kernels it compiles in TRITON_CACHE_DIR,
    # so only a host's first run pays the SSD kernels' tuning (~100 s on an H100;
    # docs/gpu_and_performance.md, "Autotune cost"). TRITON_CACHE_AUTOTUNING=0 retunes every run.
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    if options.nproc == 1 and cluster.nnodes == 1 and not cluster.max_restarts:
        run_here(job_args)
        return 0
    agent_log = Path(dump_folder) / "launcher" / f"node{cluster.node_rank}.log"
    return run_workers(job_args, options.nproc, options.log_rank, cluster, agent_log)


if __name__ == "__main__":
    sys.exit(main())

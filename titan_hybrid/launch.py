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
or on divergence reports its message through a file (titan_hybrid.training.errors); the
launcher prints it once in place of torchrun's failure banner and exits with the worker's
status. A worker that crashes on a bug keeps its traceback, and the launcher says which rank
failed.

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
import time
import traceback
from pathlib import Path

import torch
import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.launcher.api import elastic_launch

from titan_hybrid import train
from titan_hybrid.adapters.installed import front_end
from titan_hybrid.compat.elastic import AgentEvents
from titan_hybrid.runtime import cpu
from titan_hybrid.runtime.cluster import Cluster, cluster_from_env
from titan_hybrid.training.errors import ERROR_DIR_ENV, EXIT_USER_ERROR, first_reported_error
from titan_hybrid.training.preflight import check_run

FAILURE_REPORT_DELAY_S = 1.0


def preflight(job_args: list[str], nproc: int) -> tuple[Cluster | None, str | None]:
    """Parse and check the job and this launch's place in the cluster, in this process:
    (the cluster, None) when they are fine, else (None, the message)."""
    try:
        adapter = front_end
        run = adapter.run_config(adapter.parse_job(job_args))
        cluster = cluster_from_env(dict(os.environ), run.dump_folder)
        check_run(run, cluster.nnodes * nproc)
    except ValueError as error:
        return None, str(error)
    return cluster, None


def _report_agent_events(node_rank: int) -> None:
    def on_failure(local_rank: int, exitcode: int, pid: int) -> None:
        cause = f"killed by signal {-exitcode}" if exitcode < 0 else f"exit status {exitcode}"
        print(f"worker failed: node {node_rank} local rank {local_rank} (pid {pid}), {cause}",
              file=sys.stderr, flush=True)

    def on_restart(restart: int, max_restarts: int) -> None:
        print(f"restarting the worker group: restart {restart} of MAX_RESTARTS={max_restarts};"
              " the workers resume from the newest intact checkpoint", file=sys.stderr,
              flush=True)

    AgentEvents(on_failure, on_restart).listen()


def fork_worker(job_args: list[str]) -> None:
    """A forked worker (torchrun's function entrypoint): `titan_hybrid.train` without a fresh
    interpreter. Returns on success (torchrun collects the return value; the process then
    leaves through `os._exit`, skipping the teardown that can abort in gloo, see
    titan_hybrid.train); a reported error leaves with its status (titan_hybrid.training.errors), and
    a bug prints its traceback to this rank's stderr and leaves with status 1, as an uncaught
    exception ends a worker process."""
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
        front_end.activate()
        train.run(job_args)
        code = 0
    except SystemExit as error:  # what the interpreter makes of it at the end of a process
        code = error.code if isinstance(error.code, int) else int(error.code is not None)
        if not isinstance(error.code, (int, type(None))):
            print(error.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        # torchrun's agent reports the first failed worker it finds. Workers whose peer died
        # fail within milliseconds of it (a broken connection); waiting lets the agent, which
        # polls every 0.1 s, find the worker that failed first.
        time.sleep(FAILURE_REPORT_DELAY_S)
    sys.stdout.flush()
    sys.stderr.flush()
    if code != 0:
        os._exit(code)


def run_workers(job_args: list[str], nproc: int, log_ranks: str, cluster: Cluster) -> int:
    # torchrun's agent logs each worker failure at ERROR level before its banner, and the
    # stopping of the other workers; the launcher says what failed instead (below).
    for name in ["torch.multiprocessing.spawn", *logging.root.manager.loggerDict]:
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    _report_agent_events(cluster.node_rank)
    # Forked workers inherit this process's imports (torch, torchtitan, the trainer: imported
    # at the top of this module, once, before the fork).
    fork = not cpu.accelerator_available()
    # Workers get a fresh TCPStore per rendezvous round (rank 0 hosts it) instead of sharing
    # the agent's: in the shared store a restarted group can read the previous group's
    # process-group keys (the dead workers' addresses: "Gloo connectFullMesh failed ...
    # Connection refused").
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    with tempfile.TemporaryDirectory(prefix="titan_hybrid_errors_") as error_dir:
        os.environ[ERROR_DIR_ENV] = error_dir
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
            print(f"error: rendezvous at RDZV_ENDPOINT={cluster.endpoint} failed: not all "
                  f"NNODES={cluster.nnodes} nodes joined within RDZV_TIMEOUT={cluster.timeout} s "
                  f"(every node needs the same RDZV_ENDPOINT and RDZV_ID; {type(error).__name__})",
                  file=sys.stderr)
            return 1
        except ChildFailedError as failure:
            reported = first_reported_error(Path(error_dir))
            if reported is not None:
                code, message = reported
                print(message, file=sys.stderr)
                return code
            rank, first = failure.get_first_failure()
            after = (f" after {cluster.max_restarts} restart(s) (MAX_RESTARTS)"
                     if cluster.max_restarts else "")
            print(f"error: training failed{after}: rank {rank} exited with status "
                  f"{first.exitcode} (its traceback is above; with NGPU > 1 set LOG_RANK to see "
                  "other ranks)", file=sys.stderr)
            return 1
    return 0


def run_here(job_args: list[str]) -> None:
    """One process: the worker runs in this process under torchrun's environment contract,
    which saves a second interpreter start and import of torch and torchtitan (seconds)."""
    with socket.socket() as probe:  # a free port for the one-member process group
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    train.main(job_args)  # leaves the process itself on success and on a reported error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m titan_hybrid.launch", add_help=False)
    parser.add_argument("--nproc", type=int, default=int(os.environ.get("NGPU", "1")))
    parser.add_argument("--log-rank", default=os.environ.get("LOG_RANK", "0"))
    options, job_args = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if options.nproc < 1:
        print(f"error: --nproc (NGPU)={options.nproc} must be >= 1", file=sys.stderr)
        return EXIT_USER_ERROR
    cluster, message = preflight(job_args, options.nproc)
    if message is not None:
        print(f"error: {message}", file=sys.stderr)
        return EXIT_USER_ERROR
    # Triton keeps its autotuning results beside the kernels it compiles in TRITON_CACHE_DIR,
    # so only a host's first run pays the SSD kernels' tuning (~100 s on an H100; README,
    # "Autotune cost"). TRITON_CACHE_AUTOTUNING=0 retunes every run.
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    if options.nproc == 1 and cluster.nnodes == 1 and not cluster.max_restarts:
        run_here(job_args)
        return 0
    return run_workers(job_args, options.nproc, options.log_rank, cluster)


if __name__ == "__main__":
    sys.exit(main())

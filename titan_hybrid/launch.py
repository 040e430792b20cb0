"""Launch a training job: `python -m titan_hybrid.launch [--nproc N] --job.config_file F ...`.

What `run_train.sh` runs. The job is parsed and checked here, in the launching process, so a
user error costs a second or two and prints one line (`error: <field>=<value> <rule>`), with
exit status 2, before torchrun starts any worker. A good job is handed to torchrun (its
`torch.distributed.run.run`, the same code as the `torchrun` command) with workers running
`titan_hybrid.train`; a one-process job runs its worker in the launcher's own process. A
worker that stops on a user error found later (e.g. a checkpoint that does not fit the model)
or on divergence reports its message through a file (titan_hybrid.errors);
the launcher prints it once in place of torchrun's failure banner and exits with the worker's
status. A worker that crashes on a bug keeps its traceback, and the launcher says which rank
failed.

Options before the job's own arguments: `--nproc N` (processes, default $NGPU or 1) and
`--log-rank R[,R]` (ranks whose output is shown, default $LOG_RANK or 0).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path

from titan_hybrid.errors import ERROR_DIR_ENV, EXIT_USER_ERROR, first_reported_error
from titan_hybrid.job_config import parse_job


def preflight(job_args: list[str], world_size: int):
    """Parse and check the job in this process; None when it is fine, else the message."""
    from titan_hybrid.job_checks import check_job

    try:
        check_job(parse_job(job_args), world_size)
    except ValueError as error:
        return str(error)
    return None


def run_workers(job_args: list[str], nproc: int, log_ranks: str) -> int:
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # torchrun's agent logs each worker failure at ERROR level before its banner; the launcher
    # says what failed instead (below).
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="titan_hybrid_errors_") as error_dir:
        os.environ[ERROR_DIR_ENV] = error_dir
        args = torchrun.parse_args([
            "--standalone", f"--nproc_per_node={nproc}", "--local-ranks-filter", log_ranks,
            "--role", "rank", "--tee", "3", "-m", "titan_hybrid.train", *job_args])
        try:
            torchrun.run(args)
        except ChildFailedError as failure:
            reported = first_reported_error(Path(error_dir))
            if reported is not None:
                code, message = reported
                print(message, file=sys.stderr)
                return code
            rank, first = failure.get_first_failure()
            print(f"error: training failed: rank {rank} exited with status {first.exitcode} "
                  "(its traceback is above; with NGPU > 1 set LOG_RANK to see other ranks)",
                  file=sys.stderr)
            return 1
    return 0


def run_here(job_args: list[str]) -> None:
    """One process: the worker runs in this process under torchrun's environment contract,
    which saves a second interpreter start and import of torch and torchtitan (seconds)."""
    import socket

    from titan_hybrid import train

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
    message = preflight(job_args, options.nproc)
    if message is not None:
        print(f"error: {message}", file=sys.stderr)
        return EXIT_USER_ERROR
    if options.nproc == 1:
        run_here(job_args)
        return 0
    return run_workers(job_args, options.nproc, options.log_rank)


if __name__ == "__main__":
    sys.exit(main())

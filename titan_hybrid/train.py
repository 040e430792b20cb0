"""Worker entry point: `torchrun ... -m titan_hybrid.train --job.config_file F [...]`.

What the launcher (titan_hybrid.launch, used by run_train.sh) starts in every process; it also
works under a plain torchrun, and under either torchtitan (the installed one's front end:
titan_hybrid/adapters). Compared with `python -m torchtitan.train` it parses the job with
titan_hybrid's job sections, checks it before any process group, mesh or model exists, runs
HybridTrainer, and ends a run that stops on a user error or on divergence with one message and
a non-zero status instead of a traceback (titan_hybrid.runtime.errors). Bugs keep their traceback.
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist
from torchtitan.tools.logging import init_logger, logger

from titan_hybrid.adapters.installed import front_end
from titan_hybrid.ops.autotune_picks import install_picks_at_start_up
from titan_hybrid.ops.kernels import kernel_fallbacks
from titan_hybrid.runtime import cpu
from titan_hybrid.runtime.errors import (
    DivergedError,
    JobError,
    failures_recorded,
    report_and_exit,
)
from titan_hybrid.training.preflight import check_run


def run(job_args: list[str]) -> None:
    init_logger()
    adapter = front_end
    try:
        job = adapter.parse_job(job_args)
        config = adapter.run_config(job)
        check_run(config, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError as error:
        report_and_exit(error)
    # Probed once here, before any model is traced; every rank falls back alike, one reports.
    for line in kernel_fallbacks():
        if os.environ.get("RANK", "0") == "0":
            logger.warning(line)
    # Before any kernel runs: the shipped autotune picks spare a cold first step the timing runs.
    if (line := install_picks_at_start_up()) and os.environ.get("RANK", "0") == "0":
        logger.info(line)
    trainer = None
    try:
        trainer = adapter.build_trainer(job, config)
        if config.checkpoint.create_seed_checkpoint:
            trainer.checkpointer.save(curr_step=0, last_step=True)
        else:
            trainer.train()
    except (JobError, DivergedError) as error:
        report_and_exit(error)  # leaves at once: the other ranks are stopped by torchrun
    finally:
        if trainer is not None:
            trainer.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    logger.info("Process group destroyed")


def main(job_args: list[str] | None = None) -> None:
    # Under the launcher, a failure is recorded for it to name the first failed rank; the
    # exception still propagates (its traceback, torchrun's error file where used).
    with failures_recorded():
        front_end.activate()
        run(sys.argv[1:] if job_args is None else job_args)
    if cpu.accelerator_available():
        return
    # gloo's C++ teardown intermittently aborts at interpreter exit ("terminate called without
    # an active exception"), turning a finished run into a failed torchrun. The process group is
    # already destroyed here, so skip the interpreter's teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

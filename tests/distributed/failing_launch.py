"""`python -m tests.distributed.failing_launch RANK STEP ARGS...`: `python -m titan_hybrid.launch
ARGS`, whose trainer on global rank RANK raises a RuntimeError (a bug's stand-in) as step STEP
begins. Everything else is the real launch: the forked workers inherit the change, the failing
rank's peers then fail on their broken connections, and the launcher reports."""

from __future__ import annotations

import os
import sys

from titan_hybrid import launch
from titan_hybrid.adapters.installed import front_end


def main(rank: str, step: str, *args: str) -> int:
    build_trainer = front_end.build_trainer

    def build_failing_trainer(job, run):
        trainer = build_trainer(job, run)
        train_step = trainer.train_step

        def failing_train_step(*step_args, **step_kwargs):
            if os.environ["RANK"] == rank and trainer.step == int(step):
                raise RuntimeError(f"a bug on rank {rank} at step {step}")
            return train_step(*step_args, **step_kwargs)

        trainer.train_step = failing_train_step
        return trainer

    front_end.build_trainer = build_failing_trainer  # titan_hybrid.train looks it up per run
    return launch.main(list(args))


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))

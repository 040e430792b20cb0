"""Entry point: `python -m titan_hybrid.train --job.config_file train_configs/hybrid.toml`.

Same command line as `python -m torchtitan.train`; importing titan_hybrid first registers the
"hybrid" TrainSpec and, without an accelerator, patches torchtitan for CPU + gloo.
"""

import os
import sys

import titan_hybrid  # noqa: F401  (must precede the trainer's import on CPU)
from titan_hybrid.runtime import cpu


def main() -> None:
    from torchtitan.train import Trainer, main as torchtitan_main

    torchtitan_main(Trainer)
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

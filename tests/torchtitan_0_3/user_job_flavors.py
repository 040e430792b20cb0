"""Trains one step of each flavor given on the command line in this one process, through the
README's user registry (`my_registry.hybrid_in_my_job`, on PYTHONPATH) with its model_spec
swapped for the flavor's: torchtitan 0.3's own Trainer and components, titan_hybrid's model.

    python tests/torchtitan_0_3/user_job_flavors.py DUMP_FOLDER FLAVOR[:dim=N] ...

Each flavor gets a process group of its own (world size 1, a free port), destroyed after its
step, so one process serves them all. Prints `== FLAVOR` before each flavor's run (torchtitan's
step line with its loss follows) and `FLAVOR trained` after it."""

import os
import socket
import sys

import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(dump_folder: str, flavors: list[str]) -> None:
    import my_registry
    from torchtitan.tools.logging import init_logger

    init_logger()  # torchtitan.train's first call: the step lines

    from titan_hybrid.config_registry import model_spec

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1")
    for entry in flavors:
        flavor, *options = entry.split(":")
        overrides = {key: int(value) for key, value in (o.split("=") for o in options)}
        os.environ["MASTER_PORT"] = str(free_port())
        config = my_registry.hybrid_in_my_job()
        config.model_spec = model_spec(flavor, **overrides)
        config.training.steps = 1
        config.dump_folder = os.path.join(dump_folder, flavor)
        print(f"== {flavor}", flush=True)
        trainer = config.build()
        try:
            trainer.train()
            print(f"{flavor} trained", flush=True)
        finally:
            trainer.close()
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])

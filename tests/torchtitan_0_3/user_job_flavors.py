"""Trains one step of each flavor given on the command line in this one process, through the
README's user registry (`my_registry.hybrid_in_my_job`, on PYTHONPATH) with its model_spec
swapped for the flavor's: torchtitan 0.3's own Trainer and components, titan_hybrid's model.

    python tests/torchtitan_0_3/user_job_flavors.py DUMP_FOLDER FLAVOR[:FIELD=N ...] ...

A FIELD is a model arg of the flavor (`dim`), or `local_batch_size`, the job's rows a step.

Each flavor gets a process group of its own (world size 1, a free port), destroyed after its
step, so one process serves them all. Prints `== FLAVOR` before each flavor's run (torchtitan's
step line with its loss follows) and `FLAVOR trained` after it."""

import gc
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
        train_one_step(my_registry, model_spec, entry, dump_folder)
        # The step's trainer is gone with its frame; its reference cycles go now, before the
        # next flavor's model is built: CPython's collector might otherwise keep two models
        # (and their Adam states) at once, which ran a 24 GB machine out of memory.
        gc.collect()


def train_one_step(my_registry, model_spec, entry: str, dump_folder: str) -> None:
    flavor, *options = entry.split(":")
    overrides = {key: int(value) for key, value in (o.split("=") for o in options)}
    local_batch_size = overrides.pop("local_batch_size", None)
    os.environ["MASTER_PORT"] = str(free_port())
    config = my_registry.hybrid_in_my_job()
    if local_batch_size is not None:
        config.training.local_batch_size = local_batch_size
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

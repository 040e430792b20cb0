"""How long training is blocked per checkpoint, synchronous vs asynchronous
(`checkpoint.async_mode async`), and the save throughput against plain DCP.

    .venv/bin/python bench/async_checkpoint.py [--steps 22] [--interval 10]

Each mode is a real training run (titan_hybrid.launch, one process) of a ~141M-parameter hybrid
(M-M-M-M-M-M-M*- at width 1024; with AdamW's two moments the checkpoint holds ~1.7 GB). The
time training is blocked is the wall time of each call the trainer makes into the
checkpointer: the save at a saving step, and in async mode also the wait for the background
staging copy before the next optimizer step (on CUDA a wait of the compute stream on the copies'
event, which the step-after-save time shows) and, before the next save, the wait for the
previous background save and its commit (checksums, fsync, rename: on the save's thread). The last step's save is excluded
(torchtitan saves the last step synchronously). The train step's own time (forward, backward,
optimizer, the staging wait included) is also reported for the step after each save against
the median step, and the whole run's time against the same run without interval saves: on
2 cores the background copy and writer compete with training for them. Baseline for throughput: plain
`torch.distributed.checkpoint.save` of the same model and optimizer state dicts, in the same
process, after training; ours is the synchronous save (split components, `.partial`, checksums,
fsync, rename). Goal: an async block of at most 10% of the sync save time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def worker(mode: str, dump: str, steps: int, interval: int, seq_len: int, batch: int) -> None:
    """One training run with an instrumented checkpointer; prints RESULT {json}."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from titan_hybrid import launch
    from titan_hybrid.adapters.torchtitan_0_2.trainer import HybridTrainer
    from titan_hybrid.checkpoint.manager import HybridCheckpointManager
    from titan_hybrid.model.args import AttentionArgs, MambaArgs, MLPArgs, hybrid_flavors

    # A bench-only flavor, registered in this process before the launch reads it.
    hybrid_flavors["bench_141m"] = dataclasses.replace(
        hybrid_flavors["debug"], dim=1024, pattern="M-M-M-M-M-M-M*-",
        attention=AttentionArgs(n_heads=8, n_kv_heads=4, head_dim=128),
        mlp=MLPArgs(hidden_dim=4096),
        mamba=MambaArgs(d_state=64, head_dim=64, n_groups=2, chunk_size=64))
    blocked: dict[int, float] = {}
    step_seconds: dict[int, float] = {}
    staging_wait = [0.0]  # in the train step, before the optimizer step; counted at its save
    previous_save_wait: dict[int, float] = {}  # inside a save: the previous background save
    saving = [0]  # the step of the save in progress
    original_save = HybridCheckpointManager.save
    original_wait = HybridCheckpointManager.maybe_wait_for_staging
    original_wait_for_previous = HybridCheckpointManager.wait_for_background_save
    original_train_step = HybridTrainer.train_step

    def timed_save(self, curr_step, last_step=False):
        start = time.perf_counter()
        saving[0] = curr_step
        original_save(self, curr_step, last_step)
        if not last_step:
            blocked[curr_step] = time.perf_counter() - start + staging_wait[0]
        staging_wait[0] = 0.0

    def timed_wait(self):
        start = time.perf_counter()
        original_wait(self)
        staging_wait[0] += time.perf_counter() - start

    def timed_wait_for_previous(self):
        start = time.perf_counter()
        original_wait_for_previous(self)
        previous_save_wait[saving[0]] = (previous_save_wait.get(saving[0], 0.0)
                                         + time.perf_counter() - start)

    def timed_train_step(self, *args, **kwargs):
        start = time.perf_counter()
        result = original_train_step(self, *args, **kwargs)
        step_seconds[self.step] = time.perf_counter() - start
        return result

    HybridCheckpointManager.save = timed_save
    HybridCheckpointManager.maybe_wait_for_staging = timed_wait
    HybridCheckpointManager.wait_for_background_save = timed_wait_for_previous
    HybridTrainer.train_step = timed_train_step
    original_train = HybridTrainer.train

    def train_then_measure(self):
        original_train(self)
        model, optimizer = self.model_parts[0], self.optimizers.optimizers[0]
        params = sum(p.numel() for p in model.parameters())
        plain = Path(dump) / "plain_dcp"
        model_sd, optim_sd = get_state_dict(model, optimizer)
        start = time.perf_counter()
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(plain))
        plain_s = time.perf_counter() - start
        print("RESULT " + json.dumps({"params": params, "blocked": blocked,
                                      "previous_save_wait": previous_save_wait,
                                      "step_seconds": step_seconds,
                                      "plain_seconds": plain_s,
                                      "plain_bytes": folder_bytes(plain)}), flush=True)

    HybridTrainer.train = train_then_measure
    launch.main(["--job.config_file", str(REPO / "train_configs" / "hybrid.toml"),
                 "--job.dump_folder", dump, "--model.flavor", "bench_141m",
                 "--training.steps", str(steps), "--training.seq_len", str(seq_len),
                 "--training.local_batch_size", str(batch), "--checkpoint.enable",
                 "--checkpoint.interval", str(interval), "--checkpoint.folder", "ck",
                 "--checkpoint.no_last_save_model_only", "--checkpoint.async_mode", mode,
                 "--metrics.log_freq", "1"])


def run(mode: str, options, interval: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench_ckpt_{mode}_", dir="/tmp") as dump:
        proc = subprocess.run([sys.executable, __file__, "--worker", mode, "--dump", dump,
                               "--steps", str(options.steps), "--interval", str(interval),
                               "--seq-len", str(options.seq_len), "--batch", str(options.batch)],
                              cwd=REPO, capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "2"})
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])
        result = json.loads(lines[-1][len("RESULT "):])
        result["save_bytes"] = folder_bytes(Path(dump) / "ck" / f"step-{options.steps}")
        # A line per run as it ends: a run cut short by a time limit keeps what was done.
        print(f"run {mode}, a save every {interval} steps: step seconds "
              + json.dumps(result["step_seconds"]) + " | checkpointer seconds "
              + json.dumps(result["blocked"]), flush=True)
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Saves far enough apart for a background save to finish between them, as in real runs
    # (on a GPU, steps are short: give a larger --interval, or a longer --seq-len).
    parser.add_argument("--steps", type=int, default=22)
    parser.add_argument("--interval", type=int, default=10)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--worker")
    parser.add_argument("--dump")
    options = parser.parse_args()
    if options.worker:
        worker(options.worker, options.dump, options.steps, options.interval, options.seq_len,
               options.batch)
        return
    sync, background = (run(mode, options, options.interval) for mode in ("disabled", "async"))
    no_saves = run("disabled", options, options.steps + 1)  # only the excluded last save
    saving_steps = [s for s in sync["blocked"] if int(s) % options.interval == 0]
    sync_block = sum(sync["blocked"][s] for s in saving_steps) / len(saving_steps)
    async_block = sum(background["blocked"][s] for s in saving_steps) / len(saving_steps)
    # Inside the saving step: the wait for the previous background save (saves closer together
    # than one background save takes), apart from the save's own staging.
    previous_wait = sum(background["previous_save_wait"].get(s, 0.0)
                        for s in saving_steps) / len(saving_steps)
    # The staging wait (the step after a save) and the commit (checksums, fsync, rename, at the
    # first step after the background save finished): every other step's time in the
    # checkpointer, per save.
    commit_block = sum(seconds for step, seconds in background["blocked"].items()
                       if step not in saving_steps) / len(saving_steps)
    gigabytes = sync["save_bytes"] / 1e9
    print(f"{options.steps} steps of {options.batch} x {options.seq_len} tokens, a save every "
          f"{options.interval} steps")
    for name, result in (("sync", sync), ("async", background)):
        seconds = result["step_seconds"]
        after = [seconds[str(int(s) + 1)] for s in saving_steps]
        ordinary = statistics.median(seconds.values())
        print(f"{name}: train step after each save {', '.join(f'{t:.3f}' for t in after)} s | "
              f"median step {ordinary:.3f} s | lost after a save (mean) "
              f"{statistics.mean(after) - ordinary:.3f} s")
    # What the saves cost the run in all: its steps and checkpointer calls, against the same
    # run without interval saves (on 2 cores the background writer competes for them). Step 1
    # is left out: it holds the warm-up (a cold Triton autotune on a GPU, about 100 s).
    no_saves_total, sync_total, async_total = (
        sum(v for k, v in r["step_seconds"].items() if k != "1") + sum(r["blocked"].values())
        for r in (no_saves, sync, background))
    print(f"steps 2-{options.steps} with checkpointer calls: no saves {no_saves_total:.1f} s | "
          f"sync {sync_total:.1f} s (+{sync_total - no_saves_total:.1f}) | async "
          f"{async_total:.1f} s (+{async_total - no_saves_total:.1f}) = "
          f"{(async_total - no_saves_total) / (sync_total - no_saves_total):.0%} of the sync cost")
    for name, result in (("sync", sync), ("async", background)):
        print(f"{name}: seconds in the checkpointer per step: "
              + ", ".join(f"{step}: {seconds:.2f}" for step, seconds in result["blocked"].items()))
    print(f"model: {sync['params'] / 1e6:.0f}M parameters; checkpoint {gigabytes:.2f} GB "
          f"(model + AdamW state)")
    print(f"blocked per checkpoint (mean of {len(saving_steps)}): sync {sync_block:.2f} s | "
          f"async {async_block:.2f} s at the saving step (of which {previous_wait:.2f} s waiting "
          f"for the previous save) + {commit_block:.2f} s at later steps (staging wait, commit) "
          f"= {(async_block + commit_block) / sync_block:.1%} of sync; without the wait for the "
          f"previous save {(async_block - previous_wait + commit_block) / sync_block:.1%} "
          "(goal <= 10%)")
    print(f"save throughput: ours (sync, split + checksums + rename) "
          f"{gigabytes / sync_block:.2f} GB/s | plain dcp.save "
          f"{sync['plain_bytes'] / 1e9 / sync['plain_seconds']:.2f} GB/s "
          f"(ours / plain = {sync['plain_seconds'] / sync['plain_bytes'] * sync['save_bytes'] / sync_block:.2f})")


if __name__ == "__main__":
    main()

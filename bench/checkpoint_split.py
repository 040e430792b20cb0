"""Save / load time of the component-split checkpoint against a plain DCP checkpoint, and the
cost of the checksums that make saves verifiable.

    .venv/bin/python bench/checkpoint_split.py [--flavor debug] [--repeats 5]

Baseline: `dcp.save` / `dcp.load` of the model's and AdamW's plain state dicts (fused tensors
as they are). Measured: the same through titan_hybrid's split (fused tensors and their Adam
moments as logical components), and the split save as the trainer does it: written as
`.partial`, CRC-32 of every file into checksums.json, renamed (checkpoint/integrity.py); its load
verifies every checksum first. One process, same files system, best of N, side by side.
Targets: split overhead within 10%; checksums cheap next to the save (reported as a ratio).
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torchtitan.components.optimizer import OptimizersContainer

import titan_hybrid.torchtitan_plugin  # noqa: F401  (TrainSpec, dataset; CPU runtime)
from titan_hybrid.checkpoint import integrity
from titan_hybrid.checkpoint.split import split_state_dict
from titan_hybrid.checkpoint.state import fused_parameters, split_optimizer_state
from titan_hybrid.config.sections import OptimizerSection as OptimizerConfig
from titan_hybrid.model.args import hybrid_flavors
from titan_hybrid.model.model import HybridModel
from titan_hybrid.parallel.plan import ParallelPlan
from titan_hybrid.training.optimizer import build_hybrid_optimizers


def build(flavor: str, dim: int):
    args = copy.deepcopy(hybrid_flavors[flavor])
    args.dim = dim
    with torch.device("meta"):
        model = HybridModel(args)
    model.to_empty(device="cpu")
    model.init_weights()
    optimizers = build_hybrid_optimizers([model], OptimizerConfig(),
                                         ParallelPlan.unparallelized([model]))
    tokens = torch.randint(0, args.vocab_size, (2, 64))
    out = model(tokens)
    (out[0] if isinstance(out, tuple) else out).float().mean().backward()
    optimizers.step()
    return model, optimizers


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debug")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    options = parser.parse_args()
    model, optimizers = build(options.flavor, options.dim)
    layouts = ParallelPlan.unparallelized([model]).layouts
    fused = fused_parameters([model], layouts)

    def plain_state():
        optim = OptimizersContainer.state_dict(optimizers)
        return {**get_model_state_dict(model), **{f"optimizer.{k}": v for k, v in optim.items()}}

    def split_state():
        optim, _ = split_optimizer_state(OptimizersContainer.state_dict(optimizers), [model],
                                         layouts)
        model_sd = split_state_dict(get_model_state_dict(model), fused)
        return {**model_sd, **{f"optimizer.{k}": v for k, v in optim.items()}}

    def verified_save(folder: Path) -> None:
        partial = folder / "step-1.partial"
        dcp.save(split_state(), checkpoint_id=str(partial))
        integrity.commit(partial, folder / "step-1")

    def verified_load(folder: Path) -> None:
        assert integrity.verify(folder / "step-1") is None
        dcp.load(split_state(), checkpoint_id=str(folder / "step-1"))

    results = {}
    for name, make in (("plain DCP", plain_state), ("split", split_state)):
        with tempfile.TemporaryDirectory() as folder:
            save = best_of(options.repeats, lambda: dcp.save(make(), checkpoint_id=folder))
            load = best_of(options.repeats, lambda: dcp.load(make(), checkpoint_id=folder))
        results[name] = (save, load)
    with tempfile.TemporaryDirectory() as folder:
        results["split + checksums"] = (
            best_of(options.repeats, lambda: verified_save(Path(folder))),
            best_of(options.repeats, lambda: verified_load(Path(folder))))
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3
    print(f"flavor {options.flavor} dim {options.dim}: {n_bytes / 2**20:.1f} MiB of parameters + "
          f"Adam moments, {len(fused)} fused parameters; best of {options.repeats}")
    (plain_save, plain_load), (split_save, split_load) = results["plain DCP"], results["split"]
    print(f"save: plain {plain_save * 1e3:7.1f} ms  split {split_save * 1e3:7.1f} ms  "
          f"ratio {split_save / plain_save:.3f}")
    print(f"load: plain {plain_load * 1e3:7.1f} ms  split {split_load * 1e3:7.1f} ms  "
          f"ratio {split_load / plain_load:.3f}")
    checked_save, checked_load = results["split + checksums"]
    print(f"checksums: save {checked_save * 1e3:7.1f} ms vs split {split_save * 1e3:7.1f} ms  "
          f"ratio {checked_save / split_save:.3f}; load with verification "
          f"{checked_load * 1e3:7.1f} ms vs {split_load * 1e3:7.1f} ms  "
          f"ratio {checked_load / split_load:.3f}")


if __name__ == "__main__":
    main()

"""Run titan_hybrid's trainer in real processes (torchrun + gloo) and read its exact loss curve."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class TrainResult:
    returncode: int
    output: str
    losses: list[float]
    validation_losses: list[float] = field(default_factory=list)

    def check(self) -> "TrainResult":
        assert self.returncode == 0, self.output[-6000:]
        return self


def run_training(tmp_path: Path, *args: str, nproc: int = 1, config: str = "hybrid.toml",
                 module: str = "titan_hybrid.train", timeout: int = 600) -> TrainResult:
    """`python -m titan_hybrid.launch --nproc NPROC --job.config_file CONFIG ARGS` (what
    run_train.sh runs; every rank's output is kept), or with another MODULE
    `torchrun --nproc_per_node NPROC -m MODULE --job.config_file CONFIG ARGS`.

    The loss curve is read from a fresh file under tmp_path, or from the ARGS' own
    --hybrid.loss_curve_file (relative to the dump folder tmp_path/outputs)."""
    curve = tmp_path / f"loss_curve_{len(list(tmp_path.glob('loss_curve_*')))}.jsonl"
    given = "--hybrid.loss_curve_file" in args
    if given:
        curve = tmp_path / "outputs" / args[args.index("--hybrid.loss_curve_file") + 1]
    if module == "titan_hybrid.train":
        launcher = [sys.executable, "-m", "titan_hybrid.launch", "--nproc", str(nproc),
                    "--log-rank", ",".join(str(rank) for rank in range(nproc))]
    else:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc_per_node={nproc}", "-m", module]
    command = [
        *launcher,
        "--job.config_file", str(REPO_ROOT / "train_configs" / config),
        "--job.dump_folder", str(tmp_path / "outputs"),
        "--metrics.disable_color_printing",
        *args,
    ]
    if not given and (module == "titan_hybrid.train" or "--job.custom_config_module" in args):
        command += ["--hybrid.loss_curve_file", str(curve)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    records = ([json.loads(line) for line in curve.read_text().splitlines()]
               if curve.exists() else [])
    return TrainResult(proc.returncode, proc.stdout + proc.stderr,
                       [r["loss"] for r in records if "loss" in r],
                       [r["validation_loss"] for r in records if "validation_loss" in r])


def run_worker(script: Path, *args: str, nproc: int = 2) -> dict:
    """torchrun a worker script; returns the JSON of its last `RESULT {json}` line."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", str(script), *args]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(lines[-1][len("RESULT "):])

"""Run titan_hybrid's trainer in real processes (torchrun + gloo) and read its exact loss curve."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class TrainResult:
    returncode: int
    output: str
    losses: list[float]

    def check(self) -> "TrainResult":
        assert self.returncode == 0, self.output[-6000:]
        return self


def run_training(tmp_path: Path, *args: str, nproc: int = 1, config: str = "hybrid.toml",
                 module: str = "titan_hybrid.train", timeout: int = 600) -> TrainResult:
    """torchrun --nproc_per_node NPROC -m MODULE --job.config_file CONFIG ARGS."""
    curve = tmp_path / f"loss_curve_{len(list(tmp_path.glob('loss_curve_*')))}.jsonl"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", "-m", module,
        "--job.config_file", str(REPO_ROOT / "train_configs" / config),
        "--job.dump_folder", str(tmp_path / "outputs"),
        "--metrics.disable_color_printing",
        *args,
    ]
    if module == "titan_hybrid.train" or "--job.custom_config_module" in args:
        command += ["--hybrid.loss_curve_file", str(curve)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    losses = []
    if curve.exists():
        losses = [json.loads(line)["loss"] for line in curve.read_text().splitlines()]
    return TrainResult(proc.returncode, proc.stdout + proc.stderr, losses)


def run_worker(script: Path, *args: str, nproc: int = 2) -> dict:
    """torchrun a worker script; returns the JSON of its last `RESULT {json}` line."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", str(script), *args]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(lines[-1][len("RESULT "):])

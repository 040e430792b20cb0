"""torchtitan's metrics processor, plus an exact loss-curve file.

The console prints losses to 5 decimals; comparing parallel layouts bit for bit needs the exact
values. With `--hybrid.loss_curve_file PATH`, every logged step appends one JSON line
`{"step": s, "loss": float, "grad_norm": float}` (full float precision, rank 0 only; under
pipeline parallelism the rank torchtitan logs from: the first rank of the last stage).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from torchtitan.components.metrics import MetricsProcessor, _get_metrics_rank
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims


def _as_float(value) -> float:
    return value.item() if isinstance(value, torch.Tensor) else float(value)


class HybridMetricsProcessor(MetricsProcessor):
    def __init__(self, job_config: JobConfig, parallel_dims: ParallelDims, tag=None) -> None:
        super().__init__(job_config, parallel_dims, tag)
        hybrid = getattr(job_config, "hybrid", None)
        path = getattr(hybrid, "loss_curve_file", "") if hybrid is not None else ""
        self.loss_curve_file = Path(path) if path else None
        self.curve_rank = _get_metrics_rank(parallel_dims, job_config)

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)
        if self.loss_curve_file is None:
            return
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank != self.curve_rank:
            return
        loss = _as_float(global_avg_loss)
        self.loss_curve_file.parent.mkdir(parents=True, exist_ok=True)
        with self.loss_curve_file.open("a") as f:
            f.write(json.dumps({"step": step, "loss": loss,
                                "grad_norm": _as_float(grad_norm)}) + "\n")


def build_hybrid_metrics_processor(job_config: JobConfig, parallel_dims: ParallelDims,
                                   model_args=None, tag: str | None = None) -> MetricsProcessor:
    return HybridMetricsProcessor(job_config, parallel_dims, tag)

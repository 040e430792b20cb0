"""What titan_hybrid adds to torchtitan's metrics processor: an exact loss-curve file, the
pipeline's loss on every rank, and the layer kinds' statistics.

The console prints losses to 5 decimals; comparing parallel layouts bit for bit needs the exact
values. With `--hybrid.loss_curve_file PATH` (relative to job.dump_folder unless absolute), rank
0 appends one JSON line per logged step, `{"step": s, "loss": float, "grad_norm": float}`, and
one per validation, `{"step": s, "validation_loss": float, "validation_perplexity": float}`, in
full float precision. The first write of a run drops the lines of steps >= its step, so a run
resumed from a checkpoint rewrites the curve from there and no step appears twice.

Under pipeline parallelism only the ranks of the last stage compute the loss (the others see
torchtitan's placeholder -1); `log` sums the loss over the pipeline group with zeros from the
other stages, so every rank, rank 0 included, logs and writes the real value whichever pp rank
holds the last stage (the V-shaped schedules put it on pp rank 0).

The layer kinds' statistics since the last log (LayerKind.statistics, collected by
titan_hybrid.training.kind_statistics) are added to the logged metrics (TensorBoard / W&B, a
console line, and the curve file). MoE: `moe/max_expert_load` and `moe/min_expert_load` (slots an
expert received over the mean per expert, worst layer; 1.0 is perfect balance) and
`moe/aux_loss` (the load-balancing loss before its coefficient, mean over layers). Counts are
summed over the data-parallel ranks, so they describe the global batch whatever the layout.
With DSA layers whose indexer trains, `dsa/indexer_loss` is the indexer's KL divergence before
its coefficient, averaged over the layers and microbatches since the last log.

torchtitan's own console line per logged step (loss, memory, tps, mfu) cannot take a field, so
titan_hybrid's follows it (`step_line`): the statistics above, and, only when some GPU kernel
package is unusable on a CUDA machine, `kernels: torch path (<package>: <reason>; ...)`
(titan_hybrid.ops.kernels.kernel_path_field), so that a run whose steps are slow because its
ops take their torch paths says so beside every throughput figure, not only at start-up. A run
on the fused kernels, and any run without CUDA, logs no such field.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger

from titan_hybrid.ops.kernels import kernel_path_field
from titan_hybrid.training.kind_statistics import StatisticsCollector
from titan_hybrid.training.run_config import RunConfig


def _as_float(value) -> float:
    return value.item() if isinstance(value, torch.Tensor) else float(value)


def loss_curve_path(run: RunConfig) -> Path | None:
    """hybrid.loss_curve_file, a relative path taken under the dump folder; None if unset."""
    path = run.hybrid.loss_curve_file
    if not path:
        return None
    path = Path(path).expanduser()
    return path if path.is_absolute() else Path(run.dump_folder) / path


def drop_records_from(path: Path, step: int) -> None:
    """Keep only the curve lines of steps before `step` (a resumed run rewrites the rest).
    A line that does not parse is the torn last write of a killed run and goes too. The new
    file replaces the old one in one rename, so a kill during the rewrite loses nothing."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] < step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            continue
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(kept))
    os.replace(partial, path)


def step_line(step: int, statistics: dict[str, float]) -> str | None:
    """titan_hybrid's console line for a logged step (see the module docstring); None when it
    has nothing to say."""
    fields = [f"{name}: {value:.4f}" for name, value in statistics.items()]
    if kernel_path := kernel_path_field():
        fields.append(kernel_path)
    return "step: %2d  " % step + "  ".join(fields) if fields else None


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf  # exp overflows float64 past ~709


class HybridMetrics:
    """What titan_hybrid adds to torchtitan's MetricsProcessor, whose constructor differs
    between torchtitan versions: each adapter's metrics class puts this before it and calls
    `init_hybrid_metrics` after the processor's own constructor."""

    def init_hybrid_metrics(self, run: RunConfig, parallel_dims: ParallelDims) -> None:
        self.pp_group = (parallel_dims.get_mesh("pp").get_group()
                         if parallel_dims.pp_enabled else None)
        self.statistics = StatisticsCollector(parallel_dims)
        self.loss_curve_file = loss_curve_path(run)
        self._curve_started = False

    def _from_last_stage(self, *values) -> list[float]:
        """The values of the pipeline's last stage, on every rank (see the module docstring).
        Adding exact zeros keeps the float64 of the last stage's value bit for bit."""
        parts = self.model_parts or []
        has_last = any(getattr(part, "output", None) is not None for part in parts)
        device = next(parts[0].parameters()).device
        packed = torch.tensor([_as_float(v) if has_last else 0.0 for v in values],
                              dtype=torch.float64, device=device)
        dist.all_reduce(packed, group=self.pp_group)
        return packed.tolist()

    def write_curve(self, record: dict) -> None:
        """Append one record to the loss-curve file (rank 0; every rank holds the values)."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        if self.loss_curve_file is None or rank != 0:
            return
        self.loss_curve_file.parent.mkdir(parents=True, exist_ok=True)
        if not self._curve_started:
            self._curve_started = True
            drop_records_from(self.loss_curve_file, record["step"])
        with self.loss_curve_file.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        if self.pp_group is not None:  # all ranks log at the same steps: a safe collective
            global_avg_loss, global_max_loss = self._from_last_stage(global_avg_loss,
                                                                     global_max_loss)
        statistics = self.statistics.collect(getattr(self, "model_parts", None) or [])
        super().log(step, global_avg_loss, global_max_loss, grad_norm,
                    {**(extra_metrics or {}), **statistics})
        if line := step_line(step, statistics):
            logger.info(line)
        self.write_curve({"step": step, "loss": _as_float(global_avg_loss),
                          "grad_norm": _as_float(grad_norm), **statistics})

    def log_validation(self, loss, step, extra_metrics=None):
        """`loss` is the same on every rank (titan_hybrid.training.validation); adds its
        perplexity."""
        loss = _as_float(loss)
        ppl = perplexity(loss)
        super().log_validation(loss, step,
                               {**(extra_metrics or {}), "validation_metrics/perplexity": ppl})
        logger.info(f"validate step: {step:2}  perplexity: {ppl:.4f}")
        self.write_curve({"step": step, "validation_loss": loss, "validation_perplexity": ppl})


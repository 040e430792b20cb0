"""torchtitan's metrics processor, plus an exact loss-curve file.

The console prints losses to 5 decimals; comparing parallel layouts bit for bit needs the exact
values. With `--hybrid.loss_curve_file PATH`, every logged step appends one JSON line
`{"step": s, "loss": float, "grad_norm": float}` (full float precision, rank 0 only; under
pipeline parallelism the rank torchtitan logs from: the first rank of the last stage).

MoE router statistics since the last log are added to the logged metrics (TensorBoard / W&B,
a console line, and the curve file): `moe/max_expert_load` and `moe/min_expert_load` (slots an
expert received over the mean per expert, worst layer; 1.0 is perfect balance) and
`moe/aux_loss` (the load-balancing loss before its coefficient, mean over layers). Counts are
summed over the data-parallel ranks, so they describe the global batch whatever the layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from torchtitan.components.metrics import MetricsProcessor, _get_metrics_rank
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger

from titan_hybrid.model.moe import MoE


def _as_float(value) -> float:
    return value.item() if isinstance(value, torch.Tensor) else float(value)


def router_statistics(model_parts, batch_group) -> dict[str, float]:
    """Read and reset the MoE layers' routing counters (see MoE.routed_tokens)."""
    moes = [module for part in model_parts for module in part.modules() if isinstance(module, MoE)]
    if not moes:
        return {}
    counts_LE = torch.stack([moe.routed_tokens for moe in moes]).double()
    aux_L2 = torch.stack([moe.aux_loss_sum for moe in moes]).double()
    if batch_group is not None:
        packed = torch.cat((counts_LE.flatten(), aux_L2.flatten()))
        dist.all_reduce(packed, group=batch_group)
        counts_LE, aux_L2 = packed.split((counts_LE.numel(), aux_L2.numel()))
        counts_LE, aux_L2 = counts_LE.view(len(moes), -1), aux_L2.view(len(moes), 2)
    for moe in moes:
        moe.reset_router_statistics()
    load_LE = counts_LE / counts_LE.mean(dim=1, keepdim=True).clamp(min=1)
    return {"moe/max_expert_load": load_LE.max().item(),
            "moe/min_expert_load": load_LE.min().item(),
            "moe/aux_loss": (aux_L2[:, 0] / aux_L2[:, 1].clamp(min=1)).mean().item()}


class HybridMetricsProcessor(MetricsProcessor):
    def __init__(self, job_config: JobConfig, parallel_dims: ParallelDims, tag=None) -> None:
        super().__init__(job_config, parallel_dims, tag)
        self.batch_group = (parallel_dims.get_mesh("batch").get_group()
                            if parallel_dims.dp_enabled else None)
        hybrid = getattr(job_config, "hybrid", None)
        path = getattr(hybrid, "loss_curve_file", "") if hybrid is not None else ""
        self.loss_curve_file = Path(path) if path else None
        self.curve_rank = _get_metrics_rank(parallel_dims, job_config)

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        router = router_statistics(getattr(self, "model_parts", []), self.batch_group)
        super().log(step, global_avg_loss, global_max_loss, grad_norm,
                    {**(extra_metrics or {}), **router})
        if router:
            logger.info("step: %2d  " % step + "  ".join(
                f"{name}: {value:.4f}" for name, value in router.items()))
        rank = dist.get_rank() if dist.is_initialized() else 0
        if self.loss_curve_file is None or rank != self.curve_rank:
            return
        self.loss_curve_file.parent.mkdir(parents=True, exist_ok=True)
        with self.loss_curve_file.open("a") as f:
            f.write(json.dumps({"step": step, "loss": _as_float(global_avg_loss),
                                "grad_norm": _as_float(grad_norm), **router}) + "\n")


def build_hybrid_metrics_processor(job_config: JobConfig, parallel_dims: ParallelDims,
                                   model_args=None, tag: str | None = None) -> MetricsProcessor:
    return HybridMetricsProcessor(job_config, parallel_dims, tag)

"""Activation checkpointing: torchtitan's `apply_ac` on every top-level layer / bracket group,
with titan_hybrid's list of ops that per-op selective AC keeps.

Per-op selective AC (`--activation_checkpoint.mode selective
--activation_checkpoint.selective_ac_option op`) keeps the outputs of the ops in
`SELECTIVE_AC_SAVED_OPS` through the backward and recomputes the rest: torchtitan's rule for
transformers (every matmul but every second one, the attention kernels, max, the reduce-scatter)
plus the two sequence-mixing scans, whose recompute costs most: the SSD scan and the gated delta
rule, as their kernels' custom ops (their torch paths are matmuls already). Norms, convs, gates
and the MoE router are memory-bound and recomputed. Without a save list torchtitan's per-op mode
would recompute everything, like full AC.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torchtitan.config.job_config import ActivationCheckpoint
from torchtitan.distributed.activation_checkpoint import apply_ac

import titan_hybrid.ops.gated_delta  # noqa: F401  (registers titan_hybrid::fla_gated_delta_fwd)
import titan_hybrid.ops.ssd  # noqa: F401  (registers titan_hybrid::mamba_ssd_fwd)
from titan_hybrid.compat.aten_ops import ATTENTION_OPS, GROUPED_MM_OP, REDUCE_SCATTER_OP
from titan_hybrid.training.run_config import ActivationCheckpointSection

SELECTIVE_AC_SAVED_OPS = {
    torch.ops.aten.mm.default,
    GROUPED_MM_OP,
    *ATTENTION_OPS,
    REDUCE_SCATTER_OP,
    torch.ops.aten.max.default,
    torch.ops.titan_hybrid.mamba_ssd_fwd.default,
    torch.ops.titan_hybrid.fla_gated_delta_fwd.default,
}


def apply_activation_checkpointing(model: nn.Module, config: ActivationCheckpointSection, *,
                                   model_compile_enabled: bool, base_folder: str) -> None:
    apply_ac(model, ActivationCheckpoint(**dataclasses.asdict(config)),
             model_compile_enabled=model_compile_enabled,
             op_sac_save_list=SELECTIVE_AC_SAVED_OPS, base_folder=base_folder)

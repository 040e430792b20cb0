"""torch._dynamo configuration. Checked on torch 2.11 and 2.13-2.15."""

from __future__ import annotations

import torch._dynamo.config as dynamo_config

import titan_hybrid.compat  # noqa: F401  (the version check)


def count_forward_side_effects_once_under_checkpoint() -> None:
    """Let compiled graphs under activation checkpointing update module buffers in forward.

    Private name: `torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint`. The
    kinds' statistics counters (LayerKind.statistics: DSA's and the V4 `C` indexer's KL sums)
    are buffers a forward adds to; dynamo refuses such a mutation inside the checkpoint
    operator ("HOP: Unsafe side effect") unless told not to replay it when the backward
    recomputes the forward, which is what a counter of forwards wants. A process-wide
    setting, made when the trainer compiles its model (parallel/compile.py)."""
    if hasattr(dynamo_config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        dynamo_config.skip_fwd_side_effects_in_bwd_under_checkpoint = True

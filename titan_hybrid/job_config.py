"""titan_hybrid's additions to torchtitan's JobConfig.

Use with `[job] custom_config_module = "titan_hybrid.job_config"` in a TOML (or
`--job.custom_config_module titan_hybrid.job_config`); importing it also registers the
"hybrid" TrainSpec.
"""

from dataclasses import dataclass, field

import titan_hybrid  # noqa: F401  (registers the TrainSpec)


@dataclass
class Hybrid:
    pattern: str = ""
    """Hybrid layer pattern overriding the flavor's (e.g. "M*M-E", "M[M*]-", "M*-/*-")."""

    loss_curve_file: str = ""
    """If set, append each logged step's exact loss as a JSON line to this file."""

    document_masking: bool = False
    """Treat each row as documents packed back to back, each starting with the tokenizer's BOS
    token: attention stays inside a document, Mamba / GDN states and conv taps restart at each
    document, and rotary positions restart at 0 (Megatron's THD packing, torchtitan's
    block_causal). With context parallelism each row is zigzag-sharded as one sequence."""

    load_layers_by_order: bool = False
    """Read a checkpoint of another pattern: the k-th layer of each kind (attention, MLP, ...)
    loads the checkpoint's k-th layer of that kind; kinds it lacks keep their fresh init. For
    a plain transformer checkpoint into a grouped or hybrid pattern (use with
    --checkpoint.initial_load_path)."""


@dataclass
class Parallelism:
    data_parallel_sharding_strategy: str = "optim_grads_params"
    """Megatron-FSDP names: no_shard (DDP), optim (ZeRO-1), optim_grads (ZeRO-2),
    optim_grads_params (ZeRO-3). With HSDP it applies to the shard dimension."""

    expert_parallel_overlap: bool = False
    """Run the forward of each microbatch together with the backward of the previous one so
    that their expert-parallel all-to-alls overlap the other's compute (combined 1F1B). Needs
    expert_parallel_degree > 1; at PP = 1 at least 2 microbatches per step (gradient
    accumulation), under PP the 1F1B or Interleaved1F1B schedule."""

    disable_sequence_parallel: bool = False
    """With tensor parallelism, norms and the residual stream are sharded along the sequence
    between TP regions (all-gather on entry, reduce-scatter on exit) unless this is set."""


@dataclass
class JobConfig:
    hybrid: Hybrid = field(default_factory=Hybrid)
    parallelism: Parallelism = field(default_factory=Parallelism)

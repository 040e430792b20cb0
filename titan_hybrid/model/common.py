"""Helpers shared by the layer modules: tensor-parallel layout declarations and init."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class TPLayout:
    """How tensor parallelism lays out one parameter (Megatron's per-parameter layouts).

    `shard_dim` None: replicated on every TP rank. A fused tensor lists its parts along
    `shard_dim` (`partition_sizes`, by checkpoint-key suffix `partition_names`, e.g. "_w" /
    "_v"): each TP rank holds its own slice of every part, and checkpoints store each part
    under its own key. `partial_grad`: replicated, but applied to each rank's own shard of the
    activations (one norm weight shared by all heads), so each rank's gradient is a partial sum
    that the TP plan must sum over the group."""

    shard_dim: int | None
    partition_sizes: tuple[int, ...] | None = None
    partial_grad: bool = False
    partition_names: tuple[str, ...] | None = None


REPLICATED = TPLayout(None)
REPLICATED_ON_LOCAL_SHARDS = TPLayout(None, partial_grad=True)


def sharded(dim: int = 0, components: dict[str, int] | None = None) -> TPLayout:
    """Split along `dim`; `components`: the parts of a fused tensor by key suffix and size."""
    if components is None:
        return TPLayout(dim)
    return TPLayout(dim, tuple(components.values()), partition_names=tuple(components))


def tensor_parallel_layouts(root: nn.Module) -> dict[str, TPLayout]:
    """Every parameter of `root` by FQN -> its TPLayout.

    A layer module declares the layouts of the parameters it splits, by name relative to itself,
    in a `tensor_parallel_layouts()` method (as torchtitan's plans name modules); every other
    parameter is replicated. Declarations are part of the module's class, so deep copies
    (pipeline stages) and wrapped modules (FSDP, compile, activation checkpointing) keep them.
    FQNs are those of `root.named_parameters()`, which torch's wrappers keep free of their
    own prefixes (the state dict's keys)."""
    declared = {}  # id(parameter) -> layout
    for module in root.modules():
        if callable(getattr(type(module), "tensor_parallel_layouts", None)):
            for name, layout in module.tensor_parallel_layouts().items():
                param = module.get_parameter(name)
                if layout.partition_sizes is not None:
                    assert sum(layout.partition_sizes) == param.shape[layout.shard_dim], (
                        type(module).__name__, name, layout)
                declared[id(param)] = layout
    return {name: declared.get(id(param), REPLICATED)
            for name, param in root.named_parameters(remove_duplicate=False)}


def init_linear(linear: nn.Linear, *, std: float) -> None:
    nn.init.trunc_normal_(linear.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


def init_depthwise_conv(conv: nn.Conv1d) -> None:
    # nn.Conv1d's own default (kaiming-uniform over the fan-in of one channel), made explicit so
    # that meta-device construction followed by init_weights() gives the usual distribution.
    fan_in = conv.weight.shape[1] * conv.weight.shape[2]
    bound = 1.0 / math.sqrt(fan_in)
    nn.init.uniform_(conv.weight, -bound, bound)
    if conv.bias is not None:
        nn.init.uniform_(conv.bias, -bound, bound)


def upcast(t: torch.Tensor) -> torch.Tensor:
    """`t` in at least fp32 (bf16/fp16 -> fp32), never lower: fp64 stays fp64, so float64 runs
    (the test references) keep their precision instead of being rounded through fp32."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def inverse_softplus(x: torch.Tensor) -> torch.Tensor:
    # softplus(y) = x  <=>  y = x + log(-expm1(-x)); expm1 keeps it exact for small x.
    return x + torch.log(-torch.expm1(-x))


def init_dt_bias(dt_bias: torch.Tensor, *, dt_min: float, dt_max: float,
                 dt_floor: float) -> None:
    """mamba_ssm's time-step init (Mamba1, Mamba2, Mamba-3, GDN): dt log-uniform in
    [dt_min, dt_max], floored, stored as softplus^-1(dt) in the bias that softplus takes."""
    nn.init.uniform_(dt_bias, math.log(dt_min), math.log(dt_max))
    with torch.no_grad():
        dt_bias.copy_(inverse_softplus(torch.exp(upcast(dt_bias)).clamp(min=dt_floor)))


def init_ssm_decay(A_log: torch.Tensor, dt_bias: torch.Tensor, *, a_range: tuple[float, float],
                   dt_min: float, dt_max: float, dt_floor: float) -> None:
    """Mamba2's init, shared by GDN: A uniform in a_range (stored as log), and dt_bias as
    init_dt_bias."""
    nn.init.uniform_(A_log, *a_range)
    A_log.copy_(torch.log(A_log))
    init_dt_bias(dt_bias, dt_min=dt_min, dt_max=dt_max, dt_floor=dt_floor)


class TensorParallelPartialSum(nn.Module):
    """The identity, marking a sum over heads or channels that the rest of a TP region
    computes with (the sum of squares of a norm over all heads' channels, Mamba1's x_proj):
    under tensor parallelism each rank holds its own heads' share, and the TP plan sums the
    output over the group, and its gradient too (parallel/tensor_parallel.py). Inside a
    recurrent core under context parallelism's head exchange, where a rank holds 1/cp of the
    heads, it is summed over the CP group as well (parallel/context_parallel.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class TensorParallelHeadSum(nn.Module):
    """The identity, marking a sum over attention heads: under tensor parallelism each rank
    holds only its own heads' share of the sum, and the TP plan sums the output over the
    group (parallel/tensor_parallel.py). For values outside autograd (detached targets)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class WholeSequenceSum(nn.Module):
    """A sum over the tokens of a sequence: the identity on one device, where the sequence is
    whole; context parallelism sums it over the ranks that hold the sequence's pieces
    (parallel/context_parallel.py), so that a statistic of the sequence, not of the piece,
    enters the loss (the MoE balance loss's slot counts)."""

    def forward(self, local_sum: torch.Tensor) -> torch.Tensor:
        return local_sum

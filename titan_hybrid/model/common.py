"""Helpers shared by the layer modules: parameter layout annotations and init."""

from __future__ import annotations

import math

import torch
from torch import nn


def annotate_tensor_parallel(
    param: nn.Parameter, *, partition_dim: int = 0, components: dict[str, int] | None = None
) -> None:
    """Record on the PARAMETER how tensor parallelism splits it (Megatron's attribute names).

    `components` lists the parts of a fused tensor along `partition_dim`, by checkpoint-key
    suffix and size (e.g. {"_w": H, "_v": H}): each TP rank holds its own slice of every part,
    so the plan splits each part separately (`partition_sizes`), and checkpoints store each
    part under its own key (`partition_names`). The TP plan reads these attributes first.
    """
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    if components is not None:
        assert sum(components.values()) == param.shape[partition_dim], (components, param.shape)
        param.partition_sizes = tuple(components.values())
        param.partition_names = tuple(components)


def annotate_replicated_on_local_shards(param: nn.Parameter) -> None:
    """A parameter that tensor parallelism replicates but applies to each rank's own shard of
    the activations (e.g. one norm weight shared by all heads): each rank's gradient is only a
    partial sum, and the TP plan must sum it over the group."""
    param.tensor_parallel_partial_grad = True


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


def init_ssm_decay(A_log: torch.Tensor, dt_bias: torch.Tensor, *, a_range: tuple[float, float],
                   dt_min: float, dt_max: float, dt_floor: float) -> None:
    """Mamba2's init, shared by GDN: A uniform in a_range (stored as log), and a time step dt
    log-uniform in [dt_min, dt_max], floored, stored as softplus^-1(dt) in dt_bias."""
    nn.init.uniform_(A_log, *a_range)
    A_log.copy_(torch.log(A_log))
    nn.init.uniform_(dt_bias, math.log(dt_min), math.log(dt_max))
    dt_bias.copy_(inverse_softplus(torch.exp(upcast(dt_bias)).clamp(min=dt_floor)))


class TensorParallelHeadSum(nn.Module):
    """The identity, marking a sum over attention heads: under tensor parallelism each rank
    holds only its own heads' share of the sum, and the TP plan sums the output over the
    group (parallel/tensor_parallel.py). For values outside autograd (detached targets)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

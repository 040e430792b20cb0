"""Tensor + sequence parallelism derived from per-parameter annotations.

Layout. Every parameter becomes a DTensor on the TP mesh, placed by its TPLayout: the layer
modules declare the layouts of the parameters they split, by name
(`tensor_parallel_layouts()`, collected by model.common.tensor_parallel_layouts; Mamba's
gated-norm weight is a norm by name but sharded); every other parameter is replicated. A fused
tensor (`partition_sizes`) is sharded so that each rank holds its own slice of every
component: its global (DTensor) view is the per-rank concatenation [W_0; V_0; W_1; V_1], see
`interleave_for_tp`.

Compute. Each mixer (of any kind in the table) is one TP region, as in Megatron:
its input is replicated (or, with sequence parallelism, all-gathered from sequence shards) on
entry, everything inside runs on local tensors (heads, channels, experts' hidden units), and
its partial output is all-reduced (or reduce-scattered back to sequence shards) on exit. The
model code stays single-device: inside a region, reading a parameter gives its local view
(`use_local_views`); the parameters themselves stay DTensors, registered where they are.

Gradients of replicated parameters. Inside a region every path to the output passes through
rank-local partial results, so a replicated parameter there (GDN's per-head output norm on
local heads, the MoE router whose weights scale local expert outputs) gets only a partial
gradient on each rank: it takes a Partial gradient, summed over the TP group. Outside the
regions the same holds with sequence parallelism (norms see one sequence shard). Treating these
gradients as replicated (what `DTensor.to_local()` assumes by default: the gradient keeps the
parameter's Replicate placement, so nothing sums it) raises no error and leaves each rank
stepping with its own partial gradient: the replicas silently diverge. A region's side
outputs (the MoE load-balancing loss) are computed identically on every rank; their gradient is
scaled by 1/TP so that the sum over ranks counts it once.

Sums over heads. A value summed over all heads inside a region (DSA's indexer target) is a
partial sum on each rank; the model marks it with `TensorParallelHeadSum`, whose output is
all-reduced here. A sum the region goes on computing with (the mean square of a norm across
heads) is marked `TensorParallelPartialSum`: all-reduced forward, and its gradient, a partial
one on each rank (each rank's heads use it), all-reduced backward too.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from titan_hybrid.model.common import TensorParallelHeadSum, TensorParallelPartialSum, TPLayout
from titan_hybrid.model.model import HybridLayer
from titan_hybrid.model.module_classes import extend_class
from titan_hybrid.parallel.collectives import all_reduce_sum


def placement_of(layout: TPLayout) -> Placement:
    return Replicate() if layout.shard_dim is None else Shard(layout.shard_dim)


def tp_degree(tensor: torch.Tensor | None) -> int:
    """Size of the "tp" (experts: "etp") dimension of a DTensor's mesh (1 for plain tensors
    or no TP)."""
    if not isinstance(tensor, DTensor):
        return 1
    names = tensor.device_mesh.mesh_dim_names or ()
    for name in ("tp", "etp"):
        if name in names:
            return tensor.device_mesh.size(names.index(name))
    return 1


def interleave_for_tp(full: torch.Tensor, layout: TPLayout, tp: int) -> torch.Tensor:
    """Logical [A; B; ...] -> per-rank concatenation [A_0; B_0; A_1; B_1; ...] along the dim."""
    if layout.partition_sizes is None or tp == 1:
        return full
    components = full.split(list(layout.partition_sizes), dim=layout.shard_dim)
    per_rank = [c.chunk(tp, dim=layout.shard_dim) for c in components]
    return torch.cat([part[r] for r in range(tp) for part in per_rank], dim=layout.shard_dim)


def deinterleave_from_tp(interleaved: torch.Tensor, layout: TPLayout, tp: int) -> torch.Tensor:
    """Inverse of interleave_for_tp."""
    if layout.partition_sizes is None or tp == 1:
        return interleaved
    local_sizes = [size // tp for size in layout.partition_sizes]
    blocks = interleaved.split(local_sizes * tp, dim=layout.shard_dim)
    n = len(local_sizes)
    return torch.cat([torch.cat(blocks[c::n], dim=layout.shard_dim) for c in range(n)],
                     dim=layout.shard_dim)


# --------------------------------------------------------------------------- local views
class _ReadsLocalViews:
    """Mixed into the class of a module whose forward (single-device model code) reads its
    DTensor parameters: while its region runs (`_local_views_depth` > 0), reading such a
    parameter (`self.weight`, `self.conv1d.weight`: nn.Module.__getattr__, since parameters live
    in the module's registry) gives the DTensor's local view, `to_local` with the gradient
    placement the parameter needs: Partial for the names in `_partial_grad_names`, its own
    placement otherwise. Only reading changes: the parameter registry that FSDP, the optimizer
    and the state dict use is never written, and outside the region the attribute is the
    DTensor (model/module_classes.py: how the class is extended)."""

    def __getattr__(self, name: str):
        value = super().__getattr__(name)
        if isinstance(value, DTensor) and self.__dict__.get("_local_views_depth", 0) > 0:
            partial = name in self.__dict__["_partial_grad_names"]
            return value.to_local(grad_placements=[Partial()] if partial else value.placements)
        return value


def _reading_local_views(module: nn.Module, partial: set[str]) -> None:
    if not isinstance(module, _ReadsLocalViews):
        extend_class(module, _ReadsLocalViews)
        module.__dict__["_local_views_depth"] = 0
        module.__dict__["_partial_grad_names"] = set()
    module.__dict__["_partial_grad_names"] |= partial


def use_local_views(root: nn.Module, owners: list[tuple[nn.Module, set[str]]]) -> None:
    """During root's forward, the DTensor parameters of each owner (root and/or its
    submodules, which the model code may read directly, e.g. `self.conv1d.weight`) read as
    their local views; the owner's parameters named in its set take Partial gradients.

    A depth, not a flag: activation checkpointing's recomputation and nested regions (EP x
    TP's experts inside the MoE region) enter while a forward is in flight."""
    for owner, partial in owners:
        _reading_local_views(owner, partial)

    def enter(module, args):
        for owner, _ in owners:
            owner.__dict__["_local_views_depth"] += 1

    def leave(module, args, output):
        for owner, _ in owners:
            owner.__dict__["_local_views_depth"] -= 1
        return output

    root.register_forward_pre_hook(enter)
    root.register_forward_hook(leave)


# --------------------------------------------------------------------------- regions
def _enter_region(x: torch.Tensor, mesh: DeviceMesh, sequence_parallel: bool) -> torch.Tensor:
    """Replicated (or all-gathered) input; its gradient is summed over the group (or
    reduce-scattered) because each rank's use of it covers only its own heads / channels."""
    dx = DTensor.from_local(x, mesh, [Shard(1)] if sequence_parallel else [Replicate()],
                            run_check=False)
    return dx.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])


def _leave_region(y: torch.Tensor, mesh: DeviceMesh, sequence_parallel: bool) -> torch.Tensor:
    dy = DTensor.from_local(y, mesh, [Partial()], run_check=False)
    return dy.redistribute(mesh, [Shard(1)] if sequence_parallel else [Replicate()]).to_local()


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def _make_region(mixer: nn.Module, mesh: DeviceMesh, sequence_parallel: bool) -> None:
    def enter(module, args):
        return (_enter_region(args[0], mesh, sequence_parallel), *args[1:])

    def leave(module, args, output):
        if isinstance(output, tuple):  # MoE: (output, aux_loss), see the module docstring
            side = tuple(_ScaleGrad.apply(t, 1.0 / mesh.size()) for t in output[1:])
            return (_leave_region(output[0], mesh, sequence_parallel), *side)
        return _leave_region(output, mesh, sequence_parallel)

    mixer.register_forward_pre_hook(enter)
    mixer.register_forward_hook(leave)


# --------------------------------------------------------------------------- entry point
def _distribute_params(module: nn.Module, prefix: str, layouts: dict[str, TPLayout],
                       mesh: DeviceMesh, *, outside_regions: bool,
                       sequence_parallel: bool) -> set[str] | None:
    """Turn module's own parameters into TP DTensors; returns the names of those whose
    gradients are partial sums (None when it has no parameters of its own)."""
    params = list(module.named_parameters(recurse=False, remove_duplicate=False))
    partial = set()
    for name, param in params:
        layout = layouts[prefix + name]
        # Outside the TP regions with sequence parallelism, every rank sees only its own
        # sequence shard, so replicated parameters there accumulate partial gradients too.
        if layout.partial_grad or (layout.shard_dim is None
                                   and (not outside_regions or sequence_parallel)):
            partial.add(name)
        dtensor = distribute_tensor(param.data, mesh, [placement_of(layout)], src_data_rank=None)
        module.register_parameter(name, nn.Parameter(dtensor, requires_grad=param.requires_grad))
    return partial if params else None


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, layouts: dict[str, TPLayout],
                          *, sequence_parallel: bool, loss_parallel: bool) -> dict[str, str]:
    """Apply TP (+SP) to a HybridModel built on the meta device, with `layouts` its
    parameters' (model.common.tensor_parallel_layouts). Returns {parameter FQN: "tp"} for the
    parameters whose gradients are partial sums over the TP group."""
    partial_over_tp: dict[str, str] = {}
    names = {id(module): name for name, module in model.named_modules()}

    def distribute(module: nn.Module, *, outside_regions: bool) -> set[str] | None:
        prefix = f"{names[id(module)]}." if names[id(module)] else ""
        partial = _distribute_params(module, prefix, layouts, tp_mesh,
                                     outside_regions=outside_regions,
                                     sequence_parallel=sequence_parallel)
        partial_over_tp.update({prefix + name: "tp" for name in partial or ()})
        return partial

    mixers = [mixer for layer in model.modules() if isinstance(layer, HybridLayer)
              for _, mixer in layer.mixers()]
    inside = {id(m) for mixer in mixers for m in mixer.modules()}
    boundary = {id(model.tok_embeddings), id(model.output)}
    for module in model.modules():
        if id(module) in boundary or id(module) in inside:
            continue
        partial = distribute(module, outside_regions=True)
        if partial is not None:
            use_local_views(module, [(module, partial)])
    for mixer in mixers:
        owners = []
        for module in mixer.modules():
            partial = distribute(module, outside_regions=False)
            if partial is not None:
                owners.append((module, partial))
        use_local_views(mixer, owners)
        _make_region(mixer, tp_mesh, sequence_parallel)

    for module in model.modules():
        if isinstance(module, TensorParallelHeadSum):
            module.register_forward_hook(
                lambda module, args, output: _leave_region(output, tp_mesh, False))
        elif isinstance(module, TensorParallelPartialSum):
            module.register_forward_hook(
                lambda module, args, output: all_reduce_sum(output, group=tp_mesh.get_group()))

    sequence = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=sequence,
                                          use_local_output=False),
        "output": ColwiseParallel(input_layouts=sequence,
                                  output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    }
    # A pipeline stage may hold neither.
    parallelize_module(model, tp_mesh, {name: style for name, style in plan.items()
                                        if getattr(model, name) is not None})
    if model.tok_embeddings is not None:
        model.tok_embeddings.register_forward_hook(_local_copy)
    # Both styles split the vocabulary rows (Shard(0)): the embedding's DTensor serves the head.
    model.tie_weights()
    return partial_over_tp


def _local_copy(module, args, output: DTensor) -> torch.Tensor:
    """The embedding's output as a local tensor that is not a view of the DTensor's.

    torch 2.13 / 2.14: when a torch.compile'd (AOTAutograd) layer takes the local view of an
    embedding's RowwiseParallel output as input, its backward hands a plain tensor to
    DTensor's Redistribute backward, which fails with "'Tensor' object has no attribute
    '_local_tensor'" (reproduced with one nn.Embedding and one compiled module; eager and
    dynamo-only backends are fine). The copy costs one [B, T, D] activation per step."""
    return output.to_local().clone()

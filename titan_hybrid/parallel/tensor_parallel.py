"""Tensor + sequence parallelism derived from per-parameter annotations.

Layout. Every parameter becomes a DTensor on the TP mesh, placed by `classify_parameter` from
the parameter's own `tensor_model_parallel` / `partition_dim` / `partition_sizes` annotations
(set by the model code: Mamba's gated-norm weight is a norm by name but sharded); a parameter
without them is replicated. A fused tensor (`partition_sizes`) is sharded so that each rank holds its own
slice of every component: its global (DTensor) view is the per-rank concatenation
[W_0; V_0; W_1; V_1], see `interleave_for_tp`.

Compute. Each mixer (attention, MLP, Mamba, GDN, MoE) is one TP region, as in Megatron:
its input is replicated (or, with sequence parallelism, all-gathered from sequence shards) on
entry, everything inside runs on local tensors (heads, channels, experts' hidden units), and
its partial output is all-reduced (or reduce-scattered back to sequence shards) on exit. The
model code stays single-device: hooks swap each parameter for its local view during forward.

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
all-reduced here.
"""

from __future__ import annotations

from dataclasses import dataclass

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

from titan_hybrid.compat.nn import parameter_slots
from titan_hybrid.model.common import TensorParallelHeadSum
from titan_hybrid.model.model import HybridLayer


@dataclass(frozen=True)
class TPLayout:
    shard_dim: int | None  # None: replicated
    partition_sizes: tuple[int, ...] | None = None
    partial_grad: bool = False  # replicated, but each rank's gradient is a partial sum
    partition_names: tuple[str, ...] | None = None  # checkpoint-key suffix of each part

    def placement(self) -> Placement:
        return Replicate() if self.shard_dim is None else Shard(self.shard_dim)


def classify_parameter(param: torch.Tensor) -> TPLayout:
    """A parameter's layout from its annotations (model/common.py); none means replicated."""
    if getattr(param, "tensor_model_parallel", False):
        return TPLayout(param.partition_dim, getattr(param, "partition_sizes", None),
                        partition_names=getattr(param, "partition_names", None))
    return TPLayout(None, partial_grad=bool(getattr(param, "tensor_parallel_partial_grad", False)))


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


def record_param_layouts(model: nn.Module) -> None:
    """Classify every parameter while its annotations still exist (on the meta model: to_empty
    and fully_shard replace parameter objects) and keep the result on its module, where the
    TP plan, the layout-independent init and the checkpoint split read it. Modules that
    already hold layouts keep them: a pipeline stage is a deep copy, which keeps the module's
    layouts but not the annotations on its parameters."""
    for module in model.modules():
        if "param_layouts" in module.__dict__:
            continue
        layouts = {name: classify_parameter(param)
                   for name, param in module.named_parameters(recurse=False,
                                                              remove_duplicate=False)}
        if layouts:
            module.__dict__["param_layouts"] = layouts


# --------------------------------------------------------------------------- local views
def use_local_views(root: nn.Module, owners: list[nn.Module]) -> None:
    """During root's forward, the DTensor parameters of `owners` (root and/or its submodules,
    which the model code may read directly, e.g. `self.conv1d.weight`) are their local views.

    Swaps nest: under EP x TP the MoE region swaps its experts, then the experts' own FSDP unit
    puts its gathered parameters back, and the experts' own swap replaces those."""

    def swap(module, args):
        for owner in owners:
            slots = parameter_slots(owner)  # a plain tensor in a parameter's slot: see compat
            saved = dict(slots)
            owner.__dict__.setdefault("tp_saved_params", []).append(saved)
            for name, param in saved.items():
                if isinstance(param, DTensor):
                    partial = owner.tp_partial_grad.get(name, False)
                    grad = [Partial()] if partial else param.placements
                    slots[name] = param.to_local(grad_placements=grad)

    def restore(module, args, output):
        for owner in owners:
            parameter_slots(owner).update(owner.tp_saved_params.pop())
        return output

    root.register_forward_pre_hook(swap)
    root.register_forward_hook(restore)


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
def _distribute_params(module: nn.Module, mesh: DeviceMesh, *, outside_regions: bool,
                       sequence_parallel: bool) -> bool:
    """Turn module's own parameters into TP DTensors; returns whether it has any."""
    partial_grad = {}
    for name, param in list(module.named_parameters(recurse=False, remove_duplicate=False)):
        layout = module.param_layouts[name]
        # Outside the TP regions with sequence parallelism, every rank sees only its own
        # sequence shard, so replicated parameters there accumulate partial gradients too.
        partial_grad[name] = layout.partial_grad or (
            layout.shard_dim is None and (not outside_regions or sequence_parallel))
        dtensor = distribute_tensor(param.data, mesh, [layout.placement()], src_data_rank=None)
        setattr(module, name, nn.Parameter(dtensor, requires_grad=param.requires_grad))
    module.tp_partial_grad = partial_grad
    return bool(partial_grad)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool,
                          loss_parallel: bool) -> None:
    """Apply TP (+SP) to a HybridModel built on the meta device, after record_param_layouts."""
    mixers = [layer.mixer for layer in model.modules() if isinstance(layer, HybridLayer)]
    inside = {id(m) for mixer in mixers for m in mixer.modules()}
    boundary = {id(model.tok_embeddings), id(model.output)}
    for module in model.modules():
        if id(module) in boundary or id(module) in inside:
            continue
        if _distribute_params(module, tp_mesh, outside_regions=True,
                              sequence_parallel=sequence_parallel):
            use_local_views(module, [module])
    for mixer in mixers:
        owners = [m for m in mixer.modules()
                  if _distribute_params(m, tp_mesh, outside_regions=False,
                                        sequence_parallel=sequence_parallel)]
        use_local_views(mixer, owners)
        _make_region(mixer, tp_mesh, sequence_parallel)

    for module in model.modules():
        if isinstance(module, TensorParallelHeadSum):
            module.register_forward_hook(
                lambda module, args, output: _leave_region(output, tp_mesh, False))

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


def _local_copy(module, args, output: DTensor) -> torch.Tensor:
    """The embedding's output as a local tensor that is not a view of the DTensor's.

    torch 2.13 / 2.14: when a torch.compile'd (AOTAutograd) layer takes the local view of an
    embedding's RowwiseParallel output as input, its backward hands a plain tensor to
    DTensor's Redistribute backward, which fails with "'Tensor' object has no attribute
    '_local_tensor'" (reproduced with one nn.Embedding and one compiled module; eager and
    dynamo-only backends are fine). The copy costs one [B, T, D] activation per step."""
    return output.to_local().clone()

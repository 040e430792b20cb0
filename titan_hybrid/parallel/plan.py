"""The ParallelPlan: what parallelizing a model decided and built, as one explicit value.

`parallelize_hybrid` returns it (under PP, one per stage, merged with `add`); the builders that
come after it take it as an argument: the optimizer (the ZeRO-1 mesh), the checkpoint's split of
fused tensors (the layouts), the trainer (the EP-overlap coordinator). Nothing about the
layout is written onto modules or parameters: a kind's per-parameter TP layouts are declared by
its module (model.common.tensor_parallel_layouts), and the hooks parallel code registers keep
what they need in their closures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titan_hybrid.model.common import TPLayout, tensor_parallel_layouts
from titan_hybrid.parallel.ep_overlap import OverlapCoordinator
from titan_hybrid.parallel.expert_parallel import ExpertDispatcher


@dataclass
class ParallelPlan:
    # Every parameter of the parallelized model (parts) by FQN: how TP lays it out.
    layouts: dict[str, TPLayout] = field(default_factory=dict)
    # Parameter FQN -> the mesh dimension whose ranks each hold a partial sum of its gradient
    # (replicated parameters applied to rank-local activations; see tensor_parallel.py).
    partial_grads: dict[str, str] = field(default_factory=dict)
    # ZeRO-1 (`optim` strategy): the optimizer state is sharded over this mesh.
    zero1_mesh: DeviceMesh | None = None
    # MoE experts' module FQN -> the dispatcher routing its tokens under expert parallelism.
    expert_dispatchers: dict[str, ExpertDispatcher] = field(default_factory=dict)
    # EP all-to-all overlap: the coordinator the trainer's (or pipeline's) schedule drives.
    overlap: OverlapCoordinator | None = None

    @classmethod
    def unparallelized(cls, model_parts: list[nn.Module]) -> ParallelPlan:
        """The plan of model parts used as built (single device, or parallelized by hand)."""
        plan = cls()
        for part in model_parts:
            plan.add(cls(layouts=tensor_parallel_layouts(part)))
        return plan

    def add(self, stage: ParallelPlan) -> None:
        """Merge one pipeline stage's plan into this rank's (stages hold disjoint FQNs)."""
        assert not self.layouts.keys() & stage.layouts.keys(), "stages share parameters"
        self.layouts.update(stage.layouts)
        self.partial_grads.update(stage.partial_grads)
        self.expert_dispatchers.update(stage.expert_dispatchers)
        if stage.zero1_mesh is not None:
            self.zero1_mesh = stage.zero1_mesh
        if stage.overlap is not None:
            self.overlap = stage.overlap

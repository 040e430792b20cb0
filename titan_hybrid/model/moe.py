"""Dropless top-k mixture of experts with fused-fc1 SwiGLU experts and a load-balancing loss.

Shape suffixes (README, "Shape suffixes"): X tokens (batch x time), D width, E experts,
A routing choices per token (top-k).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_hybrid.model.common import annotate_tensor_parallel, init_linear, upcast
from titan_hybrid.model.layer_kind import LayerKind
from titan_hybrid.model.mlp import SwiGLU

SCORE_FUNCTIONS = ("softmax", "sigmoid")


@dataclass
class MoEArgs:
    num_experts: int = 8
    top_k: int = 2
    hidden_dim: int = 256
    score_func: str = "softmax"  # or "sigmoid"
    shared_expert_hidden_dim: int = 0  # 0: no shared expert
    aux_loss_coeff: float = 1e-2


class TopKRouter(nn.Module):
    def __init__(self, *, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.num_experts, bias=False)

    def forward(self, x_XD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (weights [N, K], expert ids [N, K], load-balancing loss)."""
        # Routing in fp32: near-ties between experts flip under bf16 logits.
        logits = upcast(self.gate(x_XD))
        if self.args.score_func == "softmax":
            scores = logits.softmax(dim=-1)
            weights, experts = scores.topk(self.args.top_k, dim=-1)
        else:
            scores = logits.sigmoid()
            weights, experts = scores.topk(self.args.top_k, dim=-1)
            weights = weights / weights.sum(dim=-1, keepdim=True)
            scores = scores / scores.sum(dim=-1, keepdim=True)
        # Switch-style balance loss: E * sum_e (share of routed slots) * (mean router score).
        num_experts = self.args.num_experts
        slot_share = torch.bincount(experts.flatten(), minlength=num_experts).to(scores.dtype)
        slot_share = slot_share / experts.numel()
        aux_loss = num_experts * (slot_share * scores.mean(dim=0)).sum()
        return weights, experts, aux_loss


class GroupedExperts(nn.Module):
    """E SwiGLU experts; fc1[e] holds [W_e ; V_e] like the dense MLP."""

    def __init__(self, *, dim: int, hidden_dim: int, num_experts: int) -> None:
        super().__init__()
        self.fc1 = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, dim))
        self.fc2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        annotate_tensor_parallel(self.fc1, partition_dim=1,
                                 components={"_w": hidden_dim, "_v": hidden_dim})
        annotate_tensor_parallel(self.fc2, partition_dim=2)

    def forward(self, x_sorted_XD: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        outputs = []
        for expert, x in enumerate(x_sorted_XD.split(tokens_per_expert)):
            gate, up = (x @ self.fc1[expert].t()).chunk(2, dim=-1)
            outputs.append((F.silu(gate) * up) @ self.fc2[expert].t())
        return torch.cat(outputs)

    def init_weights(self, *, init_std: float, out_std: float) -> None:
        nn.init.trunc_normal_(self.fc1, std=init_std, a=-3 * init_std, b=3 * init_std)
        nn.init.trunc_normal_(self.fc2, std=out_std, a=-3 * out_std, b=3 * out_std)


class MoE(nn.Module):
    def __init__(self, *, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.router = TopKRouter(dim=dim, args=args)
        self.experts = GroupedExperts(dim=dim, hidden_dim=args.hidden_dim,
                                      num_experts=args.num_experts)
        self.shared_expert = (SwiGLU(dim=dim, hidden_dim=args.shared_expert_hidden_dim)
                              if args.shared_expert_hidden_dim > 0 else None)
        # Router statistics since the metrics last read them (titan_hybrid.metrics): slots
        # routed to each expert, and the summed load-balancing loss with its forward count.
        self.register_buffer("routed_tokens", torch.zeros(args.num_experts), persistent=False)
        self.register_buffer("aux_loss_sum", torch.zeros(2), persistent=False)

    def forward(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (output, this layer's load-balancing loss times its coefficient)."""
        x_XD = x_BTD.flatten(0, 1)
        weights_XA, experts_XA, aux_loss = self.router(x_XD)
        # Dropless dispatch: sort the N*K (token, expert) slots by expert, run each expert on
        # its contiguous block, scatter-add the weighted results back to their tokens.
        slot_order = experts_XA.flatten().argsort(stable=True)
        token_of_slot = slot_order // self.args.top_k
        tokens_per_expert = torch.bincount(experts_XA.flatten(), minlength=self.args.num_experts)
        with torch.no_grad():
            self.routed_tokens += tokens_per_expert
            aux_value = aux_loss.detach().to(self.aux_loss_sum.dtype)
            self.aux_loss_sum += torch.stack((aux_value, torch.ones_like(aux_value)))
        expert_out = self.experts(x_XD[token_of_slot], tokens_per_expert.tolist())
        slot_weights = weights_XA.flatten()[slot_order].unsqueeze(-1)
        out_XD = torch.zeros_like(x_XD).index_add_(
            0, token_of_slot, (upcast(expert_out) * slot_weights).type_as(x_XD))
        if self.shared_expert is not None:
            out_XD = out_XD + self.shared_expert(x_XD)
        return out_XD.view_as(x_BTD), aux_loss * self.args.aux_loss_coeff

    def reset_router_statistics(self) -> None:
        self.routed_tokens.zero_()
        self.aux_loss_sum.zero_()

    def init_weights(self, *, init_std: float, out_std: float) -> None:
        self.reset_router_statistics()
        init_linear(self.router.gate, std=init_std)
        self.experts.init_weights(init_std=init_std, out_std=out_std)
        if self.shared_expert is not None:
            self.shared_expert.init_weights(init_std=init_std, out_std=out_std)


def _validate(args: MoEArgs, dim: int) -> None:
    if args.num_experts < 1:
        raise ValueError(f"moe: num_experts={args.num_experts} must be >= 1")
    if not 1 <= args.top_k <= args.num_experts:
        raise ValueError(f"moe: top_k={args.top_k} must be in [1, num_experts="
                         f"{args.num_experts}]")
    if args.score_func not in SCORE_FUNCTIONS:
        raise ValueError(f"moe: score_func '{args.score_func}' is not 'softmax' or 'sigmoid'")


def _tensor_parallel_sizes(args: MoEArgs, dim: int) -> list[tuple[str, int]]:
    sizes = [("moe.hidden_dim", args.hidden_dim)]
    if args.shared_expert_hidden_dim:
        sizes.append(("moe.shared_expert_hidden_dim", args.shared_expert_hidden_dim))
    return sizes


KIND = LayerKind(
    symbol="E", name="moe", title="mixture of experts", args_type=MoEArgs,
    build=lambda args, dim, norm_eps: MoE(dim=dim, args=args),
    has_aux_loss=True, closes_group=True, validate=_validate,
    tensor_parallel_sizes=_tensor_parallel_sizes,
    # The experts' token counts are data (`.tolist()` for the split): they run eagerly.
    compiled_parts=("router", "shared_expert"),
)

"""Dropless top-k mixture of experts with fused-fc1 SwiGLU experts and a load-balancing loss.

The experts run as two grouped GEMMs (`torch.nn.functional.grouped_mm`, public in torch 2.11 and 2.13-2.15)
over the routing slots sorted by expert, whatever the number of experts, with the per-expert counts kept on the device, so the forward reads nothing
back to the host (expert parallelism reads them for its all-to-all splits, expert_parallel.py).
On CUDA, bf16 on sm90 / sm100 is one CUTLASS kernel per grouped GEMM; other dtypes and devices
(CPU included) run torch's fallback, a loop of mm per group inside the op, which reads the
offsets to the host. Rows move into and out of slot order by gathers, forward and backward: no
zero-filled buffer and no scatter-add (whose atomics make CUDA nondeterministic).

Shape suffixes (docs/architecture.md, "Shape suffixes"): X tokens (batch x time), D width, E experts,
A routing choices per token (top-k). Tensors named `*_sorted_XD` hold one row per slot
(X * A of them), sorted by expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_hybrid.model.common import TPLayout, WholeSequenceSum, init_linear, sharded, upcast
from titan_hybrid.model.layer_kind import DATA, KindStatistics, LayerKind
from titan_hybrid.model.mlp import ACTIVATIONS, MLPArgs, build_mlp, swiglu
from titan_hybrid.runtime.errors import JobError

SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")


@dataclass
class MoEArgs:
    num_experts: int = 8
    top_k: int = 2
    hidden_dim: int = 256
    # "softmax", "sigmoid", or "sqrtsoftplus" (DeepSeek-V4's sqrt(softplus(logit)))
    score_func: str = "softmax"
    shared_expert_hidden_dim: int = 0  # 0: no shared expert
    aux_loss_coeff: float = 1e-2
    # The experts' and the shared expert's MLP: "swiglu", or "relu2" (Nemotron 3's non-gated
    # squared ReLU).
    activation: str = "swiglu"
    # SwiGLU's clamp (DeepSeek-V4's swiglu_limit, Megatron's activation_func_clamp_value), in
    # the routed experts and the shared expert: silu(min(gate, L)) * clamp(up, -L, L). 0: none.
    swiglu_limit: float = 0.0
    # Divide the chosen experts' weights by their sum (transformers' norm_topk_prob); None:
    # the score function's default (softmax: no, sigmoid and sqrtsoftplus: yes).
    norm_topk_prob: bool | None = None
    # ... plus this in that sum (DeepSeek's 1e-20; lfm2_moe's router 1e-6).
    norm_topk_eps: float = 1e-20
    # Multiply the chosen experts' weights (DeepSeek-V3 / Nemotron 3's routed_scaling_factor).
    routed_scaling_factor: float = 1.0
    # A per-expert bias added to the scores to choose the experts, not to weigh them
    # (DeepSeek-V3 / Nemotron 3's e_score_correction_bias, a buffer the checkpoint holds).
    score_correction_bias: bool = False
    # Group-limited routing: experts in n_group groups, each token choosing among the
    # topk_group groups whose two best scores sum highest (DeepSeek-V3's n_group / topk_group).
    n_group: int = 1
    topk_group: int = 1
    # The shared expert's output times sigmoid(a learned projection of the token) (Qwen2-MoE,
    # Qwen3-Next, Qwen3.5's shared_expert_gate).
    shared_expert_gate: bool = False
    # Latent MoE (Nemotron 3 Super's moe_latent_size, Megatron's --moe-latent-size): > 0 runs
    # the routed experts on tokens projected to this width (fc1_latent) and projects their
    # weighted sum back (fc2_latent); the router and the shared expert see the full width.
    # Expert parallelism then moves latent tokens. 0: experts on the model width.
    latent_dim: int = 0
    # Hash routing (DeepSeek-V4's hash_moe layers, Megatron's moe_n_hash_layers): the first
    # `hash_layers` MoE layers of the main pattern choose their experts by a fixed table of
    # the token's id (`router.tid2eid` [vocab, top_k], a buffer the checkpoint holds); the
    # learned gate still weighs them. No choice bias and no balance loss in those layers.
    hash_layers: int = 0
    # Set by the stack on the layers that route by hash (the table's rows); 0: top-k routing.
    hash_vocab_size: int = 0

    @property
    def normalizes_top_k(self) -> bool:
        return (self.score_func != "softmax" if self.norm_topk_prob is None
                else self.norm_topk_prob)


def router_scores(logits_XE: torch.Tensor, score_func: str) -> torch.Tensor:
    """Each token's score of each expert."""
    if score_func == "softmax":
        return logits_XE.softmax(dim=-1)
    if score_func == "sigmoid":
        return logits_XE.sigmoid()
    return F.softplus(logits_XE).sqrt()


def expert_weights(scores_XE: torch.Tensor, experts_XA: torch.Tensor,
                   args: MoEArgs) -> torch.Tensor:
    """The chosen experts' scores, normalised over them (normalizes_top_k) and scaled
    (routed_scaling_factor): each token's weight of each of its experts."""
    weights = scores_XE.gather(1, experts_XA)
    if args.normalizes_top_k:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + args.norm_topk_eps)
    if args.routed_scaling_factor != 1.0:
        weights = weights * args.routed_scaling_factor
    return weights


class TopKRouter(nn.Module):
    def __init__(self, *, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.num_experts, bias=False)
        self.sequence_slots = WholeSequenceSum()  # the balance loss's slot counts
        self.register_buffer("e_score_correction_bias", torch.zeros(args.num_experts)
                             if args.score_correction_bias else None)

    def _choice(self, scores_XE: torch.Tensor) -> torch.Tensor:
        """The scores the experts are chosen by: biased, and outside each token's best groups
        -inf."""
        if self.e_score_correction_bias is not None:
            scores_XE = scores_XE + self.e_score_correction_bias
        groups = self.args.n_group
        if groups == 1:
            return scores_XE
        grouped = scores_XE.view(scores_XE.shape[0], groups, -1)
        best = grouped.topk(2, dim=-1).values.sum(-1).topk(self.args.topk_group, dim=-1).indices
        kept = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~kept[..., None], float("-inf")).view_as(scores_XE)

    def forward(self, x_XD: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (weights [N, K], expert ids [N, K], slots per expert [E] (count_slots),
        load-balancing loss)."""
        # Routing in fp32: near-ties between experts flip under bf16 logits.
        logits = upcast(self.gate(x_XD))
        scores = router_scores(logits, self.args.score_func)
        experts = self._choice(scores).topk(self.args.top_k, dim=-1).indices
        weights = expert_weights(scores, experts, self.args)
        if self.args.score_func != "softmax":
            scores = scores / scores.sum(dim=-1, keepdim=True)  # the balance loss's shares
        # Switch-style balance loss: E * sum_e (share of routed slots) * (mean router score).
        # The shares are the whole sequence's; the mean is this piece's, and the loss's token
        # weighting averages it over the pieces.
        num_experts = self.args.num_experts
        slots_E = count_slots(experts, num_experts)
        sequence_slots_E = self.sequence_slots(slots_E.to(scores.dtype))
        slot_share = sequence_slots_E / sequence_slots_E.sum()
        aux_loss = num_experts * (slot_share * scores.mean(dim=0)).sum()
        return weights, experts, slots_E, aux_loss


class HashRouter(nn.Module):
    """The experts of each token from `tid2eid[token id]`, a fixed table (Megatron's
    round-robin `(id + k) mod E` at init; a checkpoint's otherwise), weighed by the learned
    gate's scores at them (normalised and scaled as TopKRouter's)."""

    def __init__(self, *, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.num_experts, bias=False)
        self.register_buffer("tid2eid", torch.empty(args.hash_vocab_size, args.top_k,
                                                    dtype=torch.int64))
        self.register_load_state_dict_post_hook(_check_loaded_table)

    def init_table(self) -> None:
        ids = torch.arange(self.tid2eid.shape[0], device=self.tid2eid.device)[:, None]
        slots = torch.arange(self.args.top_k, device=self.tid2eid.device)
        self.tid2eid.copy_((ids + slots) % self.args.num_experts)

    def forward(self, x_XD: torch.Tensor, token_ids: torch.Tensor | None):
        """As TopKRouter's forward, for the tokens `token_ids` (any shape, X of them); the
        balance loss is 0."""
        if token_ids is None:
            raise ValueError("a hash-routed MoE layer (moe.hash_layers) needs the batch's token "
                             "ids, and this forward was given none")
        scores = router_scores(upcast(self.gate(x_XD)), self.args.score_func)
        experts = self.tid2eid[token_ids.reshape(-1)]
        return (expert_weights(scores, experts, self.args), experts, count_slots(experts, self.args.num_experts),
                scores.new_zeros(()))


def _check_loaded_table(router: HashRouter, incompatible_keys) -> None:
    """A loaded table must name this layer's experts: JobError (one line) otherwise, before
    any step routes a token to an expert that does not exist."""
    table = router.tid2eid
    if table.device.type == "meta" or table.numel() == 0:
        return
    wrong = table[(table < 0) | (table >= router.args.num_experts)]
    if wrong.numel():
        raise JobError(f"moe.router.tid2eid names expert {int(wrong[0])}, but the layer has "
                       f"{router.args.num_experts} experts (ids 0 to "
                       f"{router.args.num_experts - 1}): the checkpoint's hash table does not "
                       "fit this model")


def count_slots(experts_XA: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int64 slots routed to each expert, on the device. Not torch.bincount: its output
    size depends on the largest id, which it reads back to the host on CUDA (a sync), and
    which torch.compile cannot trace (a graph break)."""
    ids = experts_XA.flatten()
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    return counts_E.scatter_add_(0, ids, torch.ones_like(ids))


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """`inverse` with inverse[order[i]] = i: where each row went (a scatter of distinct
    indices, cheaper than a second sort)."""
    positions = torch.arange(order.numel(), device=order.device)
    return torch.empty_like(order).scatter_(0, order, positions)


class _GatherRows(torch.autograd.Function):
    """x[index], where each row of x appears `repeats` times in the result, and `inverse`
    lists the result's rows grouped by the row of x they copy (index[inverse] is each row of
    x `repeats` times in a row). The backward is a gather too: grad[inverse] summed over the
    copies. Autograd's own backward of indexing scatter-adds into a zero-filled buffer of x's
    size (index_put_ with accumulate: a fill, then atomics or a sort on CUDA)."""

    @staticmethod
    def forward(ctx, x, index, inverse, repeats):
        ctx.save_for_backward(inverse)
        ctx.repeats = repeats
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        grad_x = grad.index_select(0, inverse)
        if ctx.repeats > 1:
            grad_x = grad_x.view(-1, ctx.repeats, *grad.shape[1:]).sum(1)
        return grad_x, None, None, None


def gather_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor,
                repeats: int = 1) -> torch.Tensor:
    """x[index] with a gather for a backward (see _GatherRows): `index` takes every row of x
    `repeats` times, and `inverse` orders the result's rows by the row of x they copy
    (for a permutation, repeats = 1: inverse = inverse_permutation(index))."""
    return _GatherRows.apply(x, index, inverse, repeats)


def expert_activation(h: torch.Tensor, activation: str,
                      swiglu_limit: float = 0.0) -> torch.Tensor:
    """fc1's output -> fc2's input: SwiGLU (h is [gate | up]; clamped with a limit) or
    squared ReLU."""
    if activation == "relu2":
        return F.relu(h).square()
    gate, up = h.chunk(2, dim=-1)
    return swiglu(gate, up, swiglu_limit)


def experts_loop(x_sorted_XD: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor,
                 tokens_per_expert: list[int], activation: str = "swiglu",
                 swiglu_limit: float = 0.0) -> torch.Tensor:
    """The experts one at a time: two matmuls per expert and a host sync for the split. Only
    the float64 / odd-size path (grouped_mm refuses float64, which the tests' references use,
    and widths that are not a multiple of 16 bytes), and the reference the tests and
    bench/moe_layer.py compare the grouped path with."""
    outputs = []
    for expert, x in enumerate(x_sorted_XD.split(tokens_per_expert)):
        outputs.append(expert_activation(x @ fc1[expert].t(), activation, swiglu_limit)
                       @ fc2[expert].t())
    return torch.cat(outputs)


GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The matmuls' dtype: autocast's where it is on (it casts mm but not grouped_mm), else x's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class GroupedExperts(nn.Module):
    """E experts: SwiGLU (fc1[e] holds [W_e ; V_e] like the dense MLP) or squared ReLU."""

    def __init__(self, *, dim: int, hidden_dim: int, num_experts: int,
                 activation: str = "swiglu", swiglu_limit: float = 0.0) -> None:
        super().__init__()
        gated = activation == "swiglu"
        self.fc1 = nn.Parameter(torch.empty(num_experts, (2 if gated else 1) * hidden_dim, dim))
        self.fc2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.hidden_dim, self.activation, self.swiglu_limit = hidden_dim, activation, swiglu_limit

    def tensor_parallel_layouts(self) -> dict[str, TPLayout]:
        # Each expert split like the dense MLP: hidden units ([W_local ; V_local] per rank).
        if self.activation == "relu2":
            return {"fc1": sharded(1), "fc2": sharded(2)}
        return {"fc1": sharded(1, {"_w": self.hidden_dim, "_v": self.hidden_dim}),
                "fc2": sharded(2)}

    def forward(self, x_sorted_XD: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """`x_sorted_XD`: each expert's rows in one contiguous block, expert by expert;
        `tokens_per_expert`: [E] int64 block sizes on the device (under EP, of the local
        experts: the dispatch hook replaces both arguments)."""
        dtype = _compute_dtype(x_sorted_XD)
        dim, hidden = self.fc2.shape[1:]  # local sizes (hidden is split under TP)
        if dtype not in GROUPED_MM_DTYPES or (dim * dtype.itemsize) % 16 \
                or (hidden * dtype.itemsize) % 16:
            # The float64 / odd-size path only: grouped_mm takes neither float64 nor rows
            # that are not a multiple of 16 bytes (its operands' and gradients' strides).
            return experts_loop(x_sorted_XD, self.fc1, self.fc2, tokens_per_expert.tolist(),
                                self.activation, self.swiglu_limit)
        x, fc1, fc2 = (t.to(dtype) for t in (x_sorted_XD.contiguous(), self.fc1, self.fc2))
        offs_E = tokens_per_expert.cumsum(0, dtype=torch.int32)
        # x @ fc1[e].t() for every expert's block: mat_b is fc1 seen as [E, dim, fc1 rows].
        hidden = self.grouped_mm(x, fc1.transpose(-2, -1), offs_E)
        return self.grouped_mm(expert_activation(hidden, self.activation, self.swiglu_limit),
                               fc2.transpose(-2, -1), offs_E)

    def grouped_mm(self, x: torch.Tensor, weights: torch.Tensor,
                   offs: torch.Tensor) -> torch.Tensor:
        """One of the experts' two grouped GEMMs (FP8 training extends the class with its
        float8 one: quantize/float8.py)."""
        return F.grouped_mm(x, weights, offs=offs)

    def init_weights(self, *, init_std: float, out_std: float) -> None:
        nn.init.trunc_normal_(self.fc1, std=init_std, a=-3 * init_std, b=3 * init_std)
        nn.init.trunc_normal_(self.fc2, std=out_std, a=-3 * out_std, b=3 * out_std)


class MoE(nn.Module):
    def __init__(self, *, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.router = (HashRouter(dim=dim, args=args) if args.hash_vocab_size
                       else TopKRouter(dim=dim, args=args))
        expert_dim = args.latent_dim or dim
        self.fc1_latent = nn.Linear(dim, expert_dim, bias=False) if args.latent_dim else None
        self.fc2_latent = nn.Linear(expert_dim, dim, bias=False) if args.latent_dim else None
        self.experts = GroupedExperts(dim=expert_dim, hidden_dim=args.hidden_dim,
                                      num_experts=args.num_experts, activation=args.activation,
                                      swiglu_limit=args.swiglu_limit)
        self.shared_expert = (build_mlp(MLPArgs(hidden_dim=args.shared_expert_hidden_dim,
                                                activation=args.activation,
                                                swiglu_limit=args.swiglu_limit), dim)
                              if args.shared_expert_hidden_dim > 0 else None)
        self.shared_expert_gate = (nn.Linear(dim, 1, bias=False)
                                   if args.shared_expert_gate else None)
        # Router statistics since the metrics last read them (KIND.statistics): slots
        # routed to each expert, and the summed load-balancing loss with its forward count.
        self.register_buffer("routed_tokens", torch.zeros(args.num_experts), persistent=False)
        self.register_buffer("aux_loss_sum", torch.zeros(2), persistent=False)

    @property
    def routes_by_token(self) -> bool:
        """Whether the layer needs the batch's token ids (hash routing)."""
        return isinstance(self.router, HashRouter)

    def forward(self, x_BTD: torch.Tensor,
                token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (output, this layer's load-balancing loss times its coefficient).
        `token_ids` [B, T]: the tokens' ids, which a hash-routed layer chooses experts by."""
        x_XD = x_BTD.flatten(0, 1)
        weights_XA, experts_XA, tokens_per_expert, aux_loss = (
            self.router(x_XD, token_ids) if self.routes_by_token else self.router(x_XD))
        top_k = self.args.top_k
        # Dropless dispatch: sort the X*A (token, choice) slots by expert, run each expert on
        # its contiguous block, gather each token's A outputs back and sum them weighted.
        slot_order = experts_XA.flatten().argsort(stable=True)
        slot_position = inverse_permutation(slot_order)  # slot -> its row in sorted order
        with torch.no_grad():
            self.routed_tokens += tokens_per_expert
            aux_value = aux_loss.detach().to(self.aux_loss_sum.dtype)
            self.aux_loss_sum += torch.stack((aux_value, torch.ones_like(aux_value)))
        expert_in_XD = x_XD if self.fc1_latent is None else self.fc1_latent(x_XD)
        x_sorted_XD = gather_rows(expert_in_XD, slot_order // top_k, slot_position,
                                  repeats=top_k)
        expert_out = self.experts(x_sorted_XD, tokens_per_expert)
        out_XAD = gather_rows(expert_out, slot_position, slot_order).view(*experts_XA.shape, -1)
        # Weighted sum over the A choices in fp32 (the router's weights), rounded once.
        out_XD = (upcast(out_XAD) * weights_XA.unsqueeze(-1)).sum(1).type_as(x_XD)
        if self.fc2_latent is not None:
            out_XD = self.fc2_latent(out_XD)
        if self.shared_expert is not None:
            shared_XD = self.shared_expert(x_XD)
            if self.shared_expert_gate is not None:
                shared_XD = shared_XD * torch.sigmoid(self.shared_expert_gate(x_XD))
            out_XD = out_XD + shared_XD
        return out_XD.view_as(x_BTD), aux_loss * self.args.aux_loss_coeff

    def reset_router_statistics(self) -> None:
        self.routed_tokens.zero_()
        self.aux_loss_sum.zero_()

    def init_weights(self, *, init_std: float, out_std: float) -> None:
        self.reset_router_statistics()
        init_linear(self.router.gate, std=init_std)
        if self.routes_by_token:
            self.router.init_table()
        elif self.router.e_score_correction_bias is not None:
            self.router.e_score_correction_bias.zero_()
        self.experts.init_weights(init_std=init_std, out_std=out_std)
        if self.fc1_latent is not None:
            init_linear(self.fc1_latent, std=init_std)
            init_linear(self.fc2_latent, std=out_std)
        if self.shared_expert is not None:
            self.shared_expert.init_weights(init_std=init_std, out_std=out_std)
        if self.shared_expert_gate is not None:
            init_linear(self.shared_expert_gate, std=init_std)


def _validate(args: MoEArgs, dim: int) -> None:
    if args.num_experts < 1:
        raise ValueError(f"moe: num_experts={args.num_experts} must be >= 1")
    if not 1 <= args.top_k <= args.num_experts:
        raise ValueError(f"moe: top_k={args.top_k} must be in [1, num_experts="
                         f"{args.num_experts}]")
    if args.score_func not in SCORE_FUNCTIONS:
        raise ValueError(f"moe: score_func '{args.score_func}' is not one of {SCORE_FUNCTIONS}")
    if args.swiglu_limit < 0 or (args.swiglu_limit and args.activation != "swiglu"):
        raise ValueError(f"moe: swiglu_limit={args.swiglu_limit} must be >= 0, and 0 unless "
                         "activation is 'swiglu' (0: no clamp)")
    if args.activation not in ACTIVATIONS:
        raise ValueError(f"moe: activation '{args.activation}' is not 'swiglu' or 'relu2'")
    if args.num_experts % args.n_group or not 1 <= args.topk_group <= args.n_group \
            or (args.n_group > 1 and args.num_experts // args.n_group < 2):
        raise ValueError(f"moe: n_group={args.n_group} must divide num_experts="
                         f"{args.num_experts} into groups of at least 2, and topk_group="
                         f"{args.topk_group} must be in [1, n_group]")
    if args.latent_dim < 0:
        raise ValueError(f"moe: latent_dim={args.latent_dim} must be >= 0 (0: no latent "
                         "projection)")


def _tensor_parallel_sizes(args: MoEArgs, dim: int) -> list[tuple[str, int]]:
    sizes = [("moe.hidden_dim", args.hidden_dim)]
    if args.shared_expert_hidden_dim:
        sizes.append(("moe.shared_expert_hidden_dim", args.shared_expert_hidden_dim))
    return sizes


def _inactive_params(args: MoEArgs, dim: int) -> int:
    """The routed experts a token does not visit: num_experts - top_k of them, each
    fc1 [2 * hidden, width] (squared ReLU: [hidden, width]) and fc2 [width, hidden], width
    being latent_dim or dim."""
    matrices = 2 if args.activation == "relu2" else 3
    return (args.num_experts - args.top_k) * matrices * args.hidden_dim * (args.latent_dim
                                                                          or dim)


def _router_log(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """The logged router statistics (titan_hybrid.training.metrics) from each layer's counters summed
    over the data-parallel ranks: slots an expert received over the mean per expert, worst
    layer, and the load-balancing loss before its coefficient, mean over layers."""
    counts_LE, aux_L2 = sums["routed_tokens"], sums["aux_loss_sum"]
    load_LE = counts_LE / counts_LE.mean(dim=1, keepdim=True).clamp(min=1)
    return {"moe/max_expert_load": load_LE.max().item(),
            "moe/min_expert_load": load_LE.min().item(),
            "moe/aux_loss": (aux_L2[:, 0] / aux_L2[:, 1].clamp(min=1)).mean().item()}


KIND = LayerKind(
    symbol="E", args_type=MoEArgs,
    build=lambda args, dim, norm_eps: MoE(dim=dim, args=args),
    has_aux_loss=True, validate=_validate,
    tensor_parallel_sizes=_tensor_parallel_sizes,
    # The experts run eagerly under EP (their dispatch reads the token counts on the host) and
    # in fp32 (grouped_mm's tracing kernel takes bf16 only); otherwise the layer is one graph.
    compiled_parts=("router", "shared_expert", "shared_expert_gate"), one_graph_in_bf16=True,
    routed_experts="experts", inactive_params=_inactive_params,
    high_precision_modules=("router", "shared_expert_gate"),
    # Nemotron 3's MoE layers (squared-ReLU experts, the biased sigmoid router): checked by
    # hf/nemotron_h.py.
    # Counts describe the global batch of each layer: summed over the data-parallel ranks.
    statistics=KindStatistics(counters=("routed_tokens", "aux_loss_sum"), summed_over=(DATA,),
                              per_layer=True, log=_router_log),
)

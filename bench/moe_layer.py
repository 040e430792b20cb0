"""One MoE layer's forward + backward on CPU: the grouped-GEMM experts vs the per-expert loop.

    .venv/bin/python bench/moe_layer.py [--experts 4 16] [--tokens 4096] [--dim 256]
        [--hidden 512] [--top-k 2] [--repeats 3] [--threads N]

Baseline: `moe_forward_loop`, the MoE forward as it was before grouped GEMM (issue 23): counts
read back to the host (`.tolist()`), two matmuls per expert, and a combine that scatter-adds into
a zero-filled buffer (index_add_). It runs on the same module, weights and input as
`MoE.forward`, in the same process; the rounds alternate which one goes first, and the median
of `--repeats` rounds is printed with the ratio. Also printed: the matmul ops one forward +
backward dispatches (`matmul_op_count`; on CUDA each is one kernel, grouped GEMM included).
fp32, no shared expert (it is the same dense MLP on both paths).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from titan_hybrid.model.common import upcast
from titan_hybrid.model.moe import MoE, MoEArgs, experts_loop

# The matmul family as the profiler names it; nested ones (linear -> matmul -> mm, or the mm
# loop inside torch's CPU grouped_mm) are one dispatch: only the outermost is counted.
MATMUL_OPS = frozenset({"aten::mm", "aten::bmm", "aten::_grouped_mm", "aten::matmul",
                        "aten::addmm", "aten::linear", "aten::baddbmm", "aten::addbmm",
                        "aten::mv", "aten::dot"})


def moe_forward_loop(moe: MoE, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe`'s forward as it was before grouped GEMM (without the router statistics)."""
    x_XD = x_BTD.flatten(0, 1)
    weights_XA, experts_XA, _, aux_loss = moe.router(x_XD)
    slot_order = experts_XA.flatten().argsort(stable=True)
    token_of_slot = slot_order // moe.args.top_k
    tokens_per_expert = torch.bincount(experts_XA.flatten(), minlength=moe.args.num_experts)
    expert_out = experts_loop(x_XD[token_of_slot], moe.experts.fc1, moe.experts.fc2,
                              tokens_per_expert.tolist())
    slot_weights = weights_XA.flatten()[slot_order].unsqueeze(-1)
    out_XD = torch.zeros_like(x_XD).index_add_(
        0, token_of_slot, (upcast(expert_out) * slot_weights).type_as(x_XD))
    if moe.shared_expert is not None:
        out_XD = out_XD + moe.shared_expert(x_XD)
    return out_XD.view_as(x_BTD), aux_loss * moe.args.aux_loss_coeff


def build_moe(*, dim: int, hidden: int, experts: int, top_k: int, shared: int = 0,
              seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    args = MoEArgs(num_experts=experts, top_k=top_k, hidden_dim=hidden,
                   shared_expert_hidden_dim=shared)
    moe = MoE(dim=dim, args=args)
    moe.init_weights(init_std=0.02, out_std=0.02)
    return moe


def forward_backward(forward: Callable, moe: MoE, x_BTD: torch.Tensor) -> None:
    """One forward + backward of a loss on the output and the load-balancing loss."""
    out, aux = forward(moe, x_BTD)
    (out.square().mean() + aux).backward()


def matmul_op_count(forward: Callable, moe: MoE, x_BTD: torch.Tensor) -> int:
    """Outermost matmul-family ops in one forward + backward (see MATMUL_OPS)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        forward_backward(forward, moe, x_BTD)
    count = 0
    for event in prof.events():
        parent = event.cpu_parent
        while parent is not None and parent.name not in MATMUL_OPS:
            parent = parent.cpu_parent
        count += event.name in MATMUL_OPS and parent is None
    return count


def _seconds(forward: Callable, moe: MoE, x_BTD: torch.Tensor) -> float:
    moe.zero_grad(set_to_none=True)
    x_BTD.grad = None
    start = time.perf_counter()
    forward_backward(forward, moe, x_BTD)
    return time.perf_counter() - start


def compare(*, experts: int, tokens: int, dim: int, hidden: int, top_k: int,
            repeats: int) -> dict:
    moe = build_moe(dim=dim, hidden=hidden, experts=experts, top_k=top_k)
    x_BTD = torch.randn(1, tokens, dim, generator=torch.Generator().manual_seed(1))
    x_BTD.requires_grad_()  # a layer's input inside a model: its gradient is computed too
    paths = {"grouped": MoE.forward, "loop": moe_forward_loop}
    for forward in paths.values():  # warm-up
        _seconds(forward, moe, x_BTD)
    times: dict[str, list[float]] = {name: [] for name in paths}
    for round_ in range(repeats):
        for name in (list(paths) if round_ % 2 == 0 else list(paths)[::-1]):
            times[name].append(_seconds(paths[name], moe, x_BTD))
    row = {f"{name}_ms": 1e3 * statistics.median(values) for name, values in times.items()}
    row.update({f"{name}_matmuls": matmul_op_count(forward, moe, x_BTD)
                for name, forward in paths.items()})
    return {"experts": experts, **row, "grouped_over_loop": row["grouped_ms"] / row["loop_ms"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    options = parser.parse_args(argv)
    torch.set_num_threads(options.threads)
    print(f"MoE layer fwd+bwd, CPU fp32, {options.threads} threads: {options.tokens} tokens, "
          f"dim {options.dim}, hidden {options.hidden}, top-{options.top_k}; "
          f"median of {options.repeats}")
    print("experts | grouped ms | loop ms | grouped / loop | matmul ops grouped | loop")
    for experts in options.experts:
        row = compare(experts=experts, tokens=options.tokens, dim=options.dim,
                      hidden=options.hidden, top_k=options.top_k, repeats=options.repeats)
        print(f"{experts} | {row['grouped_ms']:.1f} | {row['loop_ms']:.1f} | "
              f"{row['grouped_over_loop']:.3f} | {row['grouped_matmuls']} | "
              f"{row['loop_matmuls']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Kernels per Mamba2 layer, by causal-conv path (issue 46, item 2), counted by the profiler:

    python bench/conv_kernels.py [--flavor debug] [--batch 2] [--seq-len 256]

Baseline: the conv on its torch path (`causal_depthwise_conv1d_torch`: pad, depthwise conv,
SiLU, and their backwards), eager and compiled. Against it, our Triton conv
(titan_hybrid/ops/conv_triton.py), eager and with the rest of the layer compiled. Each row runs
forward + backward of the conv alone and of the whole Mamba2 mixer (packed documents, so the
conv masks at document starts, as the trainer's packed batches do), in float32.

Counted, in one profile of one warm call: ATen calls that do work (leaf calls, without views,
allocations and metadata ops), the kernels inductor generated (`torch.compile(fullgraph=True)`
as the trainer compiles each layer; on CPU inductor writes C++ kernels, on a GPU Triton ones,
fused the same way), and Triton launches. On a machine without CUDA the Triton kernels run in
Triton's interpreter (TRITON_INTERPRET=1, set here before triton is imported) and the SSD scan
takes its torch path, whose own ATen calls are in the layer's count in every row alike.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

REPO_ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO_ROOT))

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch._inductor.config as inductor_config  # noqa: E402  (a bench: names its knob)

from titan_hybrid.model.args import hybrid_flavors  # noqa: E402
from titan_hybrid.model.layout import TokenLayout  # noqa: E402
from titan_hybrid.model.mamba import ConvAndScan, Mamba2Mixer  # noqa: E402
from titan_hybrid.ops import conv_triton  # noqa: E402
from titan_hybrid.ops.conv import causal_depthwise_conv1d_torch  # noqa: E402

# ATen calls that move no data: views, allocations, metadata, no-op conversions (a leaf
# `aten::to` is one: a real conversion shows as its `aten::copy_`).
NOT_KERNELS = {
    "aten::to", "aten::resolve_conj", "aten::resolve_neg", "aten::promote_types",
    "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::_unsafe_view", "aten::as_strided",
    "aten::transpose", "aten::t", "aten::permute", "aten::expand", "aten::squeeze",
    "aten::unsqueeze", "aten::slice", "aten::select", "aten::split", "aten::split_with_sizes",
    "aten::unbind", "aten::unflatten", "aten::flatten", "aten::detach", "aten::alias",
    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::resize_",
    "aten::set_", "aten::lift_fresh", "aten::view_as", "aten::narrow", "aten::chunk",
    "aten::result_type", "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense",
    "aten::new_empty_strided", "aten::movedim", "aten::_has_compatible_shallow_copy_type",
}
TRITON_KERNELS = (conv_triton._conv_fwd_kernel, conv_triton._conv_bwd_kernel)


def _counted_launches(stack: ExitStack) -> None:
    """Each of our Triton kernels' launches opens a profiler range `triton::NAME`: counted as
    one kernel, and what the interpreter does inside it is not counted."""
    for kernel in TRITON_KERNELS:
        name, run = kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel), kernel.run

        def launch(*args, _name=name, _run=run, **kwargs):
            with torch.profiler.record_function(f"triton::{_name}"):
                return _run(*args, **kwargs)

        stack.enter_context(mock.patch.object(kernel, "run", launch))


def _under_triton(event) -> bool:
    while event is not None:
        if event.name.startswith("triton::"):
            return True
        event = event.cpu_parent
    return False


def count_kernels(call) -> dict[str, int]:
    """{aten, inductor, triton} kernel counts of one `call()` (after a warm-up call)."""
    with ExitStack() as stack:
        _counted_launches(stack)
        call()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            call()
    events = list(prof.events())
    children = {id(event.cpu_parent) for event in events if event.cpu_parent is not None}
    counts = {"aten": 0, "inductor": 0, "triton": 0}
    for event in events:
        if event.name.startswith("triton::"):
            counts["triton"] += 1
        elif event.name.startswith("graph_") and "_cpp_fused" in event.name \
                or event.name.startswith("triton_"):
            counts["inductor"] += 1
        elif event.name.startswith("aten::") and id(event) not in children \
                and event.name not in NOT_KERNELS and not _under_triton(event):
            counts["aten"] += 1
    counts["total"] = sum(counts.values())
    return counts


def _triton_conv(self, xbc, weight, bias, seq_idx, initial_states=None, initial_seq_idx=None):
    return conv_triton.causal_depthwise_conv1d_triton(
        xbc, weight, bias, seq_idx=seq_idx, activation="silu", initial_states=initial_states,
        initial_seq_idx=initial_seq_idx)


def _torch_conv(self, xbc, weight, bias, seq_idx, initial_states=None, initial_seq_idx=None):
    return causal_depthwise_conv1d_torch(xbc, weight, bias, seq_idx=seq_idx, activation="silu",
                                         initial_states=initial_states,
                                         initial_seq_idx=initial_seq_idx)


def _backward(out: torch.Tensor, leaves: list[torch.Tensor]) -> None:
    """out's backward with a fixed cotangent, each gradient stored fresh (no accumulation)."""
    for leaf in leaves:
        leaf.grad = None
    out.backward(torch.ones_like(out))


def measure(flavor: str, batch: int, seq_len: int, compiled_rows: bool = True) -> list[dict]:
    model_args = hybrid_flavors[flavor]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    mixer = Mamba2Mixer(dim=model_args.dim, args=model_args.mamba,
                        norm_eps=model_args.norm_eps).to(device)
    with torch.no_grad():
        mixer.init_weights(init_std=0.02, out_std=0.02)
    x = torch.randn(batch, seq_len, model_args.dim, device=device, requires_grad=True)
    seq_idx = (torch.arange(seq_len, device=device) >= seq_len // 3).int().expand(batch, -1)
    layout = TokenLayout(positions=None, seq_idx=seq_idx)
    channels = mixer.conv1d.weight.shape[0]
    xbc = torch.randn(batch, seq_len, channels, device=device, requires_grad=True)
    weight, bias = mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias
    leaves = [x, xbc, *mixer.parameters()]
    rows = []
    for conv_name, conv in (("torch path", _torch_conv), ("our Triton conv", _triton_conv)):
        for compiled in (False, True) if compiled_rows else (False,):
            def conv_step(conv=conv, compiled=compiled):
                run = torch.compile(conv, fullgraph=True) if compiled else conv
                return lambda: _backward(run(None, xbc, weight, bias, seq_idx), leaves)

            def layer_step(compiled=compiled):
                run = torch.compile(mixer, fullgraph=True) if compiled else mixer
                return lambda: _backward(run(x, layout), leaves)

            with mock.patch.object(ConvAndScan, "conv", conv), \
                    inductor_config.patch({"cpp.enable_kernel_profile": True}):
                torch._dynamo.reset()
                conv_counts = count_kernels(conv_step())
                torch._dynamo.reset()
                layer_counts = count_kernels(layer_step())
            rows.append({"path": f"{conv_name}, {'compiled' if compiled else 'eager'}",
                         "conv": conv_counts, "layer": layer_counts})
    return rows


def report(rows: list[dict], flavor: str, batch: int, seq_len: int) -> list[str]:
    lines = [f"kernels per forward + backward, {flavor} Mamba2 dims, batch {batch} x {seq_len}, "
             "packed documents (ATen + inductor + Triton = total)",
             f"{'conv path':<28} {'conv alone':>22} {'Mamba2 layer':>24}"]
    first = rows[0]
    for row in rows:
        cells = []
        for part in ("conv", "layer"):
            c = row[part]
            cells.append(f"{c['aten']}+{c['inductor']}+{c['triton']}={c['total']}")
        lines.append(f"{row['path']:<28} {cells[0]:>22} {cells[1]:>24}  "
                     f"(x{row['conv']['total'] / first['conv']['total']:.2f} conv, "
                     f"x{row['layer']['total'] / first['layer']['total']:.2f} layer "
                     "vs torch path eager)")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debug")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args(argv)
    rows = measure(args.flavor, args.batch, args.seq_len)
    print("\n".join(report(rows, args.flavor, args.batch, args.seq_len)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

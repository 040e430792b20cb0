"""Our Mamba2 mixer against mamba_ssm's fused path, the layer Megatron runs (issue 46, item 8):

    python bench/mamba_layer.py [--flavor nemotron_h_1b] [--batch 2] [--seq-len 4096]
        [--repeats 10]

Baseline: `mamba_split_conv1d_scan_combined` (causal-conv1d's conv, mamba_ssm's SSD scan, gated
RMS norm and out_proj in one autograd function, with its backward recomputing the conv and the
norm), called as mamba_ssm's `Mamba2` calls it on its memory-efficient path, with our mixer's
own in_proj / conv / A_log / D / dt_bias / norm / out_proj weights: in_proj, then the fused
function. Ours: `Mamba2Mixer.forward`, eager and compiled (`torch.compile(fullgraph=True)`, as the
trainer compiles each layer).

Both under bf16 autocast with float32 parameters, as the one-process trainer runs them; forward +
backward of sum(out * cotangent), median of --repeats after two warm-up rounds, rounds
alternating. Prints ms per layer, each row's ratio to the baseline, and the largest relative
difference of the output and input gradient from the baseline's. On a machine without CUDA (or
without causal-conv1d) the baseline is skipped and ours runs alone (a smoke run).

"ours" on CUDA is Mamba2's fused core (titan_hybrid/ops/mamba_core.py: conv, SSD and gated
norm as one op pair, gradients written in place; its conv is causal-conv1d's where installed).
It also runs compiled with each causal-conv path in turn (issue 46, items 2 and 3): the fused
core with our Triton conv (titan_hybrid/ops/conv_triton.py), and the ops one by one, as before
the fused core, with causal-conv1d's kernel, our Triton kernel, the torch path as it runs
without documents (a cuDNN depthwise conv), and the torch path's shifted-sum formulation (what
it runs with documents; here with one document per row), which inductor fuses with the layer's
other elementwise work.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

REPO_ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO_ROOT))

import torch

from titan_hybrid.model import mamba as mamba_model
from titan_hybrid.model.args import hybrid_flavors
from titan_hybrid.model.mamba import ConvAndScan, Mamba2Mixer
from titan_hybrid.ops import conv as conv_ops
from titan_hybrid.ops import mamba_core


def _conv_path(path: str):
    """ConvAndScan.conv on one causal-conv path (the module docstring's list)."""
    def conv(self, xbc, weight, bias, seq_idx, initial_states=None, initial_seq_idx=None):
        if path == "causal-conv1d":
            return conv_ops.causal_depthwise_conv1d(xbc, weight, bias, activation="silu")
        if path == "Triton":
            return conv_ops.causal_depthwise_conv1d_triton(xbc, weight, bias, activation="silu")
        one_document = (xbc.new_zeros(xbc.shape[:2], dtype=torch.int32)
                        if path == "shifted sum" else None)
        return conv_ops.causal_depthwise_conv1d_torch(xbc, weight, bias, seq_idx=one_document,
                                                      activation="silu")
    return conv


def _with_conv_path(function, path: str, fused_core: bool):
    """`function` with the conv on `path`: inside Mamba2's fused core (titan_hybrid.ops.
    mamba_core: causal-conv1d's or our Triton kernel), or with the ops one by one."""
    def run(x):
        with contextlib.ExitStack() as stack:
            if fused_core:
                stack.enter_context(mock.patch.object(
                    mamba_core, "_uses_causal_conv1d", lambda *args: path == "causal-conv1d"))
            else:
                stack.enter_context(mock.patch.object(mamba_model, "mamba2_core_runs",
                                                      lambda *args: False))
                stack.enter_context(mock.patch.object(ConvAndScan, "conv", _conv_path(path)))
            return function(x)
    return run


def fused_baseline(mixer: Mamba2Mixer):
    """mixer's computation through mamba_ssm's fused path, or None (and why) where it cannot
    run: it needs CUDA and causal-conv1d's extension."""
    if not torch.cuda.is_available():
        return None, "no CUDA device"
    try:
        import causal_conv1d  # noqa: F401  (the fused path calls its extension)
        from mamba_ssm.ops.triton.ssd_combined import mamba_split_conv1d_scan_combined
    except ImportError as error:
        return None, f"mamba_ssm's fused path does not import ({error})"
    args = mixer.args

    def forward(x):
        return mamba_split_conv1d_scan_combined(
            mixer.in_proj(x), mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, mixer.dt_bias,
            -torch.exp(mixer.A_log.float()), mixer.D, args.chunk_size, dt_limit=args.dt_limit,
            activation="silu", rmsnorm_weight=mixer.norm.weight, rmsnorm_eps=mixer.norm.eps,
            outproj_weight=mixer.out_proj.weight, headdim=args.head_dim, ngroups=args.n_groups,
            norm_before_gate=False)

    return forward, None


def timed(function, x, cotangent) -> tuple[float, torch.Tensor, torch.Tensor]:
    """ms of forward + backward, the output and the input gradient."""
    x = x.detach().requires_grad_()
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        out = function(x)
    (out.float() * cotangent).sum().backward()
    sync()
    return (time.perf_counter() - start) * 1e3, out.detach().float(), x.grad.float()


def compare(flavor: str, batch: int, seq_len: int, repeats: int, dim: int | None = None,
            compiled: bool = True) -> dict:
    """{row name: {ms, ratio, err_out, err_grad}} and the baseline's skip reason, if any."""
    model_args = hybrid_flavors[flavor]
    dim = dim or model_args.dim
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    mixer = Mamba2Mixer(dim=dim, args=model_args.mamba, norm_eps=model_args.norm_eps).to(device)
    with torch.no_grad():
        mixer.init_weights(init_std=0.02, out_std=0.02)
    rows = {"ours (eager)": mixer}
    if compiled:
        rows["ours (compiled)"] = torch.compile(mixer.forward, fullgraph=True)
    if compiled and device == "cuda":
        with_causal_conv1d = conv_ops.use_kernel(torch.empty(0, device=device), "causal_conv1d")
        rows["ours (compiled), fused core, conv: Triton"] = _with_conv_path(
            torch.compile(mixer.forward, fullgraph=True), "Triton", fused_core=True)
        paths = ["Triton", "torch (cuDNN)", "shifted sum"]
        if with_causal_conv1d:
            paths.insert(0, "causal-conv1d")
        for path in paths:
            rows[f"ours (compiled), ops one by one, conv: {path}"] = _with_conv_path(
                torch.compile(mixer.forward, fullgraph=True), path, fused_core=False)
    baseline, skipped = fused_baseline(mixer)
    if baseline is not None:
        rows = {"mamba_ssm fused (Megatron's path)": baseline, **rows}
    x = torch.randn(batch, seq_len, dim, device=device)
    cotangent = torch.randn(batch, seq_len, dim, device=device)
    times = {name: [] for name in rows}
    results = {}
    for round_ in range(repeats + 2):
        order = list(rows.items()) if round_ % 2 == 0 else list(rows.items())[::-1]
        for name, function in order:
            mixer.zero_grad(set_to_none=True)
            ms, out, grad = timed(function, x, cotangent)
            if round_ >= 2:
                times[name].append(ms)
            results[name] = (out, grad)
    reference = next(iter(results.values()))
    report = {}
    for name in rows:
        out, grad = results[name]
        ms = statistics.median(times[name])
        report[name] = {
            "ms": ms,
            "err_out": ((out - reference[0]).abs().max() / reference[0].abs().max()).item(),
            "err_grad": ((grad - reference[1]).abs().max() / reference[1].abs().max()).item()}
    first_ms = next(iter(report.values()))["ms"]
    for entry in report.values():
        entry["ratio"] = entry["ms"] / first_ms
    return {"rows": report, "baseline_skipped": skipped, "device": device}


def report(result: dict, flavor: str, batch: int, seq_len: int, repeats: int) -> list[str]:
    lines = [f"Mamba2 layer, {flavor} dims, batch {batch} x {seq_len}, bf16 autocast, forward + "
             f"backward, median of {repeats}, on {result['device']}"]
    if result["baseline_skipped"]:
        lines.append(f"baseline skipped: {result['baseline_skipped']}")
    lines.append(f"{'path':<44} {'ms':>8} {'/ first':>8} {'max rel diff out':>17} {'grad':>9}")
    for name, entry in result["rows"].items():
        lines.append(f"{name:<44} {entry['ms']:>8.2f} {entry['ratio']:>8.2f} "
                     f"{entry['err_out']:>17.2e} {entry['err_grad']:>9.2e}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="nemotron_h_1b")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dim", type=int, help="default: the flavor's")
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args(argv)
    result = compare(args.flavor, args.batch, args.seq_len, args.repeats, args.dim,
                     compiled=not args.no_compile)
    print("\n".join(report(result, args.flavor, args.batch, args.seq_len, args.repeats)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The kernel half of bench/gpu_check.py: one shape per kernel and dtype on CUDA, through our ops.

Each case calls an op's public function on CUDA tensors (where it takes the kernel) and its torch
path on the same inputs, and compares the outputs and the gradients of every floating-point input
(relative Frobenius error, tolerances as in the triton_interpreter tests: float32 dots run in tf32
on the GPU). The shapes are the GPU flavors' (head dim 64, state 128, chunks of 128 for the SSD
scan; 128-dim gated-delta and KDA heads; 512-channel norm groups), small in batch and length.

Autotuning, the cost of a cold start: a forward + backward of the SSD scan autotunes 14 of
mamba_ssm's kernels over 110 configs (6 to 11 each), every config compiled and timed: the ~100 s
first step on a cold TRITON_CACHE_DIR. fla's gated delta rule autotunes 11 kernels over 106
configs (its l2norm kernels 25 each). mamba_ssm's gated RMS norm has fixed configs and
causal-conv1d is CUDA C++. Here every autotuned kernel compiles and runs only one config left
after its own pruning, the smallest-tiled (`one_config_only`): configs differ in tiling, not in the math,
and the trainer's runs that follow use the tuned ones. (Counts from Triton's interpreter.)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import torch
import torch.nn.functional as F

from titan_hybrid.model.layout import TokenLayout
from titan_hybrid.model.mamba3 import Mamba3Args, Mamba3Core, Mamba3Mixer
from titan_hybrid.ops.conv import causal_depthwise_conv1d, causal_depthwise_conv1d_torch
from titan_hybrid.ops.conv_triton import causal_depthwise_conv1d_triton
from titan_hybrid.ops.gated_delta import chunk_gated_delta_rule, chunk_gated_delta_rule_torch
from titan_hybrid.ops.gated_norm import gated_group_rms_norm, gated_group_rms_norm_torch
from titan_hybrid.ops.gdn2 import chunk_gdn2, chunk_gdn2_torch
from titan_hybrid.ops.kda import chunk_kda, chunk_kda_torch
from titan_hybrid.ops.kernels import force_kernels, kernel_op_refused, probe_kernels
from titan_hybrid.ops.selective_scan import selective_scan_torch
from titan_hybrid.ops.selective_scan_triton import selective_scan_triton
from titan_hybrid.ops.ssd import mamba_chunk_scan_combined, ssd_chunked_torch

TF32 = {torch.float32: 5e-3, torch.bfloat16: 5e-2}  # tf32 / bf16 dots in the kernel
EXACT = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # float32 arithmetic in the kernel
DEVICE = "cuda"


@dataclass(frozen=True)
class Case:
    name: str
    package: str  # titan_hybrid.ops.kernels.KERNEL_PACKAGES
    op: Callable
    torch_op: Callable
    inputs: Callable[[torch.dtype, torch.Generator], tuple[dict, dict]]  # tensors, options
    custom_ops: tuple[str, ...]  # titan_hybrid::... ops that prove the kernel ran
    tol: dict


def _rand(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


def _ssd(dtype, gen):  # the Mamba2 mixer's call: D [h], dt_bias, documents, no z
    b, t, h, p, g, n = 1, 320, 4, 64, 2, 128
    seq_idx = torch.zeros(b, t, dtype=torch.int32, device=DEVICE)
    seq_idx[:, 200:] = 1  # a document boundary inside the second chunk
    return (dict(x=_rand(gen, b, t, h, p, dtype=dtype), dt=_rand(gen, b, t, h, scale=0.5) - 1,
                 A=-torch.exp(_rand(gen, h, scale=0.5)), B=_rand(gen, b, t, g, n, dtype=dtype,
                 scale=0.5), C=_rand(gen, b, t, g, n, dtype=dtype, scale=0.5),
                 D=_rand(gen, h), dt_bias=_rand(gen, h, scale=0.5)),
            dict(chunk_size=128, seq_idx=seq_idx, dt_softplus=True))


def _norm(dtype, gen):
    yz = _rand(gen, 2, 100, 2048, dtype=dtype)
    return dict(y=yz[..., :1024], z=yz[..., 1024:], weight=_rand(gen, 1024) * 0.1 + 1), \
        dict(group_size=512, eps=1e-5)


def _gdn(dtype, gen):  # the GDN mixer's call: seq_idx, l2norm of q and k in the kernel
    b, t, h, d = 2, 200, 2, 128
    seq_idx = torch.zeros(b, t, dtype=torch.int32, device=DEVICE)
    seq_idx[0, 90:] = 1  # row 0: two documents, row 1: one
    return (dict(q=_rand(gen, b, t, h, d, dtype=dtype), k=_rand(gen, b, t, h, d, dtype=dtype),
                 v=_rand(gen, b, t, h, d, dtype=dtype),
                 g=-F.softplus(_rand(gen, b, t, h)),
                 beta=torch.sigmoid(_rand(gen, b, t, h)).to(dtype)),
            dict(seq_idx=seq_idx, use_qk_l2norm_in_kernel=True))


def _kda(dtype, gen):  # the KDA mixer's call: a log-decay per key channel in float32
    b, t, h, d = 2, 200, 2, 128
    seq_idx = torch.zeros(b, t, dtype=torch.int32, device=DEVICE)
    seq_idx[0, 90:] = 1
    return (dict(q=_rand(gen, b, t, h, d, dtype=dtype), k=_rand(gen, b, t, h, d, dtype=dtype),
                 v=_rand(gen, b, t, h, d, dtype=dtype),
                 g=-F.softplus(_rand(gen, b, t, h, d)),
                 beta=torch.sigmoid(_rand(gen, b, t, h))),
            dict(seq_idx=seq_idx, use_qk_l2norm_in_kernel=True))


def _gdn2(dtype, gen):  # the GDN2 mixer's call: a decay and an erase gate per key channel,
    b, t, h, d = 2, 200, 2, 128  # a write gate per value channel
    seq_idx = torch.zeros(b, t, dtype=torch.int32, device=DEVICE)
    seq_idx[0, 90:] = 1
    return (dict(q=_rand(gen, b, t, h, d, dtype=dtype), k=_rand(gen, b, t, h, d, dtype=dtype),
                 v=_rand(gen, b, t, h, d, dtype=dtype),
                 g=-F.softplus(_rand(gen, b, t, h, d)),
                 b=torch.sigmoid(_rand(gen, b, t, h, d)).to(dtype),
                 w=torch.sigmoid(_rand(gen, b, t, h, d)).to(dtype)),
            dict(seq_idx=seq_idx, use_qk_l2norm_in_kernel=True))


def _conv(dtype, gen):  # width 4, 8-aligned channels: the shapes the CUDA kernel takes
    seq_idx = torch.zeros(2, 100, dtype=torch.int32, device=DEVICE)
    seq_idx[:, 60:] = 1
    return dict(x_BTC=_rand(gen, 2, 100, 256, dtype=dtype), weight_CW=_rand(gen, 256, 4),
                bias_C=_rand(gen, 256)), dict(seq_idx=seq_idx, activation="silu")


def _selective_scan(dtype, gen):  # jamba_hybrid_2b's Mamba1 at 512 channels: state 16, documents
    b, t, d, n = 2, 200, 512, 16
    seq_idx = torch.zeros(b, t, dtype=torch.int32, device=DEVICE)
    seq_idx[:, 130:] = 1
    return (dict(u_BTD=_rand(gen, b, t, d, dtype=dtype), dt_BTD=_rand(gen, b, t, d, dtype=dtype),
                 A_DN=-torch.exp(_rand(gen, d, n, scale=0.5)),
                 B_BTN=_rand(gen, b, t, n, dtype=dtype), C_BTN=_rand(gen, b, t, n, dtype=dtype),
                 D=_rand(gen, d), z_BTD=_rand(gen, b, t, d, dtype=dtype),
                 dt_bias=_rand(gen, d, scale=0.5), initial_state=_rand(gen, b, d, n)),
            dict(seq_idx=seq_idx, dt_softplus=True, return_final_state=True))


def _mamba3_layer(dtype, gen, **options):  # mamba3_hybrid_1b's Mamba-3 layer, 512 wide
    torch.manual_seed(0)
    mixer = Mamba3Mixer(dim=512, args=Mamba3Args(**options)).to(DEVICE)
    mixer.init_weights(init_std=0.02, out_std=0.02)
    seq_idx = torch.zeros(2, 200, dtype=torch.int32, device=DEVICE)
    seq_idx[:, 130:] = 1
    return (dict(u_BTD=_rand(gen, 2, 200, 512, dtype=dtype)),
            dict(mixer=mixer.to(dtype), layout=TokenLayout(positions=None, seq_idx=seq_idx)))


def _mamba3_mimo_layer(dtype, gen):  # the same with MIMO of rank 4 (kernel chunks of 16)
    return _mamba3_layer(dtype, gen, mimo=True, mimo_rank=4)


def _mamba3_kernel_path(u_BTD, mixer, layout):
    return mixer(u_BTD, layout)


def _mamba3_torch_path(u_BTD, mixer, layout):
    with mock.patch.object(Mamba3Core, "runs_kernel", lambda self, x: False):
        return mixer(u_BTD, layout)


CASES = (
    Case("SSD scan", "mamba_ssm", mamba_chunk_scan_combined, ssd_chunked_torch, _ssd,
         ("mamba_ssd_fwd", "mamba_ssd_bwd"), TF32),
    Case("gated RMS norm", "mamba_ssm", gated_group_rms_norm, gated_group_rms_norm_torch, _norm,
         ("gated_rms_norm_fwd", "gated_rms_norm_bwd"), EXACT),
    Case("gated delta rule", "fla", chunk_gated_delta_rule, chunk_gated_delta_rule_torch, _gdn,
         ("fla_gated_delta_fwd", "fla_gated_delta_bwd"), TF32),
    Case("Kimi delta attention", "fla", chunk_kda, chunk_kda_torch, _kda,
         ("fla_kda_fwd", "fla_kda_bwd"), TF32),
    Case("gated DeltaNet-2", "fla", chunk_gdn2, chunk_gdn2_torch, _gdn2,
         ("fla_gdn2_fwd", "fla_gdn2_bwd"), TF32),
    # the torch path computes in bfloat16 for bfloat16 inputs, the kernel in float32
    Case("causal conv1d", "causal_conv1d", causal_depthwise_conv1d, causal_depthwise_conv1d_torch,
         _conv, ("causal_conv1d_fwd", "causal_conv1d_bwd"),
         {torch.float32: 1e-5, torch.bfloat16: 5e-2}),
    # ours (titan_hybrid/ops/conv_triton.py): needs only triton, so "package" is torch's own
    Case("causal conv1d, our Triton kernel", "triton", causal_depthwise_conv1d_triton,
         causal_depthwise_conv1d_torch, _conv,
         ("triton_causal_conv1d_fwd", "triton_causal_conv1d_bwd"),
         {torch.float32: 1e-5, torch.bfloat16: 5e-2}),
    # ours (titan_hybrid/ops/selective_scan_triton.py): float32 in registers on both paths
    Case("selective scan (Mamba1), our Triton kernel", "triton", selective_scan_triton,
         selective_scan_torch, _selective_scan,
         ("triton_selective_scan_fwd", "triton_selective_scan_bwd"),
         {torch.float32: 1e-4, torch.bfloat16: 2e-2}),
    # the whole layer, its input's gradient through every kernel step: mamba_ssm's SISO kernels
    # take q, k, x, z and the angles in bfloat16 whatever the layer's dtype (as its module does)
    Case("Mamba-3 SISO layer (mamba_ssm's kernels)", "mamba_ssm", _mamba3_kernel_path,
         _mamba3_torch_path, _mamba3_layer, ("mamba3_siso_fwd", "mamba3_siso_bwd"),
         {torch.float32: 3e-2, torch.bfloat16: 5e-2}),
    # ... and its MIMO TileLang kernels (tilelang installed), bfloat16 inside the same way
    Case("Mamba-3 MIMO layer (mamba_ssm's TileLang kernels)", "tilelang", _mamba3_kernel_path,
         _mamba3_torch_path, _mamba3_mimo_layer, ("mamba3_mimo_fwd", "mamba3_mimo_bwd"),
         {torch.float32: 3e-2, torch.bfloat16: 5e-2}),
)


def smallest_tile(configs: list) -> list:
    """The config with the smallest tiles (the product of its integer meta-parameters, then
    num_stages, then its place in the list), as a one-element list. Not the first config: an
    H100 refuses mamba_ssm's first SSD config (OutOfResources, 296 KB of shared memory against
    227 KB), and the smallest tiles fit every GPU the kernels support."""
    def footprint(indexed):
        index, config = indexed
        size = 1
        for value in config.kwargs.values():
            if isinstance(value, int) and not isinstance(value, bool):
                size *= value
        return size, config.num_stages, index
    return [min(enumerate(configs), key=footprint)[1]] if configs else configs


@contextlib.contextmanager
def one_config_only():
    """Every Triton autotuner in this process runs only the smallest-tiled config its pruning
    keeps (`smallest_tile`)."""
    from triton.runtime.autotuner import Autotuner

    prune = Autotuner.prune_configs
    with mock.patch.object(Autotuner, "prune_configs",
                           lambda self, kwargs: smallest_tile(prune(self, kwargs))):
        yield


def outputs_and_grads(fn, tensors: dict, options: dict):
    """fn's tensor outputs and the gradients of a fixed random projection of them with respect
    to every floating-point input."""
    leaves = {k: v.detach().clone().requires_grad_(v.is_floating_point())
              for k, v in tensors.items()}
    result = fn(**leaves, **options)
    outs = [o for o in (result if isinstance(result, tuple) else (result,)) if o is not None]
    gen = torch.Generator().manual_seed(1234)
    loss = sum((o.float() * torch.randn(o.shape, generator=gen).to(o.device)).sum() for o in outs)
    names = [k for k, v in leaves.items() if v.requires_grad]
    grads = torch.autograd.grad(loss, [leaves[k] for k in names])
    return [o.detach() for o in outs] + list(grads), ["output"] * len(outs) + names


def check(case: Case, dtype: torch.dtype, compile_: bool = False) -> float:
    """The largest relative error of the kernel path against the torch path; AssertionError
    when it is above the case's tolerance or the kernel did not run."""
    tensors, options = case.inputs(dtype, torch.Generator().manual_seed(0))
    op = torch.compile(case.op, fullgraph=True) if compile_ else case.op
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got, names = outputs_and_grads(op, tensors, options)
    seen = {event.name for event in prof.events()}
    # An op this runtime refuses (fla's gated backward on Hopper with triton < 3.7.1) takes its
    # torch path: it must not run, and the gradients are still checked.
    missing = [name for name in case.custom_ops
               if f"titan_hybrid::{name}" not in seen and not kernel_op_refused(name)]
    ran_refused = [name for name in case.custom_ops
                   if kernel_op_refused(name) and f"titan_hybrid::{name}" in seen]
    assert not ran_refused, f"refused custom ops {ran_refused} ran"
    assert not missing, f"the kernel path did not run (custom ops {missing} not called)"
    want, _ = outputs_and_grads(case.torch_op, tensors, options)
    worst = 0.0
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape and b.abs().max() > 0, f"{name}: {a.shape} vs {b.shape}"
        err = ((a.double() - b.double()).norm() / b.double().norm()).item()
        assert err < case.tol[dtype], f"{name}: relative error {err:.1e} >= {case.tol[dtype]:.0e}"
        worst = max(worst, err)
    return worst


def run_kernel_checks() -> bool:
    """Prints one line per case and a total; False when a check failed."""
    unusable = probe_kernels(on_demand=True)
    runs = [(case, dtype, False) for case in CASES for dtype in (torch.float32, torch.bfloat16)]
    runs.append((CASES[0], torch.float32, True))  # torch.compile(fullgraph) over the kernel path
    failed, skipped, start = 0, 0, time.perf_counter()
    print("kernels: forward + input gradients vs the torch path, one shape each, one autotune "
          "config (the smallest tiles)")
    for case, dtype, compile_ in runs:
        label = f"  {case.name}, {str(dtype)[6:]}{', torch.compile fullgraph' if compile_ else ''}"
        if unusable.get(case.package):
            print(f"{label}: skipped: {case.package}: {unusable[case.package]}")
            skipped += 1
            continue
        case_start = time.perf_counter()
        try:
            with force_kernels(), one_config_only():
                result = f"ok, largest relative error {check(case, dtype, compile_):.1e}"
        except Exception as error:  # a wrong result or a kernel that does not run: both fail
            failed += 1
            first_line = (str(error).strip().splitlines() or [""])[0]
            result = f"FAILED: {type(error).__name__}: {first_line}"
        print(f"{label}: {result} ({time.perf_counter() - case_start:.1f} s)", flush=True)
    print(f"kernels: {len(runs) - failed - skipped} ok, {failed} failed, {skipped} skipped, "
          f"{time.perf_counter() - start:.0f} s")
    return failed == 0

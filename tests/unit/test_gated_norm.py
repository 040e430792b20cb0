"""The gated group RMS norms (titan_hybrid.ops.gated_norm: Mamba2's norm(y * silu(z)) and gated
DeltaNet's norm(y) * silu(z)): the torch path against a float64 formula, and mamba_ssm's Triton
kernel (through our op, kernels forced on) against the torch path.

Tolerances. Torch path in float64 vs the float64 formula: 1e-12. Kernel vs torch path on the same
inputs, relative Frobenius error of the output and of every gradient: float32 < 1e-5 (both
compute in float32 and differ only in summation order; observed <= 1.4e-7 in the interpreter);
bfloat16 < 1e-2 (both round the output and the y / z gradients to bfloat16, 2**-8 = 3.9e-3
relative per element, and differ in which elements round which way; observed 4.3e-3 in the
interpreter; the weight gradient stays float32).
"""

import pytest
import torch

from tests.triton_kernels import (
    DEVICE,
    assert_close_rel,
    expect_custom_ops,
    kernels_on,
    outputs_and_grads,
)
from titan_hybrid.model.norms import GatedGroupRMSNorm, HeadGatedRMSNorm
from titan_hybrid.ops.gated_norm import gated_group_rms_norm, gated_group_rms_norm_torch

KERNEL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _inputs(dtype=torch.float64, device="cpu", seed=0):
    """y and z as non-contiguous views (slices of one projection, as the mixer has them)."""
    gen = torch.Generator().manual_seed(seed)
    yz = torch.randn(2, 5, 2 * 64, generator=gen, dtype=torch.float64).to(device, dtype)
    y, z = yz.split(64, -1)
    weight = (torch.rand(64, generator=gen, dtype=torch.float64) + 0.5).to(device)
    return dict(y=y, z=z, weight=weight.to(torch.float32 if dtype != torch.float64 else dtype))


def test_torch_path_matches_the_formula():
    inp = _inputs()
    y, z, weight = inp["y"], inp["z"], inp["weight"]
    out = gated_group_rms_norm_torch(y, z, weight, group_size=16, eps=1e-5)
    gated = (y * z * torch.sigmoid(z)).unflatten(-1, (4, 16))
    rms = gated.square().mean(-1, keepdim=True).add(1e-5).sqrt()
    torch.testing.assert_close(out, (gated / rms).flatten(-2) * weight, atol=1e-12, rtol=1e-12)
    # one group per 16 channels: scaling one group's input leaves the others unchanged
    y2 = y.clone()
    y2[..., :16] *= 3
    out2 = gated_group_rms_norm_torch(y2, z, weight, group_size=16, eps=1e-5)
    torch.testing.assert_close(out2[..., 16:], out[..., 16:], atol=0, rtol=0)
    assert not torch.allclose(out2[..., :16], out[..., :16])


def test_torch_path_norm_before_gate_matches_the_formula():
    inp = _inputs()
    y, z, weight = inp["y"], inp["z"], inp["weight"]
    out = gated_group_rms_norm_torch(y, z, weight, group_size=16, eps=1e-5,
                                     norm_before_gate=True)
    grouped = y.unflatten(-1, (4, 16))
    rms = grouped.square().mean(-1, keepdim=True).add(1e-5).sqrt()
    want = (grouped / rms).flatten(-2) * weight * z * torch.sigmoid(z)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)


def test_gdn_norm_module_is_the_per_head_formula():
    """GDN's norm: one RMS per head, a weight shared by the heads, gate after the norm."""
    norm = HeadGatedRMSNorm(16).double()
    with torch.no_grad():
        norm.weight.copy_(torch.rand(16, dtype=torch.float64) + 0.5)
    inp = _inputs()
    o_BTHV, z_BTHV = inp["y"].unflatten(-1, (4, 16)), inp["z"].unflatten(-1, (4, 16))
    rms = o_BTHV.square().mean(-1, keepdim=True).add(1e-5).sqrt()
    want = o_BTHV / rms * norm.weight * z_BTHV * torch.sigmoid(z_BTHV)
    torch.testing.assert_close(norm(o_BTHV, z_BTHV), want, atol=1e-12, rtol=1e-12)


def test_output_dtype_and_bad_shapes():
    inp = _inputs(torch.bfloat16)
    assert gated_group_rms_norm(**inp, group_size=16, eps=1e-5).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="multiple of group_size"):
        gated_group_rms_norm(**inp, group_size=24, eps=1e-5)
    with pytest.raises(ValueError, match="do not match"):
        gated_group_rms_norm(inp["y"], inp["z"][..., :32], inp["weight"], group_size=16,
                             eps=1e-5)


def test_module_is_the_op():
    norm = GatedGroupRMSNorm(64, group_size=16)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64) + 0.5)
    inp = _inputs(torch.float32)
    torch.testing.assert_close(norm(inp["y"], inp["z"]),
                               gated_group_rms_norm_torch(inp["y"], inp["z"], norm.weight,
                                                          group_size=16, eps=1e-5),
                               atol=0, rtol=0)


# ---------------------------------------------------------------------------- GPU kernel parity

@pytest.mark.triton_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16 runs in the interpreter
def test_mamba_ssm_kernel_matches_torch_path(dtype):
    inp = _inputs(dtype, DEVICE, seed=1)
    with kernels_on(), expect_custom_ops("gated_rms_norm_fwd", "gated_rms_norm_bwd"):
        got = outputs_and_grads(gated_group_rms_norm, inp, group_size=16, eps=1e-5)
    want = outputs_and_grads(gated_group_rms_norm_torch, inp, group_size=16, eps=1e-5)
    assert_close_rel(got, want, KERNEL_TOL[dtype], f"gated norm {dtype}")


@pytest.mark.triton_interpreter
def test_mamba_ssm_kernel_norm_before_gate_matches_torch_path():
    inp = _inputs(torch.float32, DEVICE, seed=4)
    with kernels_on(), expect_custom_ops("gated_rms_norm_fwd", "gated_rms_norm_bwd"):
        got = outputs_and_grads(gated_group_rms_norm, inp, group_size=16, eps=1e-5,
                                norm_before_gate=True)
    want = outputs_and_grads(gated_group_rms_norm_torch, inp, group_size=16, eps=1e-5,
                             norm_before_gate=True)
    assert_close_rel(got, want, KERNEL_TOL[torch.float32], "gated norm, norm before gate")


@pytest.mark.triton_interpreter
def test_module_uses_the_kernel():
    norm = GatedGroupRMSNorm(64, group_size=32).to(DEVICE)
    norm.init_weights()
    inp = _inputs(torch.float32, DEVICE, seed=2)
    with kernels_on(), expect_custom_ops("gated_rms_norm_fwd"):
        out = norm(inp["y"], inp["z"])
    expected = gated_group_rms_norm_torch(inp["y"], inp["z"], norm.weight, group_size=32,
                                          eps=1e-5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.triton_interpreter
def test_mamba_ssm_kernel_under_torch_compile_fullgraph():
    inp = _inputs(torch.float32, DEVICE, seed=3)
    compiled = torch.compile(gated_group_rms_norm, backend="aot_eager", fullgraph=True)
    with kernels_on(), expect_custom_ops("gated_rms_norm_fwd", "gated_rms_norm_bwd"):
        got = outputs_and_grads(compiled, inp, group_size=16, eps=1e-5)
    assert type(got[0][0].grad_fn).__name__ == "CompiledFunctionBackward"
    want = outputs_and_grads(gated_group_rms_norm_torch, inp, group_size=16, eps=1e-5)
    assert_close_rel(got, want, KERNEL_TOL[torch.float32], "compiled gated norm")

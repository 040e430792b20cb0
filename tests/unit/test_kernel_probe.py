"""Kernel packages on CPU: causal-conv1d's custom ops (through a stand-in package with the real
one's module path and signatures, tests/stand_ins/), torch.compile(fullgraph=True) passing
through them, and the start-up probe that turns an unusable package into one warning line."""

import dataclasses
import importlib.metadata
import sys

import pytest
import torch

from tests.triton_kernels import STAND_INS, expect_custom_ops, outputs_and_grads
from titan_hybrid.compat import kernel_packages
from titan_hybrid.ops import kernels
from titan_hybrid.ops.conv import causal_depthwise_conv1d, causal_depthwise_conv1d_torch
from titan_hybrid.ops.gated_norm import gated_group_rms_norm
from titan_hybrid.ops.kernels import fla_refusal, force_kernels, kernel_fallbacks


def _forget_causal_conv1d():
    for name in [name for name in sys.modules if name.split(".")[0] == "causal_conv1d"]:
        del sys.modules[name]


@pytest.fixture
def stand_in_conv(monkeypatch):
    _forget_causal_conv1d()
    monkeypatch.syspath_prepend(str(STAND_INS))
    import causal_conv1d.cpp_functions as stand_in
    stand_in.calls.update(fwd=0, bwd=0)
    yield stand_in
    _forget_causal_conv1d()


def _installed(monkeypatch, versions: dict[str, str]) -> None:
    """importlib.metadata reports these distributions at these versions (others as they are)."""
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda distribution: versions.get(
        distribution) or real(distribution))


def _conv_inputs(channels=16, length=37):
    gen = torch.Generator().manual_seed(0)
    seq_idx = torch.tensor([[0] * 10 + [1] * (length - 10), [0] * length])
    return {"x_BTC": torch.randn(2, length, channels, generator=gen),
            "weight_CW": torch.randn(channels, 4, generator=gen),
            "bias_C": torch.randn(channels, generator=gen), "seq_idx": seq_idx}


@pytest.mark.parametrize("documents", [False, True])
def test_conv_kernel_ops_match_torch_path(stand_in_conv, documents):
    inputs = _conv_inputs()
    if not documents:
        inputs["seq_idx"] = None
    want = outputs_and_grads(causal_depthwise_conv1d_torch, inputs, activation="silu")
    with force_kernels(), expect_custom_ops("causal_conv1d_fwd", "causal_conv1d_bwd"):
        got = outputs_and_grads(causal_depthwise_conv1d, inputs, activation="silu")
    assert stand_in_conv.calls == {"fwd": 1, "bwd": 1}
    for a, b in zip(got[0] + list(got[1].values()), want[0] + list(want[1].values())):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert got[0][0].stride(-1) == 1  # channels-last out, as the scan kernels read it


def test_conv_kernel_sizes_it_does_not_take_use_torch_path(stand_in_conv):
    inputs = _conv_inputs(channels=12)  # not a multiple of 8
    with force_kernels():
        causal_depthwise_conv1d(**inputs)
    assert stand_in_conv.calls["fwd"] == 0


def test_fullgraph_compile_passes_through_conv_kernel(stand_in_conv):
    inputs = _conv_inputs()

    def mixer_like(x_BTC, weight_CW, bias_C, seq_idx):
        y = causal_depthwise_conv1d(x_BTC * 2, weight_CW, bias_C, seq_idx=seq_idx,
                                    activation="silu")
        return y.square().sum(-1)

    want = outputs_and_grads(mixer_like, inputs)
    torch._dynamo.reset()
    compiled = torch.compile(mixer_like, fullgraph=True, backend="aot_eager")
    with force_kernels():
        got = outputs_and_grads(compiled, inputs)
    assert stand_in_conv.calls == {"fwd": 1, "bwd": 1}  # the kernel ran inside the graph
    for a, b in zip(got[0] + list(got[1].values()), want[0] + list(want[1].values())):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_fla_refuses_hopper_with_old_triton():
    assert "triton 3.6.0 on a Hopper GPU" in fla_refusal((9, 0), "3.6.0")
    assert fla_refusal((9, 0), "3.4.0") is not None
    for capability, triton in [((9, 0), "3.7.1"), ((9, 0), "3.8.0"), ((8, 0), "3.6.0"),
                               ((10, 0), "3.6.0"), ((9, 0), "3.3.1"), (None, "3.6.0")]:
        assert fla_refusal(capability, triton) is None, (capability, triton)


def test_unusable_packages_become_one_line_each(monkeypatch, tmp_path):
    broken = tmp_path / "causal_conv1d"
    broken.mkdir()
    (broken / "__init__.py").write_text("")
    (broken / "cpp_functions.py").write_text(
        "raise ImportError('libcudart.so.13: cannot open shared object file')\n")
    _forget_causal_conv1d()
    monkeypatch.syspath_prepend(str(tmp_path))
    fla = kernels.KERNEL_PACKAGES["fla"]
    monkeypatch.setitem(kernels.KERNEL_PACKAGES, "fla", dataclasses.replace(
        fla, modules=(), refuses_runtime=lambda: fla_refusal((9, 0), "3.6.0")))
    _installed(monkeypatch, {"fla-core": "0.6.0"})  # the checked version, or that is the reason
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    try:
        with force_kernels():  # a fresh probe, forgotten afterwards
            lines = kernel_fallbacks()
            with pytest.raises(RuntimeError, match="causal_conv1d is unusable: "
                               "causal_conv1d.cpp_functions does not import"):
                causal_depthwise_conv1d(**_conv_inputs())
    finally:
        _forget_causal_conv1d()
    by_package = {line.split()[2]: line for line in lines}
    assert "causal_conv1d" in by_package and "fla" in by_package, lines
    assert "ImportError: libcudart.so.13" in by_package["causal_conv1d"]
    assert "the torch path runs the Mamba2 / GDN causal convolution" in by_package["causal_conv1d"]
    assert "Hopper" in by_package["fla"] and "gated delta rule" in by_package["fla"]
    assert all("\n" not in line for line in lines)


def test_a_version_other_than_the_checked_one_is_refused_by_version(monkeypatch, stand_in_conv):
    """mamba_ssm at another version: one fallback line naming both versions; forced, the op
    raises with the same reason. The version is refused before any import (mamba_ssm does not
    import here: that would be the reason otherwise). causal_conv1d's stand-in has no
    metadata: its `__version__` (the checked one) is read once imported, and it is usable."""
    _installed(monkeypatch, {"mamba-ssm": "2.4.0"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    reason = "mamba_ssm 2.4.0 installed, titan_hybrid's custom ops were checked on 2.3.2.post1"
    with force_kernels():
        assert kernels.probe_kernels()["mamba_ssm"] == reason
        assert kernels.probe_kernels()["causal_conv1d"] is None
        lines = kernel_fallbacks()
        with pytest.raises(RuntimeError, match=f"mamba_ssm is unusable: {reason}"):
            gated_group_rms_norm(*(torch.ones(2, 8),) * 2, torch.ones(8), group_size=4,
                                 eps=1e-5)
    by_package = {line.split()[2]: line for line in lines}
    assert by_package["mamba_ssm"] == (f"kernel package mamba_ssm is not used: {reason}; the "
                                       "torch path runs the Mamba2 SSD scan and gated RMS norm")
    assert "causal_conv1d" not in by_package, lines


@pytest.mark.parametrize("version, refused", [
    ("2.3.2.post1", False), ("2.3.2.post1+cu12torch2.6cxx11abiTRUE", False), ("2.3.2", True),
    ("2.3.3", True), ("2.4.0", True), (None, True)])
def test_version_refusal(monkeypatch, version, refused):
    monkeypatch.setattr(kernel_packages, "installed_version", lambda package: version)
    reason = kernel_packages.version_refusal("mamba_ssm")
    assert (reason is not None) == refused, reason
    if refused:
        assert "titan_hybrid's custom ops were checked on 2.3.2.post1" in reason
        assert (f"mamba_ssm {version} installed" if version else "version is unknown") in reason


def test_checked_versions_are_the_gpu_extras_pins():
    import tomllib

    from tests.launch import REPO_ROOT

    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    pins = dict(requirement.split("==") for requirement
                in pyproject["project"]["optional-dependencies"]["gpu"] if "==" in requirement)
    assert pins == {checked.distribution: checked.version
                    for checked in kernel_packages.CHECKED_PACKAGES.values()}


def test_no_fallback_lines_without_cuda(monkeypatch):
    # Without CUDA the torch paths are the plan, so nothing is reported (and nothing probed).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(kernels, "probe_kernels", lambda: pytest.fail("probed without CUDA"))
    assert kernel_fallbacks() == []


def test_launcher_keeps_autotune_results(monkeypatch):
    from titan_hybrid import launch

    seen = {}
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)
    monkeypatch.setattr(launch, "run_here", lambda job_args: seen.update(
        value=launch.os.environ.get("TRITON_CACHE_AUTOTUNING")))
    assert launch.main(["--job.config_file", "train_configs/hybrid.toml"]) == 0
    assert seen == {"value": "1"}
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "0")  # a user's choice stands
    launch.main(["--job.config_file", "train_configs/hybrid.toml"])
    assert seen == {"value": "0"}

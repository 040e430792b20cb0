"""Kernel packages on CPU: causal-conv1d's custom ops (through a stand-in package with the real
one's module path and signatures, tests/stand_ins/), torch.compile(fullgraph=True) passing
through them, and the start-up probe that accepts a package by version range and launcher
signatures, and turns an unusable one into one warning line and a per-step metrics field."""

import dataclasses
import importlib.metadata
import shutil
import sys

import pytest
import torch
from packaging.specifiers import SpecifierSet

from tests.triton_kernels import (
    INTERPRETED,
    STAND_INS,
    expect_custom_ops,
    kernels_on,
    outputs_and_grads,
)
from titan_hybrid.compat import kernel_packages
from titan_hybrid.ops import kernels
from titan_hybrid.ops.conv import causal_depthwise_conv1d, causal_depthwise_conv1d_torch
from titan_hybrid.ops.gated_norm import gated_group_rms_norm
from titan_hybrid.ops.kernels import (
    fla_gated_delta_bwd_refusal,
    force_kernels,
    kernel_fallbacks,
    kernel_op_refused,
    kernel_path_field,
    mamba3_siso_refusal,
    simulate_gpu_runtime,
)
from titan_hybrid.training.metrics import step_line


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


def test_fla_refuses_its_gated_delta_backward_on_hopper_with_old_triton():
    """fla 0.6 raises in the gated chunk_bwd_dqkwg for triton >= 3.4.0, < 3.7.1 on Hopper
    (compute capability 9) only."""
    reason = fla_gated_delta_bwd_refusal((9, 0), "3.6.0")
    assert "triton 3.6.0 on a Hopper GPU" in reason and "#640" in reason
    assert fla_gated_delta_bwd_refusal((9, 0), "3.4.0") is not None
    assert fla_gated_delta_bwd_refusal((9, 0), "3.7.0") is not None
    for capability, triton in [((9, 0), "3.7.1"), ((9, 0), "3.8.0"), ((8, 0), "3.6.0"),
                               ((10, 0), "3.6.0"), ((9, 0), "3.3.1"), (None, "3.6.0")]:
        assert fla_gated_delta_bwd_refusal(capability, triton) is None, (capability, triton)


def test_mamba_ssm_refuses_its_mamba3_siso_scan_on_blackwell_up_to_2_3_2_post1(monkeypatch):
    """mamba-ssm <= 2.3.2.post1's SISO forward is wrong on compute capability 10 (#997): the
    Mamba-3 layers take the torch path there, mamba_ssm's other kernels run."""
    reason = mamba3_siso_refusal((10, 0), "2.3.2.post1+cu12torch2.6cxx11abiTRUE")
    assert "Blackwell" in reason and "#997" in reason
    assert mamba3_siso_refusal((10, 3), "2.3.2") is not None
    for capability, version in [((10, 0), "2.3.3"), ((9, 0), "2.3.2.post1"),
                                ((12, 0), "2.3.2.post1"), (None, "2.3.2.post1"),
                                ((10, 0), None)]:
        assert mamba3_siso_refusal(capability, version) is None, (capability, version)
    mamba_ssm = kernels.KERNEL_PACKAGES["mamba_ssm"]
    monkeypatch.setitem(kernels.KERNEL_PACKAGES, "mamba_ssm",
                        dataclasses.replace(mamba_ssm, launchers=()))
    _installed(monkeypatch, {"mamba-ssm": "2.3.2.post1"})
    with simulate_gpu_runtime((10, 0), "3.6.0"):
        assert kernels.probe_kernels()["mamba_ssm"] is None
        assert set(kernels.refused_ops()) == {"mamba3_siso_fwd"}
        assert kernel_op_refused("mamba3_siso_fwd")
        assert ("kernel package mamba_ssm is used except for Mamba-3's SISO scan, which the "
                "torch path runs: " + mamba3_siso_refusal((10, 0), "2.3.2.post1")
                ) in kernel_fallbacks()
    with simulate_gpu_runtime((9, 0), "3.6.0"):
        assert "mamba3_siso_fwd" not in kernels.refused_ops()


def _fla_usable_without_import(monkeypatch):
    """fla at an accepted version with no launchers to import or check: usable here, so what
    the runtime refuses of it shows."""
    fla = kernels.KERNEL_PACKAGES["fla"]
    monkeypatch.setitem(kernels.KERNEL_PACKAGES, "fla", dataclasses.replace(fla, launchers=()))
    _installed(monkeypatch, {"fla-core": "0.6.0"})


def test_hopper_with_old_triton_refuses_only_the_gated_delta_backward(monkeypatch):
    """On a (simulated) Hopper GPU with triton 3.6.0 fla stays usable: one start-up line and
    the metrics field name the gated delta rule's backward as what takes the torch path, and
    only that op is refused; with triton 3.7.1 nothing of fla is."""
    _fla_usable_without_import(monkeypatch)
    reason = fla_gated_delta_bwd_refusal((9, 0), "3.6.0")
    with simulate_gpu_runtime((9, 0), "3.6.0"):
        assert kernels.probe_kernels()["fla"] is None
        assert set(kernels.refused_ops()) == {"fla_gated_delta_bwd"}
        assert kernel_op_refused("fla_gated_delta_bwd") and not kernel_op_refused("fla_kda_bwd")
        lines, field = kernel_fallbacks(), kernel_path_field()
    assert [line for line in lines if line.split()[2] == "fla"] == [
        "kernel package fla is used except for the gated delta rule's backward, which the "
        f"torch path runs: {reason}"]
    assert f"fla for the gated delta rule's backward: {reason})" in field, field
    assert "fla:" not in field and "\n" not in field
    with simulate_gpu_runtime((9, 0), "3.7.1"):
        assert kernels.refused_ops() == {}
        assert all(line.split()[2] != "fla" for line in kernel_fallbacks())


def test_unusable_packages_become_one_line_each(monkeypatch, tmp_path):
    broken = tmp_path / "causal_conv1d"
    broken.mkdir()
    (broken / "__init__.py").write_text("")
    (broken / "cpp_functions.py").write_text(
        "raise ImportError('libcudart.so.13: cannot open shared object file')\n")
    _forget_causal_conv1d()
    monkeypatch.syspath_prepend(str(tmp_path))
    _installed(monkeypatch, {"fla-core": "0.7.0"})
    try:
        with force_kernels(), simulate_gpu_runtime((9, 0), "3.6.0"):  # probed afresh
            lines = kernel_fallbacks()
            with pytest.raises(RuntimeError, match="causal_conv1d is unusable: "
                               "causal_conv1d.cpp_functions does not import"):
                causal_depthwise_conv1d(**_conv_inputs())
    finally:
        _forget_causal_conv1d()
    by_package = {line.split()[2]: line for line in lines}
    assert "causal_conv1d" in by_package and "fla" in by_package, lines
    assert "ImportError: libcudart.so.13" in by_package["causal_conv1d"]
    assert ("titan_hybrid's Triton kernel (ops/conv_triton.py) runs the Mamba2 / GDN causal "
            "convolution") in by_package["causal_conv1d"]
    # an unusable fla is one line for the whole package, whatever the runtime refuses of it
    assert by_package["fla"] == ("kernel package fla is not used: fla-core 0.7.0 is installed, "
                                 "titan_hybrid's custom ops accept fla-core>=0.6.0,<0.7; the "
                                 "torch path runs the gated delta rule and KDA")
    assert all("\n" not in line for line in lines)


def test_a_version_outside_the_range_is_refused_by_version(monkeypatch, stand_in_conv):
    """mamba_ssm at the next minor version: one fallback line naming the version and the range,
    and the per-step metrics field; forced, the op raises with the same reason. The version is
    refused before any import (mamba_ssm does not import here: that would be the reason
    otherwise). causal_conv1d's stand-in has no metadata: its `__version__` (an accepted one) is
    read once imported, and it is usable."""
    _installed(monkeypatch, {"mamba-ssm": "2.4.0"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    reason = ("mamba-ssm 2.4.0 is installed, titan_hybrid's custom ops accept "
              "mamba-ssm>=2.3.2.post1,<2.4")
    with force_kernels():
        assert kernels.probe_kernels()["mamba_ssm"] == reason
        assert kernels.probe_kernels()["causal_conv1d"] is None
        lines = kernel_fallbacks()
        field = kernel_path_field()
        line = step_line(20, {"moe/aux_loss": 0.5})
        with pytest.raises(RuntimeError, match=f"mamba_ssm is unusable: {reason}"):
            gated_group_rms_norm(*(torch.ones(2, 8),) * 2, torch.ones(8), group_size=4,
                                 eps=1e-5)
    by_package = {line.split()[2]: line for line in lines}
    assert by_package["mamba_ssm"] == (f"kernel package mamba_ssm is not used: {reason}; the "
                                       "torch path runs the Mamba2 SSD scan, the gated RMS "
                                       "norm and Mamba-3's SISO scan")
    assert "causal_conv1d" not in by_package, lines
    assert field.startswith(f"kernels: torch path (mamba_ssm: {reason}"), field
    assert line == f"step: 20  moe/aux_loss: 0.5000  {field}"


def _stand_in_conv_copy(tmp_path, monkeypatch, version: str, old: str = "", new: str = ""):
    """A copy of the causal_conv1d stand-in at `version`, `old` replaced by `new` in its
    cpp_functions, first on sys.path for the test."""
    copy = tmp_path / "causal_conv1d"
    shutil.copytree(STAND_INS / "causal_conv1d", copy)
    (copy / "__init__.py").write_text(f"__version__ = {version!r}\n")
    functions = copy / "cpp_functions.py"
    source = functions.read_text()
    if old:
        assert source.count(old) == 1, old
        functions.write_text(source.replace(old, new))
    _forget_causal_conv1d()
    monkeypatch.syspath_prepend(str(tmp_path))


def test_another_patch_release_is_accepted_and_used(monkeypatch, tmp_path):
    _stand_in_conv_copy(tmp_path, monkeypatch, "1.7.3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    try:
        with force_kernels():
            assert kernels.probe_kernels()["causal_conv1d"] is None
            assert "causal_conv1d" not in (kernel_path_field() or "")
            with expect_custom_ops("causal_conv1d_fwd"):
                causal_depthwise_conv1d(**_conv_inputs())
        assert sys.modules["causal_conv1d"].__version__ == "1.7.3"
        assert sys.modules["causal_conv1d.cpp_functions"].calls["fwd"] == 1
    finally:
        _forget_causal_conv1d()


_BWD = "def causal_conv1d_bwd_function(x, weight, bias, dout,"
_FWD = "def causal_conv1d_fwd_function(x, weight, bias, seq_idx,"
_BWD_END = "return_dinitial_states, silu_activation):"
_WHERE = "causal_conv1d.cpp_functions"


@pytest.mark.parametrize("old, new, reason", [
    (_BWD, _BWD.replace("dout", "grad_out"), f"{_WHERE}.causal_conv1d_bwd_function takes "
     "`grad_out` as parameter 4, where titan_hybrid's custom ops pass `dout`"),
    (_BWD, _BWD.replace("bias,", "bias, scale,"), f"{_WHERE}.causal_conv1d_bwd_function takes "
     "`scale` as parameter 4, where titan_hybrid's custom ops pass `dout`"),
    (_BWD_END, _BWD_END.replace("):", ", out):"), f"{_WHERE}.causal_conv1d_bwd_function "
     "requires `out`, which titan_hybrid's custom ops do not pass"),
    (_FWD, _FWD.replace("_fwd_function", "_forward"), f"{_WHERE} has no "
     "causal_conv1d_fwd_function, which titan_hybrid's custom ops call"),
])
def test_a_changed_launcher_is_refused_naming_it(monkeypatch, tmp_path, old, new, reason):
    """An accepted version whose launcher lost or moved a parameter the ops pass, gained one
    they do not, or is gone: refused, with the version and the launcher in the reason; the conv
    takes our Triton kernel (the start-up line says why; the metrics field, which names torch
    paths only, says nothing) or, forced, raises."""
    _stand_in_conv_copy(tmp_path, monkeypatch, "1.7.1", old, new)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    reason = f"causal-conv1d 1.7.1: {reason}"
    try:
        with force_kernels():
            assert kernels.probe_kernels()["causal_conv1d"] == reason
            lines = kernel_fallbacks()
            assert "causal_conv1d" not in (kernel_path_field() or "")
            with pytest.raises(RuntimeError, match="causal_conv1d is unusable: causal-conv1d "
                               "1.7.1: "):
                causal_depthwise_conv1d(**_conv_inputs())
    finally:
        _forget_causal_conv1d()
    assert f"kernel package causal_conv1d is not used: {reason}; titan_hybrid's Triton kernel " \
        "(ops/conv_triton.py) runs the Mamba2 / GDN causal convolution" in "\n".join(lines)


def test_a_launcher_with_a_new_optional_parameter_is_accepted(monkeypatch, tmp_path):
    _stand_in_conv_copy(tmp_path, monkeypatch, "1.7.2", _BWD_END,
                        _BWD_END.replace("):", ", out=None):"))
    try:
        with force_kernels():
            assert kernels.probe_kernels()["causal_conv1d"] is None
    finally:
        _forget_causal_conv1d()


def test_keyword_parameters_are_checked_by_name_not_place(monkeypatch, tmp_path):
    (tmp_path / "launcher_under_test.py").write_text(
        "def moved(x, chunk_size, extra=None, *, D=None, z=None): pass\n"
        "def renamed(x, chunk_size, D=None, gate=None): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    launcher = kernel_packages.Launcher("mamba_ssm", "launcher_under_test", "moved",
                                        ("x", "chunk_size"), ("z", "D"))
    try:
        assert launcher.mismatch() is None
        assert dataclasses.replace(launcher, name="renamed").mismatch() == (
            "launcher_under_test.renamed has no parameter `z`, which titan_hybrid's custom ops "
            "pass")
    finally:
        sys.modules.pop("launcher_under_test", None)


@pytest.mark.triton_interpreter
def test_the_tested_releases_pass_the_launcher_check():
    """The mamba-ssm and fla-core the triton_interpreter tests install (and the stand-ins of
    causal-conv1d and of mamba-ssm's TileLang kernels) are accepted by version and by every
    launcher's signature: the probe finds all four usable."""
    with kernels_on():
        assert kernels.probe_kernels(on_demand=True) == dict.fromkeys(kernels.KERNEL_PACKAGES)
        for package in kernel_packages.ACCEPTED_VERSIONS:
            launchers = kernel_packages.launchers_of(package)
            assert launchers and all(launcher.mismatch() is None for launcher in launchers)
        if INTERPRETED:  # scripts/bootstrap.sh's, not a GPU host's own install
            assert kernel_packages.installed_version("mamba_ssm") == "2.3.2.post1"
            assert kernel_packages.installed_version("fla") == "0.6.0"


@pytest.mark.parametrize("version, refused", [
    ("2.3.2.post1", False), ("2.3.2.post1+cu12torch2.6cxx11abiTRUE", False), ("2.3.3", False),
    ("2.3.10+cu12", False), ("2.3.3rc1", False), ("2.3.2", True), ("2.4.0", True),
    ("2.4.0rc1", True), ("2.2.4", True), ("not a version", True), (None, True)])
def test_version_refusal(monkeypatch, version, refused):
    monkeypatch.setattr(kernel_packages, "installed_version", lambda package: version)
    reason = kernel_packages.version_refusal("mamba_ssm")
    assert (reason is not None) == refused, reason
    if refused:
        assert "titan_hybrid's custom ops accept mamba-ssm>=2.3.2.post1,<2.4" in reason
        assert (f"mamba-ssm {version} is installed" if version else "version is unknown") \
            in reason


def test_accepted_versions_are_the_gpu_extras_ranges():
    import tomllib
    from packaging.requirements import Requirement

    from tests.launch import REPO_ROOT

    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    requirements = [Requirement(text) for text
                    in pyproject["project"]["optional-dependencies"]["gpu"]]
    ranges = {requirement.name: requirement.specifier for requirement in requirements
              if requirement.specifier}
    assert ranges == {accepted.distribution: SpecifierSet(accepted.specifiers)
                      for accepted in kernel_packages.ACCEPTED_VERSIONS.values()}


def test_no_metrics_field_when_every_kernel_runs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "probe_kernels", lambda: dict.fromkeys(kernels.KERNEL_PACKAGES))
    assert kernel_path_field() is None
    assert step_line(3, {}) is None
    assert step_line(3, {"dsa/indexer_loss": 1.25}) == "step:  3  dsa/indexer_loss: 1.2500"


def test_no_fallback_lines_without_cuda(monkeypatch):
    # Without CUDA the torch paths are the plan, so nothing is reported (and nothing probed).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(kernels, "probe_kernels", lambda: pytest.fail("probed without CUDA"))
    assert kernel_fallbacks() == []
    assert kernel_path_field() is None


def test_launcher_keeps_autotune_results(monkeypatch):
    from titan_hybrid import launch

    seen = {}
    # setenv first: the undo then restores the variable as the test found it (a delenv of an
    # unset variable records nothing, and the launcher's setdefault would outlive the test,
    # keeping this worker's later launches off the tests' fork server).
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "")
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING")
    monkeypatch.setattr(launch, "run_here", lambda job_args: seen.update(
        value=launch.os.environ.get("TRITON_CACHE_AUTOTUNING")))
    assert launch.main(["--job.config_file", "train_configs/hybrid.toml"]) == 0
    assert seen == {"value": "1"}
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "0")  # a user's choice stands
    launch.main(["--job.config_file", "train_configs/hybrid.toml"])
    assert seen == {"value": "0"}

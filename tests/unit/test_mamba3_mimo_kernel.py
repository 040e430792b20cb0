"""Our Mamba-3 MIMO layer on mamba_ssm's TileLang kernels (ops/mamba3_mimo_kernel.py) against
its torch path: the output and every gradient, with and without packed documents, with and
without the output norm, one group and one per head.

TileLang compiles for CUDA only. On CPU the kernels' stand-in (tests/stand_ins/
tilelang_mamba3_mimo.py, a token-by-token recurrence written from the kernels) takes their
place, and mamba_ssm's Triton kernels around them (the decay sums, the angles' running sum)
run in Triton's interpreter: what this checks there is our side, the layouts, dtypes, the
documents' cu_seqlens and the gradients' way back. On a GPU with tilelang installed the same
tests run the real kernels (bench/kernel_check.py times them too)."""

from __future__ import annotations

import ast
import importlib
import inspect

import pytest
import torch

from tests.triton_kernels import (
    KERNEL_SITE,
    TILELANG_MODULES,
    assert_close_to_scale,
    expect_custom_ops,
    layer_outputs_and_grads,
    mamba3_kernels_on,
)
from titan_hybrid.model.layout import TokenLayout
from titan_hybrid.model.mamba3 import Mamba3Args, Mamba3Mixer
from titan_hybrid.ops import kernels

pytestmark = pytest.mark.triton_interpreter

# 2 heads of 32 (the smallest sizes mamba_ssm tested the kernels on); 48 tokens: three chunks
# of the kernels' 16 (64 / R, at most chunk_size)
DIM, LENGTH = 32, 48
OPTIONS = {
    "rank4": dict(),
    "rank2-group-per-head-rope1-norm": dict(mimo_rank=2, n_groups=2, rope_fraction=1.0,
                                            outproj_norm=True),
}


def _layer(options: str, **sizes) -> Mamba3Mixer:
    torch.manual_seed(0)
    args = Mamba3Args(chunk_size=16, mimo=True,
                      **{"d_state": 32, "head_dim": 32, "mimo_rank": 4, **sizes,
                         **OPTIONS[options]})
    layer = Mamba3Mixer(dim=DIM, args=args)
    layer.init_weights(init_std=0.2, out_std=0.2)
    with torch.no_grad():
        for parameter in layer.parameters():  # every parameter away from its init
            parameter.add_(0.2 * torch.randn_like(parameter))
    return layer


def _documents(length: int) -> TokenLayout:
    seq_idx = torch.zeros(2, length, dtype=torch.long)
    seq_idx[:, 7:], seq_idx[1:, 8:], seq_idx[:, 30:] = 1, 2, 3
    return TokenLayout(positions=None, seq_idx=seq_idx)


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("documents", [False, True], ids=["rows", "documents"])
def test_our_mimo_layer_on_their_kernels_gives_the_torch_paths_output_and_gradients(
        options, documents):
    layer = _layer(options)
    length = 37 if documents else LENGTH  # documents take any length
    u = torch.randn(2, length, DIM, requires_grad=True)
    layout = _documents(length) if documents else None
    want = layer_outputs_and_grads(layer, u, layout)
    with mamba3_kernels_on(), expect_custom_ops("mamba3_mimo_fwd", "mamba3_mimo_bwd"):
        assert layer.core.runs_kernel(u)
        got = layer_outputs_and_grads(layer, u, layout)
    assert_close_to_scale(got, want, lambda name: 1e-4)


def test_shapes_their_kernels_do_not_take_run_the_torch_path():
    """Without documents a length that is not a multiple of the kernels' chunk (their dense
    backward asserts it), groups that are neither one nor one per head (their backward refuses
    them), and sizes mamba_ssm did not test them on (a head dim of 16; a state of 16 with a
    head dim of 32, which it says fails to compile) take the torch path."""
    two_groups = Mamba3Mixer(dim=2 * DIM, args=Mamba3Args(d_state=32, head_dim=32, mimo=True,
                                                          n_groups=2))
    two_groups.init_weights(init_std=0.2, out_std=0.2)
    for layer, length in ((_layer("rank4"), 37), (two_groups, LENGTH),
                          (_layer("rank4", head_dim=16), LENGTH),
                          (_layer("rank4", d_state=16), LENGTH)):
        dim = layer.in_proj.in_features
        u = torch.randn(2, length, dim)
        want = layer(u)
        with mamba3_kernels_on(), expect_custom_ops(not_run=("mamba3_mimo_fwd",)):
            got = layer(u)
        assert torch.equal(got, want)


def test_their_kernels_compile_into_one_graph_with_documents_and_without():
    layer = _layer("rank4")
    u = torch.randn(2, LENGTH, DIM)
    with torch.no_grad(), mamba3_kernels_on(), expect_custom_ops("mamba3_mimo_fwd"):
        kernels.probe_kernels()  # as an entry point does before compiling
        for layout in (None, _documents(LENGTH)):
            torch._dynamo.reset()
            eager = layer(u, layout)
            compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")(u, layout)
            torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def _parameters(function) -> list[tuple[str, str | None]]:
    """(name, default's source) of each parameter."""
    if isinstance(function, ast.FunctionDef):
        positional = function.args.args
        defaults = [None] * (len(positional) - len(function.args.defaults)) + [
            ast.unparse(default) for default in function.args.defaults]
        return list(zip((arg.arg for arg in positional), defaults, strict=True))
    return [(p.name, None if p.default is p.empty else repr(p.default))
            for p in inspect.signature(function).parameters.values()]


def test_the_stand_in_has_their_launchers_signatures():
    """The stand-in's four launchers take the parameters, in order and with the defaults, of
    mamba_ssm 2.3.2.post1's (read from its sources: they import tilelang, which needs CUDA)."""
    stand_in = importlib.import_module("tests.stand_ins.tilelang_mamba3_mimo")
    for module in TILELANG_MODULES:
        path = KERNEL_SITE.joinpath(*module.split(".")).with_suffix(".py")
        functions = {node.name: node for node in ast.parse(path.read_text()).body
                     if isinstance(node, ast.FunctionDef)}
        launchers = [name for name in functions if name.startswith(("mamba_mimo_forward",
                                                                    "mamba_mimo_bwd_combined"))]
        assert len(launchers) == 1, (module, launchers)
        name = launchers[0]
        assert _parameters(getattr(stand_in, name)) == _parameters(functions[name]), name


def test_tilelang_is_probed_and_reported_once_a_mimo_layer_is_built(monkeypatch):
    """On a GPU the start-up probe leaves tilelang alone (its import takes ~10 s and most
    models never call it) and says nothing of it. Building a MIMO layer probes it: without
    tilelang, the start-up lines and the step line then say that the torch path runs Mamba-3's
    MIMO scan, and why."""
    monkeypatch.setattr(kernels, "_asked", set())
    with kernels.simulate_gpu_runtime((9, 0), "3.7.1"):
        assert "tilelang" not in kernels.probe_kernels()
        assert not any("tilelang" in line for line in kernels.kernel_fallbacks())
        assert "tilelang" not in (kernels.kernel_path_field() or "")
        _layer("rank4")
        assert kernels._unusable["tilelang"] is not None  # probed when built: not installed
        lines = [line for line in kernels.kernel_fallbacks() if "tilelang" in line]
        field = kernels.kernel_path_field()
    assert len(lines) == 1 and lines[0].startswith("kernel package tilelang is not used: "), lines
    assert lines[0].endswith("the torch path runs Mamba-3's MIMO scan (mamba_ssm's TileLang "
                             "kernels)"), lines
    assert "tilelang: mamba_ssm.ops." in field and "does not import" in field, field

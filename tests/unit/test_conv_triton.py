"""Our Triton causal conv (titan_hybrid/ops/conv_triton.py): forward and every gradient against
the torch path (the reference) and causal-conv1d's stand-in, with bias, SiLU, packed documents
and context parallelism's halo rows; strided and bf16 inputs; torch.compile passing through.
On CPU the kernels run in Triton's interpreter (tests/triton_kernels.py)."""

import pytest
import torch

from tests.triton_kernels import (
    DEVICE,
    STAND_INS,
    assert_close_rel,
    expect_custom_ops,
    kernels_on,
    outputs_and_grads,
)
from titan_hybrid.ops.conv import causal_depthwise_conv1d, causal_depthwise_conv1d_torch
from titan_hybrid.ops.conv_triton import causal_depthwise_conv1d_triton

pytestmark = pytest.mark.triton_interpreter


def _inputs(width=4, channels=136, length=45, documents=True, halo=False, bias=True,
            dtype=torch.float32):
    """Two rows; 136 channels span two channel blocks, 45 steps two time blocks. Row 0 starts
    a document at 13 (inside the first block) and row 1 at 32 (the second); with `halo`,
    row 0's halo rows belong to another document but the last, row 1's all to its first."""
    gen = torch.Generator().manual_seed(width)
    inputs = {"x_BTC": torch.randn(2, length, channels, generator=gen),
              "weight_CW": torch.randn(channels, width, generator=gen) / width,
              "bias_C": torch.randn(channels, generator=gen) if bias else None,
              "seq_idx": torch.tensor([[3] * 13 + [4] * (length - 13),
                                       [0] * 32 + [1] * (length - 32)]) if documents else None}
    if halo:
        inputs["initial_states"] = torch.randn(2, width - 1, channels, generator=gen)
        if documents:
            inputs["initial_seq_idx"] = torch.tensor([[2] * (width - 2) + [3], [0] * (width - 1)])
    return {name: value if value is None or not value.is_floating_point()
            else value.to(DEVICE, dtype) for name, value in inputs.items()}


@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("halo", [False, True])
def test_matches_the_torch_path_with_every_gradient(width, documents, halo):
    inputs = _inputs(width, documents=documents, halo=halo)
    want = outputs_and_grads(causal_depthwise_conv1d_torch, inputs, activation="silu")
    with expect_custom_ops("triton_causal_conv1d_fwd", "triton_causal_conv1d_bwd"):
        got = outputs_and_grads(causal_depthwise_conv1d_triton, inputs, activation="silu")
    assert_close_rel(got, want, 1e-5, f"width {width}")
    if halo:  # the halo rows' gradient is real (a vacuous zero would fail assert_close_rel)
        assert got[1]["initial_states"].abs().sum() > 0


@pytest.mark.parametrize("bias", [False, True])
def test_without_activation_or_bias(bias):
    inputs = _inputs(bias=bias, halo=True)
    want = outputs_and_grads(causal_depthwise_conv1d_torch, inputs)
    got = outputs_and_grads(causal_depthwise_conv1d_triton, inputs)
    assert_close_rel(got, want, 1e-5, "no activation")


@pytest.mark.parametrize("documents", [False, True])
def test_matches_the_causal_conv1d_stand_in(documents, monkeypatch):
    """The same numbers as causal-conv1d's functions (an independent per-tap computation)."""
    monkeypatch.syspath_prepend(str(STAND_INS))
    inputs = _inputs(documents=documents)
    with kernels_on(), expect_custom_ops("causal_conv1d_fwd", "causal_conv1d_bwd"):
        want = outputs_and_grads(causal_depthwise_conv1d, inputs, activation="silu")
    got = outputs_and_grads(causal_depthwise_conv1d_triton, inputs, activation="silu")
    assert_close_rel(got, want, 1e-5, "vs causal-conv1d")


def test_reads_a_strided_slice_in_place():
    """x as the mixers pass it, a channel slice of in_proj's output: read through its strides,
    no copy (the op's input is the slice itself), the same numbers as from a dense copy."""
    inputs = _inputs()
    wide = torch.randn(2, 45, 300, device=DEVICE)
    x_slice = wide[..., 100:236].requires_grad_()
    seq_idx = inputs["seq_idx"].int()  # as the kernel reads it: no conversion either
    with torch.profiler.profile() as prof:
        out = causal_depthwise_conv1d_triton(x_slice, inputs["weight_CW"], inputs["bias_C"],
                                             seq_idx=seq_idx, activation="silu")
    # Outside the op, that is: in Triton's interpreter the launch itself copies to numpy.
    copies = [event.name for event in prof.events()
              if event.name in ("aten::copy_", "aten::contiguous", "aten::clone")
              and not _inside(event, "titan_hybrid::triton_causal_conv1d_fwd")]
    assert copies == [], copies
    dense = x_slice.detach().contiguous().requires_grad_()
    want = causal_depthwise_conv1d_torch(dense, inputs["weight_CW"], inputs["bias_C"],
                                         seq_idx=inputs["seq_idx"], activation="silu")
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, x_slice, grad)[0],
                               torch.autograd.grad(want, dense, grad)[0], rtol=1e-5, atol=1e-5)


def _inside(event, name: str) -> bool:
    while event is not None:
        if event.name == name:
            return True
        event = event.cpu_parent
    return False


def test_bf16_activations_with_float32_weights():
    """A bf16 layer under FSDP's mixed precision keeps the conv weights in float32: outputs
    and dx in bf16, weight / bias gradients in float32, within bf16 rounding of the torch
    path in float32 (the kernel's arithmetic is float32 throughout)."""
    inputs = _inputs(halo=True)
    inputs["x_BTC"] = inputs["x_BTC"].bfloat16()
    inputs["initial_states"] = inputs["initial_states"].bfloat16()
    got = outputs_and_grads(causal_depthwise_conv1d_triton, inputs, activation="silu")
    assert got[0][0].dtype == got[1]["x_BTC"].dtype == torch.bfloat16
    assert got[1]["weight_CW"].dtype == got[1]["bias_C"].dtype == torch.float32
    as_float = {name: value.float() if value is not None and value.is_floating_point()
                else value for name, value in inputs.items()}
    want = outputs_and_grads(causal_depthwise_conv1d_torch, as_float, activation="silu")
    got = ([out.float() for out in got[0]], {name: grad.float() for name, grad in got[1].items()})
    assert_close_rel(got, want, 1e-2, "bf16")


def test_fullgraph_compile_passes_through():
    inputs = _inputs(halo=True)

    def conv(x_BTC, weight_CW, bias_C, seq_idx, initial_states, initial_seq_idx):
        return causal_depthwise_conv1d_triton(x_BTC * 2, weight_CW, bias_C, seq_idx=seq_idx,
                                              activation="silu", initial_states=initial_states,
                                              initial_seq_idx=initial_seq_idx) + 1

    want = outputs_and_grads(conv, inputs)
    compiled = torch.compile(conv, fullgraph=True, backend="aot_eager")
    with expect_custom_ops("triton_causal_conv1d_fwd", "triton_causal_conv1d_bwd"):
        got = outputs_and_grads(compiled, inputs)
    assert_close_rel(got, want, 1e-6, "compiled")

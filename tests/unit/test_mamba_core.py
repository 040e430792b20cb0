"""Mamba2's fused core (titan_hybrid/ops/mamba_core.py): the layer on the kernel path is one op
pair from in_proj's output to out_proj's input, with the torch path's numbers (output and the
gradient of every parameter and of the input), either conv kernel (causal-conv1d's stand-in,
our Triton conv), packed documents, torch.compile passing through, and no `cat` building a
gradient. Kernels run in Triton's interpreter on CPU (tests/triton_kernels.py)."""


import pytest
import torch

from tests.triton_kernels import DEVICE, expect_custom_ops, kernels_on, rel_err
from titan_hybrid.model.layout import TokenLayout
from titan_hybrid.model.mamba import Mamba2Mixer, MambaArgs

pytestmark = pytest.mark.triton_interpreter
# fp32 in the interpreter; the kernels' dots take tf32 on a GPU
TOL = 1e-4 if DEVICE == "cpu" else 5e-3


def _mixer_and_inputs(documents: bool):
    torch.manual_seed(0)
    mixer = Mamba2Mixer(dim=64, args=MambaArgs(d_state=16, head_dim=16, n_groups=2,
                                               chunk_size=16)).to(DEVICE)
    with torch.no_grad():
        mixer.init_weights(init_std=0.1, out_std=0.1)
    x = torch.randn(2, 40, 64, device=DEVICE)
    seq_idx = torch.tensor([[0] * 13 + [1] * 27, [0] * 40], device=DEVICE) if documents else None
    return mixer, x, TokenLayout(positions=None, seq_idx=seq_idx)


def _forward_backward(mixer, x, layout, forward=None):
    mixer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = (mixer if forward is None else forward)(x, layout)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out))
    return out.detach(), {"input": x.grad, **{name: p.grad for name, p in
                                              mixer.named_parameters()}}


@pytest.mark.parametrize("conv", ["causal-conv1d", "ours"])
@pytest.mark.parametrize("documents", [False, True])
def test_fused_core_matches_the_torch_path(conv, documents, monkeypatch):
    mixer, x, layout = _mixer_and_inputs(documents)
    want = _forward_backward(mixer, x, layout)  # the torch path (no kernels outside the block)
    if conv == "ours":  # causal-conv1d's stand-in is there inside kernels_on(); take ours
        monkeypatch.setattr("titan_hybrid.ops.mamba_core._uses_causal_conv1d",
                            lambda *args: False)
    with kernels_on(), torch.profiler.profile(record_shapes=True) as prof:
        got = _forward_backward(mixer, x, layout)
    seen = {event.name.removeprefix("titan_hybrid::") for event in prof.events()}
    assert {"mamba2_core_fwd", "mamba2_core_bwd"} <= seen
    # the conv and the scan run inside the core, not as their own ops
    assert not seen & {"mamba_ssd_fwd", "causal_conv1d_fwd", "triton_causal_conv1d_fwd"}
    cats = [event.input_shapes for event in prof.events() if event.name == "aten::cat"]
    assert cats == [], cats
    assert rel_err(got[0], want[0]) < TOL
    for name, grad in want[1].items():
        assert grad.abs().max() > 0, name
        assert rel_err(got[1][name], grad) < TOL, (name, rel_err(got[1][name], grad))


def test_fused_core_under_torch_compile_fullgraph():
    mixer, x, layout = _mixer_and_inputs(documents=True)
    want = _forward_backward(mixer, x, layout)
    compiled = torch.compile(mixer, backend="aot_eager", fullgraph=True)
    with kernels_on(), expect_custom_ops("mamba2_core_fwd", "mamba2_core_bwd"):
        got = _forward_backward(mixer, x, layout, forward=compiled)
    assert rel_err(got[0], want[0]) < TOL
    for name, grad in want[1].items():
        assert rel_err(got[1][name], grad) < TOL, name


def test_a_context_parallel_core_keeps_the_ops_one_by_one():
    """A wrapper in place of conv_and_scan (what context parallelism installs) gets the conv
    and the scan as before: the fused core would bypass it."""
    mixer, x, layout = _mixer_and_inputs(documents=False)

    class Wrapper(torch.nn.Module):
        def __init__(self, core):
            super().__init__()
            self.core = core

        def forward(self, *args):
            return self.core(*args)

    mixer.conv_and_scan = Wrapper(mixer.conv_and_scan)
    with kernels_on(), expect_custom_ops("mamba_ssd_fwd", not_run=("mamba2_core_fwd",)):
        _forward_backward(mixer, x, layout)

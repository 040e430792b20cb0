"""Copies per Mamba2 / gated DeltaNet layer on the kernel path: the copy_, cat and dtype-cast
(_to_copy) ops of one forward and one backward, outside the kernels' own custom ops, under bf16
autocast with fp32 parameters (how torchtitan runs one GPU). Each op is a full pass over memory
on a GPU; the table below is what the layers need, so a new copy fails this test.

Kernels run in Triton's interpreter on CPU, causal-conv1d through its stand-in (tests/stand_ins,
tests/triton_kernels.py); on CUDA for real.

Before this table (commit 9a19296, whose conv took the torch path; forward / backward):
    Mamba2  copy_ 7 / 7, _to_copy 5 / 5, cat 0 / 2
    GDN     copy_ 14 / 14, _to_copy 10 / 11, cat 0 / 2
and before Mamba2's fused core (titan_hybrid.ops.mamba_core, issue 46): Mamba2 copy_ 4 / 3,
_to_copy 3 / 3, cat 0 / 2.
"""

import collections

import pytest
import torch

from tests.triton_kernels import DEVICE, kernels_on
from titan_hybrid.model.gdn import GatedDeltaNet, GDNArgs
from titan_hybrid.model.mamba import Mamba2Mixer, MambaArgs

COPY_OPS = ("aten::copy_", "aten::cat", "aten::_to_copy")
# Both layers: autocast casts in_proj's and out_proj's weights and the layer input to bf16
# (3 casts forward; their gradients cast back, 3 backward). Mamba2's core is one op pair whose
# backward writes in_proj's gradient in place (no cat; with causal-conv1d its conv input is made
# dense inside the op, our Triton conv reads it in place). GDN: the gradients of the two splits
# (in_proj's output, the conv's output) are one cat each; the conv input (a slice of in_proj's
# output) is made dense, since the kernel returns channels-last only for dense input, plus q / k / v made contiguous for fla, the decay input alpha upcast to fp32
# (forward and its gradient back), and the norm weight shared by the heads expanded to one per
# channel for the norm kernel.
EXPECTED = {
    "mamba": {"fwd copy_": 3, "fwd _to_copy": 3, "bwd copy_": 3, "bwd _to_copy": 3},
    "gdn": {"fwd copy_": 9, "fwd _to_copy": 4, "bwd copy_": 4, "bwd _to_copy": 4, "bwd cat": 2},
}


def _layers():
    return {
        "mamba": Mamba2Mixer(dim=64, args=MambaArgs(d_state=16, head_dim=16, n_groups=2,
                                                    chunk_size=16)),
        "gdn": GatedDeltaNet(dim=64, args=GDNArgs(key_head_dim=16, value_head_dim=16,
                                                  n_key_heads=2, n_value_heads=4)),
    }


def _inside_custom_op(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("titan_hybrid::"):
            return True
        parent = parent.cpu_parent
    return False


def _phase(event) -> str:
    while event is not None:
        if event.name.startswith("autograd::engine::evaluate_function"):
            return "bwd"
        event = event.cpu_parent
    return "fwd"


def count_copies(layer: torch.nn.Module, x: torch.Tensor) -> dict[str, int]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            y = layer(x)
        y.backward(torch.ones_like(y))
    counts = collections.Counter(
        f"{_phase(event)} {event.name.removeprefix('aten::')}" for event in profile.events()
        if event.name in COPY_OPS and not _inside_custom_op(event))
    return dict(counts)


@pytest.mark.triton_interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's bf16 dots (values unused)
@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_copies_per_layer_on_the_kernel_path(kind):
    torch.manual_seed(0)
    layer = _layers()[kind].to(DEVICE)
    with torch.no_grad():
        layer.init_weights(init_std=0.02, out_std=0.02)
    x = torch.randn(2, 64, 64, device=DEVICE, requires_grad=True)
    with kernels_on():
        counts = count_copies(layer, x)
    print(f"\n{kind}: {counts}")
    assert counts == EXPECTED[kind]

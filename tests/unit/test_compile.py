"""torch.compile of HybridModel (titan_hybrid.parallel.compile), in this process.

Backend "aot_eager": dynamo's capture with fullgraph plus AOTAutograd's joint graph, which is
what our code decides (graph breaks, custom autograd functions, hooks traced into a unit); its
kernels are eager ones, so outputs and gradients must equal eager mode bit for bit. Inductor's
code generation is exercised by the trainer tests (tests/distributed/test_compile.py).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters
from torchtitan.config.job_config import Compile

from titan_hybrid.model.args import hybrid_flavors
from titan_hybrid.model.model import HybridModel
from titan_hybrid.parallel.compile import apply_compile

AOT = Compile(enable=True, backend="aot_eager")


def tiny_model(pattern: str) -> HybridModel:
    args = dataclasses.replace(copy.deepcopy(hybrid_flavors["debug"]), pattern=pattern, dim=64,
                               vocab_size=128, max_seq_len=64)
    torch.manual_seed(0)
    model = HybridModel(args)
    model.init_weights()
    return model


def loss_and_grads(model, tokens, **layout):
    out = model(tokens, **layout)
    outputs = out if isinstance(out, tuple) else (out,)  # logits, aux loss, MTP logits
    loss = sum(value.float().square().mean() for value in outputs)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


# pattern -> graphs dynamo compiles: one per unit; a MoE layer gives three (its norm, router
# and shared expert) and runs its expert dispatch eagerly. Groups and MoE are also compiled by
# the slow trainer tests (tests/distributed/test_compile.py), so here they are slow too.
CASES = {"M*G-": 4, "M+D-": 4, "[M*][G-]": 2, "M*E/-": 6}
SLOW_CASES = ("[M*][G-]", "M*E/-")


@pytest.mark.parametrize("pattern", [
    pytest.param(pattern, marks=pytest.mark.slow) if pattern in SLOW_CASES
    else pytest.param(pattern, marks=pytest.mark.extended) if pattern == "M+D-" else pattern
    for pattern in CASES])
def test_compiled_units_match_eager_bitwise(pattern):
    eager = tiny_model(pattern)
    compiled = copy.deepcopy(eager)
    names = list(compiled.state_dict())
    torch._dynamo.reset()
    counters.clear()
    apply_compile(compiled, AOT)
    assert list(compiled.state_dict()) == names  # checkpoint keys untouched
    tokens = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(1))
    loss, grads = loss_and_grads(eager, tokens)
    compiled_loss, compiled_grads = loss_and_grads(compiled, tokens)
    assert counters["stats"]["unique_graphs"] == CASES[pattern]
    assert not counters["graph_break"]
    assert torch.equal(compiled_loss, loss)
    for name, grad in grads.items():
        if "/" in pattern:
            # With MTP the hidden state and the embedding feed several branches; autograd may
            # sum their gradients in another order when the branches are compiled.
            torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-5,
                                       atol=1e-5 * grad.abs().max().item())
        else:
            assert torch.equal(compiled_grads[name], grad), name


@pytest.mark.extended
def test_split_precision_compiles_mamba_and_gdn_in_parts():
    """Under bf16 data parallelism their projections are FSDP units inside the layer: the layer
    norm, the sequence core and the gated norm are compiled instead of the whole layer."""
    eager = tiny_model("M*G-")
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    counters.clear()
    apply_compile(compiled, AOT, split_precision=True)
    tokens = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(3))
    loss, grads = loss_and_grads(eager, tokens)
    compiled_loss, compiled_grads = loss_and_grads(compiled, tokens)
    # M: layer norm, core, gated norm; *; G: its core and gated norm (its layer norm reuses
    # M's graph: same code and shapes, the weight is an input); -
    assert counters["stats"]["unique_graphs"] == 3 + 1 + 2 + 1
    assert not counters["graph_break"]
    assert torch.equal(compiled_loss, loss)
    # The residual stream now feeds compiled and eager parts, whose gradients autograd may sum
    # in another order: float32 rounding, not bitwise.
    for name, grad in grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-5,
                                   atol=1e-5 * grad.abs().max().item())


def test_packed_documents_compile_for_every_sequence_mixer():
    """Mamba2, attention and gated DeltaNet (its delta rule masks documents inside chunks, no
    lengths read on the host) with packed documents: one graph per layer, the eager numbers."""
    eager = tiny_model("M*G-")
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    counters.clear()
    apply_compile(compiled, AOT)
    tokens = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(2))
    # Row 0: documents of 20, 16 and 12 tokens; row 1: one document.
    seq_idx = torch.tensor([[0] * 20 + [1] * 16 + [2] * 12, [0] * 48])
    starts = torch.tensor([[0] * 20 + [20] * 16 + [36] * 12, [0] * 48])
    positions = torch.arange(48).expand(2, 48) - starts
    layout = dict(positions=positions, seq_idx=seq_idx)
    loss, grads = loss_and_grads(eager, tokens, **layout)
    compiled_loss, compiled_grads = loss_and_grads(compiled, tokens, **layout)
    assert counters["stats"]["unique_graphs"] == 4
    assert not counters["graph_break"]
    assert torch.equal(compiled_loss, loss)
    for name, grad in grads.items():
        assert torch.equal(compiled_grads[name], grad), name


@pytest.mark.parametrize("expert_parallel", [False, pytest.param(True, marks=pytest.mark.extended)])
def test_moe_is_one_graph_in_bf16_without_expert_parallelism(expert_parallel):
    """In bf16 (grouped_mm traces there) and without EP's host-side dispatch, a MoE layer is
    one graph, its grouped GEMMs included; with EP (or in fp32, the test above) it compiles
    its norm and router and runs the experts eagerly."""
    eager = tiny_model("M*E-").to(torch.bfloat16)
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    counters.clear()
    apply_compile(compiled, AOT, bf16_compute=True, expert_parallel=expert_parallel)
    tokens = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(1))
    loss, grads = loss_and_grads(eager, tokens)
    compiled_loss, compiled_grads = loss_and_grads(compiled, tokens)
    # one graph per layer; under EP the MoE layer's norm, router and shared expert instead
    assert counters["stats"]["unique_graphs"] == (6 if expert_parallel else 4)
    assert not counters["graph_break"]
    assert torch.equal(compiled_loss, loss)
    for name, grad in grads.items():
        assert torch.equal(compiled_grads[name], grad), name

"""The `K` mixer (model/kda.py) against transformers' own KimiLinearDeltaAttention (and
Glm5NextTextLinearAttention for the bounded gate), on tiny random weights copied across:
outputs and every parameter's gradient; its declared layouts; the full-rank variant."""

from __future__ import annotations

import pytest
import torch

from titan_hybrid.model.kda import KDAArgs, KimiDeltaAttention

transformers = pytest.importorskip("transformers")
from transformers.models.kimi_linear import modeling_kimi_linear  # noqa: E402
from transformers.models.kimi_linear.configuration_kimi_linear import (  # noqa: E402
    KimiLinearConfig,
)

DIM, HEADS, HEAD_DIM, WIDTH = 64, 2, 16, 4
TINY = dict(vocab_size=256, hidden_size=DIM, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
            q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
            num_experts=8, num_experts_per_token=2, num_shared_experts=1, n_group=1,
            topk_group=1, first_k_dense_replace=1, rms_norm_eps=1e-5, pad_token_id=0,
            bos_token_id=1, eos_token_id=2,
            linear_attn_config=dict(num_heads=HEADS, head_dim=HEAD_DIM,
                                    short_conv_kernel_size=WIDTH, kda_layers=[1],
                                    full_attn_layers=[2]))


def theirs_to_ours(theirs: torch.nn.Module, ours: KimiDeltaAttention) -> None:
    """transformers' in-memory names (a fused conv1d, forget_gate.*, A_log [1, 1, H, 1]) onto
    ours (Kimi's checkpoint names)."""
    state = dict(theirs.state_dict())
    conv = state.pop("conv1d.weight")
    for name, part in zip("qkv", conv.chunk(3)):
        state[f"{name}_conv1d.weight"] = part
    for name in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log"):
        state[name] = state.pop(f"forget_gate.{name}")
    state["A_log"] = state["A_log"].flatten()
    ours.load_state_dict(state)


def run(module, x, **kwargs):
    x = x.detach().clone().requires_grad_()
    out = module(x, **kwargs)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7),
                             dtype=out.dtype))
    return out, x.grad


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_kda_equals_transformers_kimi_linear_delta_attention():
    """Forward and backward (the input's and every weight's gradient), a 150-token row (three
    chunks): the module math, the per-channel gate, the sigmoid-gated norm. transformers' torch
    path runs its delta rule in float32 whatever the input (ours keeps float64): measured
    7.4e-7 apart."""
    torch.manual_seed(0)
    config = KimiLinearConfig(**TINY)
    theirs = modeling_kimi_linear.KimiLinearDeltaAttention(config, layer_idx=0).double()
    for param in theirs.parameters():
        torch.nn.init.normal_(param, std=0.2)
    ours = KimiDeltaAttention(dim=DIM, args=KDAArgs(head_dim=HEAD_DIM, n_heads=HEADS,
                                                    conv_width=WIDTH),
                              norm_eps=1e-5).double()
    theirs_to_ours(theirs, ours)
    x = torch.randn(2, 150, DIM, dtype=torch.float64)
    out_ours, dx_ours = run(ours, x)
    out_theirs, dx_theirs = run(theirs, x)
    assert rel(out_ours, out_theirs) < 1e-5
    assert rel(dx_ours, dx_theirs) < 1e-5
    theirs_grads = dict(theirs.named_parameters())
    conv = theirs_grads["conv1d.weight"].grad.chunk(3)
    for name, param in ours.named_parameters():
        if name.endswith("_conv1d.weight"):
            want = conv["qkv".index(name[0])]
        else:
            key = f"forget_gate.{name}" if name.split(".")[0] in (
                "f_a_proj", "f_b_proj", "dt_bias", "A_log") else name
            want = theirs_grads[key].grad.reshape(param.shape)
        assert rel(param.grad, want) < 1e-5, name


def test_the_bounded_gate_equals_glm5_next():
    """gate_lower_bound: GLM-5.3-Flash's g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias)),
    against transformers' Glm5NextTextLinearAttention (the same layer otherwise)."""
    glm = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
    config_module = pytest.importorskip(
        "transformers.models.glm5_next.configuration_glm5_next")
    config_class = next(getattr(config_module, name) for name in dir(config_module)
                        if name.endswith("TextConfig"))
    fields = {"hidden_size": DIM, "linear_num_heads": HEADS, "linear_head_dim": HEAD_DIM,
              "linear_conv_kernel_dim": WIDTH, "linear_lower_bound": -5.0,
              "rms_norm_eps": 1e-5, "num_hidden_layers": 1}
    config = config_class(**{k: v for k, v in fields.items()
                             if k in config_class.__init__.__code__.co_varnames
                             or hasattr(config_class(), k)})
    for name, value in fields.items():
        setattr(config, name, value)
    torch.manual_seed(1)
    theirs = glm.Glm5NextTextLinearAttention(config, layer_idx=0).double()
    for param in theirs.parameters():
        torch.nn.init.normal_(param, std=0.2)
    ours = KimiDeltaAttention(dim=DIM, args=KDAArgs(head_dim=HEAD_DIM, n_heads=HEADS,
                                                    conv_width=WIDTH, gate_lower_bound=-5.0),
                              norm_eps=1e-5).double()
    theirs_to_ours(theirs, ours)
    x = torch.randn(1, 100, DIM, dtype=torch.float64)
    out_ours, dx_ours = run(ours, x)
    out_theirs, dx_theirs = run(theirs, x)
    assert rel(out_ours, out_theirs) < 1e-5
    assert rel(dx_ours, dx_theirs) < 1e-5


def test_full_rank_gates_are_megatrons_layout():
    """low_rank_gates=False: f_proj and g_proj map the hidden state to H*K channels directly;
    with f_proj = f_b f_a (and the same for g) it computes what the low-rank layer does."""
    torch.manual_seed(2)
    args = KDAArgs(head_dim=HEAD_DIM, n_heads=HEADS, conv_width=WIDTH)
    low = KimiDeltaAttention(dim=DIM, args=args).double()
    with torch.no_grad():
        low.init_weights(init_std=0.1, out_std=0.1)
    full = KimiDeltaAttention(dim=DIM, args=KDAArgs(head_dim=HEAD_DIM, n_heads=HEADS,
                                                    conv_width=WIDTH, low_rank_gates=False))
    full = full.double()
    state = {k: v for k, v in low.state_dict().items()
             if not k.startswith(("f_a", "f_b", "g_a", "g_b"))}
    state["f_proj.weight"] = low.f_b_proj.weight @ low.f_a_proj.weight
    state["g_proj.weight"] = low.g_b_proj.weight @ low.g_a_proj.weight
    full.load_state_dict(state)
    x = torch.randn(1, 70, DIM, dtype=torch.float64)
    torch.testing.assert_close(full(x), low(x), atol=1e-12, rtol=1e-10)
    assert full.f_proj.weight.shape == (HEADS * HEAD_DIM, DIM)


@pytest.mark.parametrize("gate_lower_bound", [0.0, pytest.param(-5.0, marks=pytest.mark.extended)])
def test_the_layer_compiles_as_one_graph(gate_lower_bound):
    """fullgraph (aot_eager), forward and backward equal to eager bit for bit; with the op's
    strided gradients flowing back through the gate."""
    torch.manual_seed(3)
    layer = KimiDeltaAttention(dim=DIM, args=KDAArgs(head_dim=HEAD_DIM, n_heads=HEADS,
                                                     gate_lower_bound=gate_lower_bound))
    with torch.no_grad():
        layer.init_weights(init_std=0.1, out_std=0.1)
    x = torch.randn(2, 70, DIM)
    eager = run(layer, x)
    eager_grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    compiled = run(torch.compile(layer, backend="aot_eager", fullgraph=True), x)
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)
    for param, grad in zip(layer.parameters(), eager_grads):
        assert torch.equal(param.grad, grad)

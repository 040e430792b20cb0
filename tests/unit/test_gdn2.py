"""GDN2's core (ops/gdn2.py) against a float64 step-by-step reference written from the
recurrence (Megatron's GatedDeltaNet2, fla's naive GDN2):

    S_t = (I - k_t (b_t * k_t)^T) Diag(exp(g_t)) S_{t-1} + k_t (w_t * v_t)^T
    o_t = S_t^T (scale * q_t)

with L2-normed queries and keys, strong decays (a chunk's cumulative decay far past e^-88, which
the sub-chunks keep from overflowing), packed documents and an initial state: the output, the
final state and every input gradient. With b = w = beta it is KDA's op.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_gdp import assert_mixer_is_the_reference
from titan_hybrid.ops.gdn2 import chunk_gdn2
from titan_hybrid.ops.kda import chunk_kda_torch

B, T, H, K, V = 2, 150, 2, 8, 6


def reference(q, k, v, g, b, w, initial_state, seq_idx):
    q, k = (x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6) for x in (q, k))  # fla's
    state, outputs = initial_state, []
    for t in range(T):
        if t:
            starts = (seq_idx[:, t] != seq_idx[:, t - 1]).to(state.dtype)
            state = state * (1 - starts)[:, None, None, None]  # a document starts
        state = torch.exp(g[:, t])[..., None] * state
        erased = torch.einsum("bhk,bhkv->bhv", b[:, t] * k[:, t], state)
        state = state + k[:, t, ..., None] * (w[:, t] * v[:, t] - erased)[..., None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t] * K ** -0.5))
    return torch.stack(outputs, 1), state


def inputs(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    q, k, v = rand(B, T, H, K), rand(B, T, H, K), rand(B, T, H, V)
    g = -2 * torch.rand(B, T, H, K, generator=generator, dtype=torch.float64)  # ~e^-64 a chunk
    b = 2 * torch.rand(B, T, H, K, generator=generator, dtype=torch.float64)
    w = torch.rand(B, T, H, V, generator=generator, dtype=torch.float64)
    seq_idx = torch.tensor([[0] * 70 + [1] * 80, [0] * 3 + [1] * 147])
    return (q, k, v, g, b, w, rand(B, H, K, V)), seq_idx


def test_forward_final_state_and_every_gradient_match_the_float64_recurrence():
    tensors, seq_idx = inputs()
    ours = [x.clone().requires_grad_() for x in tensors]
    theirs = [x.clone().requires_grad_() for x in tensors]
    o, final = chunk_gdn2(*ours[:6], initial_state=ours[6], output_final_state=True,
                          use_qk_l2norm_in_kernel=True, seq_idx=seq_idx)
    o_ref, final_ref = reference(*theirs[:6], theirs[6], seq_idx)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, final_ref, rtol=1e-10, atol=1e-10)
    weights = torch.randn_like(o_ref), torch.randn_like(final_ref)
    ((o * weights[0]).sum() + (final * weights[1]).sum()).backward()
    ((o_ref * weights[0]).sum() + (final_ref * weights[1]).sum()).backward()
    for name, mine, expected in zip("q k v g b w initial".split(), ours, theirs, strict=True):
        torch.testing.assert_close(mine.grad, expected.grad, rtol=1e-9, atol=1e-9, msg=name)


def test_equal_erase_and_write_gates_are_kda():
    (q, k, v, g, _, _, initial), seq_idx = inputs(seed=1)
    beta = torch.rand(B, T, H, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    gdn2 = chunk_gdn2(q, k, v, g, beta[..., None].expand(-1, -1, -1, K),
                      beta[..., None].expand(-1, -1, -1, V), initial_state=initial,
                      output_final_state=True, use_qk_l2norm_in_kernel=True, seq_idx=seq_idx)
    kda = chunk_kda_torch(q, k, v, g, beta, initial_state=initial, output_final_state=True,
                          use_qk_l2norm_in_kernel=True, seq_idx=seq_idx)
    torch.testing.assert_close(gdn2, kda, rtol=1e-12, atol=1e-12)


def test_gates_of_the_wrong_shape_are_named():
    (q, k, v, g, b, w, _), _ = inputs()
    with pytest.raises(ValueError, match=r"GDN2's decay and erase gate are per key channel"):
        chunk_gdn2(q, k, v, g, b[..., :1], w)
    with pytest.raises(ValueError, match=r"must both be \[B, T, H, V\]"):
        chunk_gdn2(q, k, v, g, b, w[..., :1])


def test_packed_documents_compile_with_fullgraph():
    tensors, seq_idx = inputs(seed=3)
    tensors = [x.float() for x in tensors[:6]]

    def run(q, k, v, g, b, w, seq_idx):
        return chunk_gdn2(q, k, v, g, b, w, use_qk_l2norm_in_kernel=True, seq_idx=seq_idx)[0]

    compiled = torch.compile(run, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(*tensors, seq_idx), run(*tensors, seq_idx))



@pytest.mark.triton_interpreter
def test_fla_kernel_under_compile_matches_the_torch_path():
    """fla's chunk_gdn2 kernels through our custom ops, compiled whole (fullgraph), against the
    torch path: rows of 150 tokens (three chunks, the last partial) laid end to end as
    documents (starts inside and at chunk edges), l2norm in the kernel, initial and final
    states; every output and input gradient, float32 (relative Frobenius error < 2e-5 in
    Triton's interpreter, 5e-3 on CUDA's tf32 dots; measured 1.8e-6 here)."""

    from tests.triton_kernels import (
        DEVICE,
        INTERPRETED,
        assert_close_rel,
        expect_custom_ops,
        kernels_on,
        outputs_and_grads,
    )

    gen = torch.Generator().manual_seed(7)
    rows, T_kernel, H_kernel, K_kernel = 2, 150, 2, 16

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    fused = rand(rows, T_kernel, H_kernel, 3 * K_kernel).to(DEVICE)
    q, k, v = fused.split(K_kernel, -1)  # views, as the mixer passes them
    tensors = dict(q=3 * q, k=2.5 * k, v=v,
                   g=-torch.nn.functional.softplus(rand(rows, T_kernel, H_kernel, K_kernel)),
                   b=torch.sigmoid(rand(rows, T_kernel, H_kernel, K_kernel)),
                   w=torch.sigmoid(rand(rows, T_kernel, H_kernel, K_kernel)),
                   initial_state=rand(rows, H_kernel, K_kernel, K_kernel))
    tensors = {name: x.to(DEVICE) for name, x in tensors.items()}
    packed = [[0] * 40 + [1] * 70 + [2] * 40, [3] * 64 + [4] * 86]
    kwargs = dict(output_final_state=True, use_qk_l2norm_in_kernel=True,
                  seq_idx=torch.tensor(packed, device=DEVICE))
    compiled = torch.compile(chunk_gdn2, backend="aot_eager", fullgraph=True)
    with kernels_on(), expect_custom_ops("fla_gdn2_fwd", "fla_gdn2_bwd"):
        got = outputs_and_grads(compiled, tensors, **kwargs)
    assert type(got[0][0].grad_fn).__name__ == "CompiledFunctionBackward"
    want = outputs_and_grads(chunk_gdn2, tensors, **kwargs)
    worst = assert_close_rel(got, want, 2e-5 if INTERPRETED else 5e-3, "compiled fla gdn2")
    print(f"fla gdn2 worst relative error {worst:.2e}")


# ---- the mixer (model/gdn2.py), what `G` builds under g_layers = "gdn2"
DIM, STEPS = 24, 11


def _mixer(seed: int):
    from titan_hybrid.model.gdn import GDNArgs
    from titan_hybrid.model.gdn2 import GatedDeltaNet2

    torch.manual_seed(seed)
    layer = GatedDeltaNet2(dim=DIM, args=GDNArgs(key_head_dim=4, value_head_dim=6, n_key_heads=2,
                                                 n_value_heads=4)).double()
    with torch.no_grad():
        layer.init_weights(init_std=0.2, out_std=0.2)
        for param in layer.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return layer


def megatron_gdn2(layer, x):
    """Megatron's GatedDeltaNet2 forward from its equations, float64."""
    import torch.nn.functional as F

    args = layer.args
    hk, hv, dk, dv = args.n_key_heads, args.n_value_heads, args.key_head_dim, args.value_head_dim
    q, k, v, z, f, b, w = (x @ layer.in_proj.weight.T).split(
        [hk * dk, hk * dk, hv * dv, hv * dv, hk * dk, hk * dk, hv * dv], -1)
    qkv = torch.cat((q, k, v), -1)
    width = layer.conv1d.weight.shape[-1]
    qkv = F.silu(F.conv1d(F.pad(qkv.transpose(1, 2), (width - 1, 0)), layer.conv1d.weight,
                          groups=qkv.shape[-1]).transpose(1, 2))
    q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], -1)
    rep = hv // hk

    def heads(t):  # per key head -> per value head
        return t.unflatten(-1, (hk, dk)).repeat_interleave(rep, dim=2)

    q, k = (t * torch.rsqrt(t.square().sum(-1, keepdim=True) + 1e-6) for t in (heads(q), heads(k)))
    g = heads(-torch.exp(layer.A_log).repeat_interleave(dk) * F.softplus(f + layer.dt_bias))
    erase, write = heads(torch.sigmoid(b)), torch.sigmoid(w).unflatten(-1, (hv, dv))
    v = v.unflatten(-1, (hv, dv))
    state = torch.zeros(x.shape[0], hv, dk, dv, dtype=torch.float64)
    out = []
    for t in range(x.shape[1]):
        state = torch.exp(g[:, t])[..., None] * state
        read = torch.einsum("bhk,bhkv->bhv", erase[:, t] * k[:, t], state)
        state = state + k[:, t, ..., None] * (write[:, t] * v[:, t] - read)[..., None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t] * dk ** -0.5))
    o = torch.stack(out, 1)
    normed = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + layer.norm.eps)
    y = normed * layer.norm.weight * F.silu(z.unflatten(-1, (hv, dv)))
    return y.flatten(-2) @ layer.out_proj.weight.T


def test_the_mixer_is_megatrons_gdn2_forward_and_backward():
    x = torch.randn(2, STEPS, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    assert_mixer_is_the_reference(_mixer(0), _mixer(0), megatron_gdn2, x)


def test_g_builds_gdn2_only_when_the_option_says_so():
    import dataclasses

    from titan_hybrid.hf.families import check_hf_compatible
    from titan_hybrid.model.args import hybrid_flavors
    from titan_hybrid.model.gdn2 import KIND, GatedDeltaNet2
    from titan_hybrid.model.model import HybridModel

    args = hybrid_flavors["debug_gdn2"]
    model = HybridModel(args)
    assert type(model.layers["0"].mixer) is GatedDeltaNet2 and KIND.name == "gdn2"
    assert list(model.layers["0"].mixer.fused_parts["in_proj.weight"]) == [
        ".query", ".key", ".value", ".z", ".f", ".b", ".w"]  # Megatron's split names
    plain = HybridModel(dataclasses.replace(args, g_layers="gdn"))
    assert type(plain.layers["0"].mixer).__name__ == "GatedDeltaNet"
    with pytest.raises(ValueError, match=r"^g_layers='kda' is not one of \['gdn', 'gdn2'\]"):
        dataclasses.replace(args, g_layers="kda").validate()
    with pytest.raises(ValueError, match=r"^gated DeltaNet-2 layers \(m_layers='mamba2', "
                                         r"g_layers='gdn2'\) are held by none"):
        check_hf_compatible(args)


def test_mfu_counts_the_ops_matmuls():
    """GDN2's core FLOPs (GDN's and KDA's count: the gates are elementwise) are what torch's FLOP
    counter sees the op's forward do per token, within the sub-chunk split's extra (KDA's)."""
    from torch.utils.flop_counter import FlopCounterMode

    from titan_hybrid.model.gdn import GDNArgs
    from titan_hybrid.model.gdn2 import KIND

    tokens, heads, dim = 256, 2, 32
    q, k, g, b = (torch.randn(1, tokens, heads, dim) for _ in range(4))
    v, w = torch.randn(1, tokens, heads, dim), torch.rand(1, tokens, heads, dim)
    with FlopCounterMode(display=False) as counter:
        chunk_gdn2(q, k, v, -g.abs(), b.sigmoid(), w, use_qk_l2norm_in_kernel=True)
    counted = counter.get_total_flops() / tokens
    declared = KIND.core_flops(GDNArgs(key_head_dim=dim, value_head_dim=dim, n_key_heads=heads,
                                       n_value_heads=heads), 64, tokens)
    assert declared <= counted <= 1.05 * declared

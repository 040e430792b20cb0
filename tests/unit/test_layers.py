"""Single layers (Mamba2, gated DeltaNet, attention, SwiGLU, MoE) against independent references.

Every reference below is written from REFERENCE.md sections 2-4 with explicit loops / textbook
formulas and shares no code with titan_hybrid (no ops.ssd, ops.gated_delta or ops.conv). Modules
and references run in float64, forward and parameter gradients, at atol = rtol = 1e-10 (observed
errors ~1e-15). Packed documents (seq_idx) are checked against running each document alone.
Parameter annotations (what the tensor-parallel plan reads) are checked last.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from titan_hybrid.model.args import (
    AttentionArgs,
    GDNArgs,
    MambaArgs,
    MLPArgs,
    MoEArgs,
    hybrid_flavors,
)
from titan_hybrid.model.attention import Attention
from titan_hybrid.model.common import TPLayout, tensor_parallel_layouts
from titan_hybrid.model.gdn import GatedDeltaNet
from titan_hybrid.model.layout import TokenLayout
from titan_hybrid.model.mamba import Mamba2Mixer
from titan_hybrid.model.mlp import SwiGLU
from titan_hybrid.model.moe import MoE
from titan_hybrid.model.rotary import rotary_tables

F64 = dict(atol=1e-10, rtol=1e-10)
DIM = 32


def tiny_args(**changes):
    """The debug flavor with tiny dims. K != V for GDN and n_groups > 1 for Mamba so that
    mixed-up sizes or groupings show up as shape errors or wrong numbers."""
    base = dataclasses.replace(
        hybrid_flavors["debug"], dim=DIM, vocab_size=64, max_seq_len=128,
        attention=AttentionArgs(n_heads=4, n_kv_heads=2, head_dim=8, rope_theta=500.0),
        mlp=MLPArgs(hidden_dim=24),
        # d_inner 64, 8 heads, 2 groups of 4 heads; chunk 8 < T so the scan crosses chunks.
        mamba=MambaArgs(d_state=4, head_dim=8, n_groups=2, chunk_size=8),
        gdn=GDNArgs(key_head_dim=8, value_head_dim=6, n_key_heads=2, n_value_heads=4),
        moe=MoEArgs(num_experts=4, top_k=2, hidden_dim=12, shared_expert_hidden_dim=10,
                    aux_loss_coeff=0.37),
    )
    return dataclasses.replace(base, **changes)


@torch.no_grad()
def randomize_(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """float64 and random values for EVERY parameter (norm weights, D, conv bias included), so a
    parameter that is ignored or used in the wrong place changes the result."""
    torch.manual_seed(seed)
    module.double()
    for name, param in module.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":  # A in [-2, -0.5]: decays that neither vanish nor stay at 1
            param.copy_(torch.empty_like(param).uniform_(math.log(0.5), math.log(2.0)))
        elif leaf == "dt_bias":  # softplus(dt) around 0.1 .. 1
            param.copy_(torch.randn_like(param) * 0.5 - 1.0)
        elif name.endswith("norm.weight"):
            param.copy_(1.0 + 0.3 * torch.randn_like(param))
        else:
            param.copy_(torch.randn_like(param) * 0.3)
    return module


def grads_of(module, fn, *inputs):
    """fn(*inputs) and the gradients of sum(out * probe) w.r.t. module params and inputs."""
    module.zero_grad(set_to_none=True)
    inputs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*inputs)
    probe = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(7))
    (out * probe).sum().backward()
    param_grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    input_grads = [x.grad for x in inputs if x.is_floating_point()]
    module.zero_grad(set_to_none=True)
    return out.detach(), param_grads, input_grads


def assert_same_fn(module, fn_module, fn_ref, *inputs):
    """Module and reference agree on the output and on every gradient."""
    out, pgrads, igrads = grads_of(module, fn_module, *inputs)
    ref, ref_pgrads, ref_igrads = grads_of(module, fn_ref, *inputs)
    torch.testing.assert_close(out, ref, **F64)
    assert pgrads.keys() == ref_pgrads.keys()
    for name in pgrads:
        torch.testing.assert_close(pgrads[name], ref_pgrads[name], **F64, msg=name)
        assert pgrads[name].abs().sum() > 0, f"{name} got no gradient"
    for got, want in zip(igrads, ref_igrads):
        torch.testing.assert_close(got, want, **F64)


# ------------------------------------------------------------------------- naive references


def naive_causal_conv_silu(x_BTC, weight_CW, bias_C):
    """Depthwise causal conv by its definition: out[t] = b + sum_j w[j] * x[t - (W-1) + j]."""
    batch, seq_len, channels = x_BTC.shape
    width = weight_CW.shape[1]
    outs = []
    for t in range(seq_len):
        acc = x_BTC.new_zeros(batch, channels) if bias_C is None else bias_C.expand(batch, -1)
        for j in range(width):
            src = t - (width - 1) + j
            if src >= 0:
                acc = acc + weight_CW[:, j] * x_BTC[:, src]
        outs.append(F.silu(acc))
    return torch.stack(outs, dim=1)


def naive_rms(x, weight, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def naive_mamba2(m: Mamba2Mixer, x_BTD):
    """REFERENCE.md section 2 with explicit loops (per time step, per head)."""
    a = m.args
    d_inner, n_heads, P, G, N = m.d_inner, m.n_heads, a.head_dim, a.n_groups, a.d_state
    batch, seq_len, _ = x_BTD.shape
    proj = x_BTD @ m.in_proj.weight.T
    sizes = [d_inner, d_inner, G * N, G * N, n_heads]
    assert proj.shape[-1] == sum(sizes)
    z, xs, Bm, Cm, dt = proj.split(sizes, dim=-1)
    conv = naive_causal_conv_silu(torch.cat([xs, Bm, Cm], -1), m.conv1d.weight[:, 0, :],
                                  m.conv1d.bias)
    xs, Bm, Cm = conv.split([d_inner, G * N, G * N], dim=-1)
    dt = F.softplus(dt + m.dt_bias)
    A = -torch.exp(m.A_log)
    heads_per_group = n_heads // G
    state = x_BTD.new_zeros(batch, n_heads, P, N)
    ys = []
    for t in range(seq_len):
        y_heads = []
        new_state = []
        for h in range(n_heads):
            g = h // heads_per_group
            x_bp = xs[:, t, h * P:(h + 1) * P]
            B_bn = Bm[:, t, g * N:(g + 1) * N]
            C_bn = Cm[:, t, g * N:(g + 1) * N]
            dt_b = dt[:, t, h]
            s = (torch.exp(dt_b * A[h])[:, None, None] * state[:, h]
                 + dt_b[:, None, None] * x_bp[:, :, None] * B_bn[:, None, :])
            new_state.append(s)
            y_heads.append((s * C_bn[:, None, :]).sum(-1) + m.D[h] * x_bp)
        state = torch.stack(new_state, dim=1)
        ys.append(torch.cat(y_heads, dim=-1))
    y = torch.stack(ys, dim=1)  # [B, T, d_inner]
    gated = y * F.silu(z)
    group = d_inner // G
    normed = torch.cat([naive_rms(gated[..., i * group:(i + 1) * group],
                                  m.norm.weight[i * group:(i + 1) * group], m.norm.eps)
                        for i in range(G)], dim=-1)
    return normed @ m.out_proj.weight.T


def naive_gdn(m: GatedDeltaNet, x_BTD):
    """REFERENCE.md section 3 with an explicit per-step recurrence."""
    a = m.args
    Hk, Hv, K, V = a.n_key_heads, a.n_value_heads, a.key_head_dim, a.value_head_dim
    batch, seq_len, _ = x_BTD.shape
    proj = x_BTD @ m.in_proj.weight.T
    sizes = [Hk * K, Hk * K, Hv * V, Hv * V, Hv, Hv]
    assert proj.shape[-1] == sum(sizes)
    q, k, v, z, beta, alpha = proj.split(sizes, dim=-1)
    assert m.conv1d.bias is None
    qkv = naive_causal_conv_silu(torch.cat([q, k, v], -1), m.conv1d.weight[:, 0, :], None)
    q, k, v = qkv.split([Hk * K, Hk * K, Hv * V], dim=-1)

    def l2norm(t):  # flash-linear-attention's l2norm: eps 1e-6 inside the square root
        return t / torch.sqrt(t.pow(2).sum(-1, keepdim=True) + 1e-6)

    rep = Hv // Hk
    q = l2norm(q.view(batch, seq_len, Hk, K)).repeat_interleave(rep, dim=2)
    k = l2norm(k.view(batch, seq_len, Hk, K)).repeat_interleave(rep, dim=2)
    v = v.view(batch, seq_len, Hv, V)
    z = z.view(batch, seq_len, Hv, V)
    g = -torch.exp(m.A_log) * F.softplus(alpha + m.dt_bias)  # [B, T, Hv]
    beta = torch.sigmoid(beta)
    scale = K ** -0.5
    S = x_BTD.new_zeros(batch, Hv, K, V)
    outs = []
    for t in range(seq_len):
        S = torch.exp(g[:, t])[..., None, None] * S
        k_t, v_t = k[:, t], v[:, t]
        v_new = beta[:, t, :, None] * (v_t - torch.einsum("bhkv,bhk->bhv", S, k_t))
        S = S + k_t[..., :, None] * v_new[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, scale * q[:, t]))
    o = torch.stack(outs, dim=1)  # [B, T, Hv, V]
    o = naive_rms(o, m.norm.weight, m.norm.eps) * F.silu(z)
    return o.flatten(-2) @ m.out_proj.weight.T


def rope_complex(x_BTHD, theta):
    """Rotary embedding as complex multiplication of interleaved pairs (x[2i] + i x[2i+1]),
    torchtitan llama's convention, angles in float64."""
    seq_len, head_dim = x_BTHD.shape[1], x_BTHD.shape[-1]
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(seq_len, dtype=torch.float64)[:, None] * freqs[None, :]
    rot = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    xc = torch.view_as_complex(x_BTHD.reshape(*x_BTHD.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(xc * rot).flatten(-2)


def naive_attention(m: Attention, x_BTD, theta):
    batch, seq_len, _ = x_BTD.shape
    q = (x_BTD @ m.wq.weight.T).view(batch, seq_len, m.n_heads, m.head_dim)
    k = (x_BTD @ m.wk.weight.T).view(batch, seq_len, m.n_kv_heads, m.head_dim)
    v = (x_BTD @ m.wv.weight.T).view(batch, seq_len, m.n_kv_heads, m.head_dim)
    q, k = rope_complex(q, theta), rope_complex(k, theta)
    rep = m.n_heads // m.n_kv_heads  # query head h reads kv head h // rep
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(m.head_dim)
    future = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    out = torch.einsum("bhij,bjhd->bihd", probs, v)
    return out.reshape(batch, seq_len, -1) @ m.wo.weight.T


def naive_swiglu(x, fc1_weight, fc2_weight):
    hidden = fc1_weight.shape[0] // 2
    W, V = fc1_weight[:hidden], fc1_weight[hidden:]
    return (F.silu(x @ W.T) * (x @ V.T)) @ fc2_weight.T


def naive_moe(m: MoE, x_BTD):
    """Per-token loop: scores, top-k, sum of weight * expert(x), plus the shared expert; and the
    load-balancing loss coeff * E * sum_e f_e * P_e."""
    a = m.args
    x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
    outs, probs, counts = [], [], torch.zeros(a.num_experts, dtype=torch.float64)
    for x in x_ND:
        logits = m.router.gate.weight @ x
        if a.score_func == "softmax":
            p = torch.softmax(logits, -1)
            w, idx = p.topk(a.top_k)
        else:  # sigmoid: top-k weights renormalised; aux loss on scores normalised over experts
            s = torch.sigmoid(logits)
            w, idx = s.topk(a.top_k)
            w = w / w.sum()
            p = s / s.sum()
        probs.append(p)
        out = x.new_zeros(x.shape)
        for weight, e in zip(w, idx.tolist()):
            out = out + weight * naive_swiglu(x, m.experts.fc1[e], m.experts.fc2[e])
            counts[e] += 1
        if m.shared_expert is not None:
            out = out + naive_swiglu(x, m.shared_expert.fc1.weight, m.shared_expert.fc2.weight)
        outs.append(out)
    f = counts / counts.sum()
    P = torch.stack(probs).mean(0)
    aux = a.aux_loss_coeff * a.num_experts * (f * P).sum()
    return torch.stack(outs).view_as(x_BTD), aux


# ---------------------------------------------------------------------- module vs reference


def test_mamba2_matches_naive_recurrence():
    args = tiny_args()
    m = randomize_(Mamba2Mixer(dim=DIM, args=args.mamba, norm_eps=args.norm_eps), seed=0)
    assert m.n_heads == 8 and args.mamba.n_groups == 2
    x = torch.randn(2, 19, DIM, dtype=torch.float64)  # 19: 3 chunks of 8, the last one padded
    assert_same_fn(m, m, lambda t: naive_mamba2(m, t), x)


def test_gated_deltanet_matches_naive_recurrence():
    args = tiny_args()
    m = randomize_(GatedDeltaNet(dim=DIM, args=args.gdn, norm_eps=args.norm_eps), seed=1)
    x = torch.randn(2, 70, DIM, dtype=torch.float64)  # > 64: the torch kernel's chunk length
    assert_same_fn(m, m, lambda t: naive_gdn(m, t), x)


def test_attention_matches_explicit_softmax_with_complex_rope():
    args = tiny_args()
    theta = args.attention.rope_theta
    m = randomize_(Attention(dim=DIM, args=args.attention), seed=2)
    seq_len = 11
    x = torch.randn(2, seq_len, DIM, dtype=torch.float64)
    # The module's cos/sin table, built here in float64 (rotary_tables is fp32, checked below).
    freqs = theta ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    angles = torch.arange(seq_len, dtype=torch.float64)[:, None] * freqs
    table = torch.stack((angles.cos(), angles.sin()), dim=-1)
    layout = TokenLayout(positions=None, seq_idx=None, rope_table=table)
    assert_same_fn(m, lambda t: m(t, layout), lambda t: naive_attention(m, t, theta), x)


def test_rotary_tables_match_float64_angles():
    table = rotary_tables(head_dim=8, max_seq_len=100, theta=500.0)
    assert table.shape == (100, 4, 2) and table.dtype == torch.float32
    freqs = 500.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    angles = torch.arange(100, dtype=torch.float64)[:, None] * freqs
    want = torch.stack((angles.cos(), angles.sin()), dim=-1)
    torch.testing.assert_close(table.double(), want, atol=2e-5, rtol=0)


def test_swiglu_is_fc2_of_silu_gate_times_up():
    m = randomize_(SwiGLU(dim=DIM, hidden_dim=24), seed=3)
    x = torch.randn(2, 5, DIM, dtype=torch.float64)
    assert_same_fn(m, m, lambda t: naive_swiglu(t, m.fc1.weight, m.fc2.weight), x)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("shared", [10, 0])
def test_moe_matches_per_token_loop(score_func, shared):
    moe_args = dataclasses.replace(tiny_args().moe, score_func=score_func,
                                   shared_expert_hidden_dim=shared)
    m = randomize_(MoE(dim=DIM, args=moe_args), seed=4)
    assert (m.shared_expert is None) == (shared == 0)
    x = torch.randn(3, 7, DIM, dtype=torch.float64)

    out, aux = m(x)
    ref_out, ref_aux = naive_moe(m, x)
    torch.testing.assert_close(out, ref_out, **F64)
    torch.testing.assert_close(aux, ref_aux, **F64)
    assert aux > 0
    # Gradients of output and aux loss together (the router only learns through both).
    assert_same_fn(m, lambda t: m(t)[0] + m(t)[1], lambda t: naive_moe(m, t)[0] + naive_moe(m, t)[1], x)


def test_moe_aux_loss_counts_routed_slots():
    """With a router that always picks experts 0 and 1 (softmax), f = [1/2, 1/2, 0, 0], and the
    loss is coeff * E * (P_0 + P_1) / 2: check the formula on a hand-made case."""
    moe_args = dataclasses.replace(tiny_args().moe, shared_expert_hidden_dim=0)
    m = randomize_(MoE(dim=DIM, args=moe_args), seed=5)
    with torch.no_grad():
        m.router.gate.weight.zero_()
        m.router.gate.weight[0, 0] = 3.0
        m.router.gate.weight[1, 0] = 2.0
    x = torch.randn(4, 3, DIM, dtype=torch.float64).abs()  # x[..., 0] > 0: experts 0, 1 win
    _, aux = m(x)
    logits = torch.stack([3.0 * x[..., 0], 2.0 * x[..., 0], 0 * x[..., 0], 0 * x[..., 0]], -1)
    P = logits.softmax(-1).reshape(-1, 4).mean(0)
    want = moe_args.aux_loss_coeff * 4 * (0.5 * P[0] + 0.5 * P[1])
    torch.testing.assert_close(aux, want, **F64)


# --------------------------------------------------------------------------- packed documents

PACKED_SEQ_IDX = [
    # row 0: documents of 5, 2 (shorter than the conv), 1 and 15 tokens
    [0] * 5 + [1] * 2 + [2] * 1 + [3] * 15,
    # row 1: starts with the id row 0 ended with: a row start is still a new document
    [3] * 9 + [4] * 14,
]


def _documents(seq_idx_BT):
    """(row, start, end) of every document."""
    docs = []
    for row, ids in enumerate(seq_idx_BT.tolist()):
        start = 0
        for t in range(1, len(ids) + 1):
            if t == len(ids) or ids[t] != ids[t - 1]:
                docs.append((row, start, t))
                start = t
    return docs


def _positions_in_documents(seq_idx_BT):
    positions = torch.zeros_like(seq_idx_BT)
    for row, start, end in _documents(seq_idx_BT):
        positions[row, start:end] = torch.arange(end - start)
    return positions


@pytest.mark.parametrize("layer", ["mamba", "gdn", "attention"])
def test_packed_documents_equal_separate_runs(layer):
    """seq_idx: state and conv taps never cross a document boundary, attention never looks into
    another document, and rotary positions restart, so the packed forward (and every gradient)
    equals running each document on its own."""
    args = tiny_args()
    seq_idx = torch.tensor(PACKED_SEQ_IDX)
    table = rotary_tables(head_dim=8, max_seq_len=128, theta=500.0).double()
    if layer == "mamba":
        m = randomize_(Mamba2Mixer(dim=DIM, args=args.mamba, norm_eps=args.norm_eps), seed=6)
    elif layer == "attention":
        m = randomize_(Attention(dim=DIM, args=args.attention), seed=8)
    else:
        m = randomize_(GatedDeltaNet(dim=DIM, args=args.gdn, norm_eps=args.norm_eps), seed=7)
        # > 64 tokens per row so documents also cross the GDN kernel's chunk boundary
        seq_idx = torch.tensor([[0] * 3 + [1] * 1 + [2] * 66, [2] * 40 + [5] * 30])
    docs = _documents(seq_idx)
    x = torch.randn(*seq_idx.shape, DIM, dtype=torch.float64)

    packed = TokenLayout(positions=_positions_in_documents(seq_idx), seq_idx=seq_idx,
                         rope_table=table)
    alone = TokenLayout(positions=None, seq_idx=None, rope_table=table)

    def separately(t):
        rows = [[] for _ in range(t.shape[0])]
        for row, start, end in docs:
            rows[row].append(m(t[row:row + 1, start:end], alone))
        return torch.cat([torch.cat(parts, dim=1) for parts in rows], dim=0)

    assert_same_fn(m, lambda t: m(t, packed), separately, x)
    # And the packing matters: without it the result differs.
    assert not torch.allclose(m(x, alone), m(x, packed))


# ------------------------------------------------------------------ tensor-parallel layouts


def _layout(module, name):
    return tensor_parallel_layouts(module)[name]


def _split(module, name):
    layout = _layout(module, name)
    return layout.shard_dim, layout.partition_sizes


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_declared_tensor_parallel_layouts(device):
    """Each layer module declares how TP splits its parameters, by name (on the meta model as
    torchtitan parallelises it); name heuristics would get Mamba's norm weight wrong."""
    args = tiny_args()
    a, g = args.mamba, args.gdn
    d_inner, n_heads, GN = args.mamba_d_inner, args.mamba_n_heads, a.n_groups * a.d_state
    with torch.device(device):
        mamba = Mamba2Mixer(dim=DIM, args=a)
        gdn = GatedDeltaNet(dim=DIM, args=g)
        mlp = SwiGLU(dim=DIM, hidden_dim=24)
        moe = MoE(dim=DIM, args=args.moe)

    assert _split(mamba, "in_proj.weight") == (0, (d_inner, d_inner, GN, GN, n_heads))
    assert _split(mamba, "conv1d.weight") == (0, (d_inner, GN, GN))
    assert _split(mamba, "conv1d.bias") == (0, (d_inner, GN, GN))
    for name in ("A_log", "D", "dt_bias", "norm.weight"):
        assert _layout(mamba, name) == TPLayout(0)
    assert _layout(mamba, "out_proj.weight") == TPLayout(1)
    assert mamba.A_log.dtype == torch.float32 and mamba.D.dtype == torch.float32

    key, value = g.n_key_heads * g.key_head_dim, g.n_value_heads * g.value_head_dim
    assert _split(gdn, "in_proj.weight") == (
        0, (key, key, value, value, g.n_value_heads, g.n_value_heads))
    assert _split(gdn, "conv1d.weight") == (0, (key, key, value))
    for name in ("A_log", "dt_bias"):
        assert _layout(gdn, name) == TPLayout(0)
    assert _layout(gdn, "out_proj.weight") == TPLayout(1)
    # Shared by all heads: replicated, with each rank's gradient a partial sum.
    assert gdn.norm.weight.shape == (g.value_head_dim,)
    assert _layout(gdn, "norm.weight") == TPLayout(None, partial_grad=True)

    assert _split(mlp, "fc1.weight") == (0, (24, 24))
    assert _layout(mlp, "fc2.weight") == TPLayout(1)
    hidden = args.moe.hidden_dim
    assert _split(moe, "experts.fc1") == (1, (hidden, hidden))
    assert _layout(moe, "experts.fc2") == TPLayout(2)
    # Undeclared parameters are replicated; nothing is written on the parameters.
    assert _layout(moe, "router.gate.weight") == TPLayout(None)
    for module in (mamba, gdn, mlp, moe):
        for param in module.parameters():
            assert not {"tensor_model_parallel", "partition_dim"} & set(vars(param))

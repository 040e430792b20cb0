"""Multi-latent attention (model/mla.py) and DeepSeek sparse attention (model/dsa.py).

1. float64 references written from the formulas (DeepSeek-V2 section 2.1, YaRN's NTK-by-parts,
   DeepSeek-V3.2-Exp section 2.1): per-query loops over explicit key lists, rotary embeddings as
   rotation matrices, hand-written RMSNorm / LayerNorm / softmax / KL. Output, indexer loss,
   every parameter gradient and the input gradient agree to 1e-10 relative (max |diff| /
   max |expected|; observed <= 2e-15), for plain rows and packed documents.
2. DSA's structure: the indexer learns from its own loss only; with every key kept (top-k >= T,
   or mode "dense") it is MLA; the top-k picks do not depend on the order the keys come in.
3. transformers' DeepseekV3Attention / DeepseekV32Attention load into our layers as they are and
   give the same outputs in fp32 (1e-5 relative; observed ~2e-7) and the same top-k sets; YaRN's
   frequencies, attention factor and softmax scale are transformers' numbers.
4. FLOPs against Megatron's formulas written out, and validation messages.
5. DSA's cost: the indexer scores and their target take all heads in one batched matmul (the
   count of matmul ops does not grow with the heads), and the row blocks that bound their
   memory give the one-block results to fp32 rounding.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV32Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_v32

from titan_hybrid.model import dsa, mla
from titan_hybrid.model.dsa import DeepSeekSparseAttention, DSAArgs, index_scores, top_keys
from titan_hybrid.model.layout import TokenLayout, packed_layout
from titan_hybrid.model.mla import MLAArgs, MultiLatentAttention
from titan_hybrid.model.rotary import rotary_tables

F64_TOL, F32_TOL = 1e-10, 1e-5  # relative: max |got - expected| / max |expected|
DIM, SEQ = 32, 20
PACKED = torch.tensor([0, 3, 12, 20])  # one row of three documents (3, 9, 8 tokens)
EPS = 1e-6  # DeepSeek's latent-norm and indexer LayerNorm epsilon
YARN_ATTENTION_FACTOR = dict(yarn_factor=4.0, yarn_mscale=0.707, yarn_mscale_all_dim=1.0)


def mla_fields(**changes) -> dict:
    """Tiny sizes, all different (3 heads, dn 6, dr 8, dv 5, ranks 12 / 10; 7 indexer heads of
    11), so that swapped sizes fail. rope_theta 100 and an original length of 64 put YaRN's
    ramp inside the 4 rotary frequencies (interpolation weights 0, 1/3, 2/3, 1)."""
    return dict(n_heads=3, q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=8,
                v_head_dim=5, rope_theta=100.0, yarn_original_max_position_embeddings=64) | changes


def dsa_args(**changes) -> DSAArgs:
    """7 indexer heads: a key scores exactly 0 (every head's ReLU off) with probability 2^-7,
    so exact ties at the top-k boundary are rare; the reference asserts that there is none."""
    indexer = dict(index_n_heads=7, index_head_dim=11, index_topk=4)
    return DSAArgs(**mla_fields(**(indexer | changes)))


@torch.no_grad()
def randomize_(module: torch.nn.Module, seed: int, dtype=torch.float64) -> torch.nn.Module:
    """Random values for EVERY parameter (norm weights and the indexer's LayerNorm bias too),
    so a parameter used in the wrong place changes the result."""
    torch.manual_seed(seed)
    module.to(dtype)
    for name, param in module.named_parameters():
        is_norm_weight = "norm" in name and name.endswith("weight")
        param.copy_((1.0 if is_norm_weight else 0.0) + 0.3 * torch.randn_like(param))
    return module


def token_layout(packed: bool):
    """(layout, seq_idx [B, T], positions [B, T]): two plain rows, or one row of PACKED."""
    if packed:
        seq_idx, positions = packed_layout(PACKED)
        return TokenLayout(positions, seq_idx), seq_idx, positions
    # The model's layouts carry its (`*` attention's) rotary table; MLA / DSA do not use it.
    plain = TokenLayout(None, None, rotary_tables(head_dim=8, max_seq_len=SEQ, theta=1e4))
    return plain, torch.zeros(2, SEQ, dtype=torch.int32), torch.arange(SEQ).expand(2, SEQ)


def inputs(batch: int, dtype=torch.float64, seed: int = 0):
    """x and the probe that turns the output into a scalar loss, both [B, T, D]."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, SEQ, DIM, generator=gen, dtype=dtype) for _ in range(2)]


def causal_key_sets(seq_idx: torch.Tensor) -> list[list[list[int]]]:
    """keys[b][t]: the row indices s <= t of the same document."""
    return [[[s for s in range(t + 1) if row[s] == row[t]] for t in range(len(row))]
            for row in seq_idx.tolist()]


def assert_matches(got, expected, tol, what):
    """max |got - expected| / max |expected| < tol (both zero, as an untrained loss: 0)."""
    assert got.shape == expected.shape, what
    got, expected = got.double(), expected.double()
    err = ((got - expected).abs().max() / expected.abs().max().clamp_min(1e-300)).item()
    assert err < tol, f"{what}: relative error {err:.2e} > {tol:.0e}"


# ------------------------------------------------------------------------- float64 references
def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 1.0 + 0.1 * mscale * math.log(factor)


def reference_frequencies(a: MLAArgs) -> tuple[list[float], float]:
    """YaRN one frequency at a time: frequency i is theta^(-2i/d); those turning more than
    beta_fast times over the original length L are kept, those turning fewer than beta_slow
    times are divided by the factor, with a linear ramp in i between (boundaries rounded
    outwards). The attention factor multiplies cos and sin (transformers' convention)."""
    d, theta, factor = a.qk_rope_head_dim, a.rope_theta, a.yarn_factor
    plain = [theta ** (-2 * i / d) for i in range(d // 2)]
    if factor == 1.0:
        return plain, 1.0

    def index_turning(rotations):  # solves L * theta^(-2i/d) = 2 pi rotations for i
        length = a.yarn_original_max_position_embeddings
        return d * math.log(length / (2 * math.pi * rotations)) / (2 * math.log(theta))

    low = max(math.floor(index_turning(a.yarn_beta_fast)), 0)
    high = min(math.ceil(index_turning(a.yarn_beta_slow)), d - 1)
    assert high > low  # the configurations below stay clear of transformers' 0 / 0 guard
    weights = [min(max((i - low) / (high - low), 0.0), 1.0) for i in range(d // 2)]
    freqs = [f * (1 - w) + f / factor * w for f, w in zip(plain, weights)]
    if a.yarn_mscale and a.yarn_mscale_all_dim:
        return freqs, yarn_mscale(factor, a.yarn_mscale) / yarn_mscale(factor, a.yarn_mscale_all_dim)
    return freqs, yarn_mscale(factor, 1.0)


def reference_softmax_scale(a: MLAArgs) -> float:
    mscale = yarn_mscale(a.yarn_factor, a.yarn_mscale_all_dim) if a.yarn_mscale_all_dim else 1.0
    return mscale ** 2 / math.sqrt(a.qk_nope_head_dim + a.qk_rope_head_dim)


def rotation_matrices(a: MLAArgs, positions, interleaved: bool, size: int) -> torch.Tensor:
    """[B, T, size, size]: rotary pair i, channels (2i, 2i+1) or (i, i + dr/2), turned by
    position * frequency i and scaled by the attention factor; identity on channels >= dr."""
    freqs, factor = reference_frequencies(a)
    half = a.qk_rope_head_dim // 2
    rot = torch.eye(size, dtype=torch.float64).repeat(*positions.shape, 1, 1)
    for i, freq in enumerate(freqs):
        c, c2 = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
        cos, sin = factor * (positions.double() * freq).cos(), factor * (positions.double() * freq).sin()
        rot[..., c, c], rot[..., c, c2], rot[..., c2, c], rot[..., c2, c2] = cos, -sin, sin, cos
    return rot


def rms_norm(h, weight):
    return h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * weight


def layer_norm(h, weight, bias):
    centred = h - h.mean(-1, keepdim=True)
    return centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + EPS) * weight + bias


def softmax(logits):
    e = torch.exp(logits - logits.max(-1, keepdim=True).values)
    return e / e.sum(-1, keepdim=True)


def reference_qkv(p: dict, x, a: MLAArgs, positions):
    """Per-head queries / keys [B, T, H, dn + dr] (rotary part last), values, query latent."""
    (B, T, _), H, dn, dr = x.shape, a.n_heads, a.qk_nope_head_dim, a.qk_rope_head_dim
    if a.q_lora_rank is None:
        q_latent, q = None, x @ p["q_proj.weight"].T
    else:
        q_latent = rms_norm(x @ p["q_a_proj.weight"].T, p["q_a_layernorm.weight"])
        q = q_latent @ p["q_b_proj.weight"].T
    q = q.view(B, T, H, dn + dr)
    compressed = x @ p["kv_a_proj_with_mqa.weight"].T
    latent = rms_norm(compressed[..., :a.kv_lora_rank], p["kv_a_layernorm.weight"])
    kv = (latent @ p["kv_b_proj.weight"].T).view(B, T, H, dn + a.v_head_dim)
    rot = rotation_matrices(a, positions, a.rope_interleave, dr)
    q_rope = torch.einsum("btrs,bths->bthr", rot, q[..., dn:])
    k_rope = torch.einsum("btrs,bts->btr", rot, compressed[..., a.kv_lora_rank:])  # one, shared
    k = torch.cat((kv[..., :dn], k_rope[:, :, None].expand(B, T, H, dr)), dim=-1)
    return torch.cat((q[..., :dn], q_rope), dim=-1), k, kv[..., dn:], q_latent


def reference_attention(q, k, v, key_sets, scale):
    """Each query row attends by softmax over exactly the keys listed for it."""
    rows = []
    for b, row_sets in enumerate(key_sets):
        for t, keys in enumerate(row_sets):
            probs = softmax(torch.einsum("hd,shd->hs", q[b, t], k[b, keys]) * scale)
            rows.append(torch.einsum("hs,shv->hv", probs, v[b, keys]))
    return torch.stack(rows).view(*q.shape[:3], -1)


def reference_mla(p, x, a: MLAArgs, seq_idx, positions):
    q, k, v, _ = reference_qkv(p, x, a, positions)
    out = reference_attention(q, k, v, causal_key_sets(seq_idx), reference_softmax_scale(a))
    return out.flatten(2) @ p["o_proj.weight"].T


def reference_dsa(p, x, a: DSAArgs, seq_idx, positions):
    """(output, indexer loss). The indexer reads detached inputs (it learns from its loss only)."""
    q, k, v, q_latent = reference_qkv(p, x, a, positions)
    (B, T, _), nI, dI, scale = x.shape, a.index_n_heads, a.index_head_dim, reference_softmax_scale(a)
    iq = (q_latent.detach() @ p["indexer.wq_b.weight"].T).view(B, T, nI, dI)
    ik = layer_norm(x.detach() @ p["indexer.wk.weight"].T, p["indexer.k_norm.weight"],
                    p["indexer.k_norm.bias"])
    rot = rotation_matrices(a, positions, False, dI)  # half-split pairs, first dr channels
    iq, ik = torch.einsum("btrs,btis->btir", rot, iq), torch.einsum("btrs,bts->btr", rot, ik)
    head_weights = x.detach() @ p["indexer.weights_proj.weight"].T / math.sqrt(nI)
    kept, divergences = [], []
    for b, row_sets in enumerate(causal_key_sets(seq_idx)):
        kept.append([])
        for t, keys in enumerate(row_sets):
            score = head_weights[b, t] @ torch.relu(iq[b, t] @ ik[b, keys].T / math.sqrt(dI))
            picked = keys
            if a.mode == "sparse" and len(keys) > a.index_topk:
                ranked = score.detach().sort(descending=True)
                gap = ranked.values[a.index_topk - 1] - ranked.values[a.index_topk]
                assert gap > 1e-8, "near-tie at the top-k boundary: choose another seed"
                picked = sorted(keys[i] for i in ranked.indices[:a.index_topk].tolist())
            kept[b].append(picked)
            if a.indexer_loss_coeff > 0:
                support = picked if a.sparse_loss else keys
                logits = torch.einsum("hd,shd->hs", q[b, t].detach(), k[b, support].detach())
                target = softmax(logits * scale).sum(0)  # all heads, then L1-normalised
                target = target / target.sum()
                s = score[[keys.index(j) for j in support]]
                log_q = s - s.max() - torch.log(torch.exp(s - s.max()).sum())
                divergences.append((target * (target.log() - log_q)).sum())
    out = reference_attention(q, k, v, kept, scale).flatten(2) @ p["o_proj.weight"].T
    loss = a.indexer_loss_coeff * torch.stack(divergences).mean() if divergences else x.new_zeros(())
    return out, loss


# ------------------------------------------------------------------------- float64 comparisons
def run_backward(params: dict, forward, x, probe):
    """forward(x) -> out or (out, aux); backward of sum(out * probe) + aux. Returns out, aux,
    the parameters' gradients (None where none arrived) and the input's gradient."""
    x = x.clone().requires_grad_()
    result = forward(x)
    out, aux = result if isinstance(result, tuple) else (result, x.new_zeros(()))
    ((out * probe).sum() + aux).backward()
    return out.detach(), aux.detach(), {n: t.grad for n, t in params.items()}, x.grad


def assert_matches_reference(layer, reference, a, packed: bool):
    """The layer (float64) and reference(params, x, a, seq_idx, positions) on cloned weights
    agree on output, auxiliary loss, every parameter gradient and the input gradient."""
    layout, seq_idx, positions = token_layout(packed)
    x, probe = inputs(seq_idx.shape[0])
    ref_params = {n: t.detach().clone().requires_grad_() for n, t in layer.named_parameters()}
    got = run_backward(dict(layer.named_parameters()), lambda x: layer(x, layout), x, probe)
    want = run_backward(ref_params, lambda x: reference(ref_params, x, a, seq_idx, positions),
                        x, probe)
    for what, i in (("output", 0), ("indexer loss", 1), ("input grad", 3)):
        assert_matches(got[i], want[i], F64_TOL, what)
    assert got[2].keys() == want[2].keys()
    for name, grad in got[2].items():
        if want[2][name] is None:  # an untrained indexer
            assert grad is None, name
        else:
            assert_matches(grad, want[2][name], F64_TOL, f"grad {name}")
    return want


@pytest.mark.parametrize(("changes", "packed"), [
    (dict(), False),
    (dict(q_lora_rank=None, rope_interleave=False), True),
    # DeepSeek-V3's mscales: attention factor 1, softmax scale * mscale(4, 1)^2.
    (dict(rope_interleave=False, yarn_factor=4.0, yarn_mscale=1.0, yarn_mscale_all_dim=1.0), True),
    (dict(q_lora_rank=None, **YARN_ATTENTION_FACTOR), False),  # cos / sin scaled by 0.96
    # No mscale_all_dim: the attention factor is mscale(4) = 1.14, the softmax scale plain.
    (dict(yarn_factor=4.0, yarn_mscale=1.0, yarn_mscale_all_dim=0.0), True),
], ids=["lora-interleaved", "full-rank-half-split-packed", "yarn-equal-mscales-packed",
        "yarn-attention-factor", "yarn-no-mscale-all-dim-packed"])
def test_mla_matches_float64_reference(changes, packed):
    a = MLAArgs(**mla_fields(**changes))
    layer = randomize_(MultiLatentAttention(dim=DIM, args=a), seed=1)
    assert_matches_reference(layer, reference_mla, a, packed)


@pytest.mark.parametrize(("changes", "packed"), [
    (dict(indexer_loss_coeff=0.3), True),  # KL over all causal keys (Megatron's default)
    (dict(indexer_loss_coeff=0.3, sparse_loss=True, rope_interleave=False,
          **YARN_ATTENTION_FACTOR), False),  # KL over the top-k
    (dict(indexer_loss_coeff=0.5, mode="dense"), True),
    (dict(), False),  # coefficient 0: no loss, no indexer gradients
], ids=["sparse-packed", "sparse-loss-yarn", "dense-packed", "untrained"])
def test_dsa_matches_float64_reference(changes, packed):
    a = dsa_args(**changes)
    layer = randomize_(DeepSeekSparseAttention(dim=DIM, args=a), seed=2)
    want = assert_matches_reference(layer, reference_dsa, a, packed)
    assert (want[1] > 0) == (a.indexer_loss_coeff > 0)


def test_indexer_learns_only_from_its_own_loss():
    """Coefficient 0: no loss and no indexer gradients. Coefficient > 0: the indexer gets
    gradients, and the output and every other gradient stay bitwise the same."""
    layout, seq_idx, _ = token_layout(packed=True)
    untrained = randomize_(DeepSeekSparseAttention(dim=DIM, args=dsa_args()), seed=5)
    trained = DeepSeekSparseAttention(dim=DIM, args=dsa_args(indexer_loss_coeff=0.5)).double()
    trained.load_state_dict(untrained.state_dict())
    x, probe = inputs(seq_idx.shape[0])
    (out0, loss0, grads0, x_grad0), (out1, loss1, grads1, x_grad1) = (
        run_backward(dict(m.named_parameters()), lambda x, m=m: m(x, layout), x, probe)
        for m in (untrained, trained))
    assert loss0 == 0 and loss1 > 0
    assert torch.equal(out0, out1) and torch.equal(x_grad0, x_grad1)
    for name, grad in grads0.items():
        if name.startswith("indexer."):
            assert grad is None and grads1[name].abs().sum() > 0, name
        else:
            assert torch.equal(grad, grads1[name]), name


@pytest.mark.parametrize(("mode", "topk", "packed"), [
    ("sparse", SEQ, False), ("sparse", SEQ + 5, True), ("dense", 2, False), ("dense", 2, True)])
def test_dsa_keeping_every_key_is_mla(mode, topk, packed):
    """With top-k >= T (or in dense mode, whatever top-k) DSA's output is MLA's on the same
    main weights: the indexer then only trains."""
    layout, seq_idx, _ = token_layout(packed)
    a = dsa_args(mode=mode, index_topk=topk, indexer_loss_coeff=0.2)
    mla_layer = randomize_(MultiLatentAttention(dim=DIM, args=MLAArgs(**mla_fields())), seed=6)
    dsa_layer = randomize_(DeepSeekSparseAttention(dim=DIM, args=a), seed=7)
    loaded = dsa_layer.load_state_dict(mla_layer.state_dict(), strict=False)
    assert not loaded.unexpected_keys
    assert all(key.startswith("indexer.") for key in loaded.missing_keys)
    x, _ = inputs(seq_idx.shape[0])
    with torch.no_grad():
        assert_matches(dsa_layer(x, layout)[0], mla_layer(x, layout), 1e-13, "DSA vs MLA")


def test_dsa_runs_without_a_rope_table():
    """A plain layout without the `*` attention's rotary table, on which MLA runs (it computes
    its own rotary), must work for DSA too. Fails today: TokenLayout.row_order reads
    rope_table.device when positions is None."""
    layer = randomize_(DeepSeekSparseAttention(dim=DIM, args=dsa_args()), seed=2)
    x, _ = inputs(2)
    with_table = layer(x, token_layout(packed=False)[0])[0]
    try:
        without_table = layer(x, TokenLayout(None, None))[0]
    except AttributeError as error:
        pytest.fail(f"DSA needs TokenLayout.rope_table on a plain layout: {error}")
    assert torch.equal(with_table, without_table)


@pytest.mark.parametrize("with_documents", [True, False])
def test_top_keys_do_not_depend_on_key_order(with_documents):
    """Context parallelism gathers keys rank by rank; the picks must be the same keys as in
    row order, also when the k-th score is an exact zero tied with others (ReLU)."""
    seq_idx, positions = packed_layout(torch.tensor([0, 5, 12]))
    if not with_documents:
        seq_idx, positions = None, torch.arange(12)[None]
    scores = torch.tensor([[[0, 0, 1, 0, 2, 0, 0, 3, 0, 0, -1, 0],  # top 5: 3 scores + 2 of 8 zeros
                            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
                            [-1, 0, -2, 0, 5, 0, -1, 0, 0, 4, 0, -3],
                            [1, 1, 0, 1, 1, 0, 1, 1, 1, 0, 0, 1.0]]])
    # 3 ranks, 6 chunks of 2 keys: rank r holds chunks r and 5 - r (load-balanced CP).
    perm = torch.tensor([0, 1, 10, 11, 2, 3, 8, 9, 4, 5, 6, 7])
    shuffled_idx = None if seq_idx is None else seq_idx[:, perm]
    in_row_order = top_keys(scores, 5, TokenLayout(positions, seq_idx))
    shuffled = top_keys(scores[..., perm], 5, TokenLayout(positions[:, perm], shuffled_idx))
    assert torch.equal(in_row_order.sort(-1).values, perm[shuffled].sort(-1).values)


# ------------------------------------------------------------------------- cost
MATMUL_OPS = {"aten::mm", "aten::bmm", "aten::baddbmm", "aten::addmm", "aten::addbmm",
              "aten::matmul", "aten::einsum", "aten::mv", "aten::dot"}


def matmul_ops(fn) -> int:
    """How many matmul-family aten ops fn() runs (its backward too, if it runs one)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(event.count for event in prof.key_averages() if event.key in MATMUL_OPS)


def indexer_inputs(heads: int, dtype=torch.float32, batch=2, seq=SEQ, dim=11, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, seq, heads, dim, generator=gen, dtype=dtype),
            torch.randn(batch, seq, dim, generator=gen, dtype=dtype),
            torch.randn(batch, seq, heads, generator=gen, dtype=dtype))


def attention_inputs(heads: int, dtype=torch.float32, batch=2, seq=SEQ, dim=14, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, seq, heads, dim, generator=gen, dtype=dtype) for _ in range(2))


CAUSAL_ROWS = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()[None].expand(2, -1, -1)


@pytest.mark.parametrize("causal", [False, True])
def test_indexer_costs_do_not_grow_with_heads(causal):
    """One indexer-score call is two batched matmuls per row block (the logits, the weighted
    head sum) and the target one per block, at 4 heads as at 16: a per-head loop (one
    matmul per head) fails. One block here, CAUSAL_BLOCKS for causal rows."""
    blocks = dsa.CAUSAL_BLOCKS if causal else 1
    counts = {heads: (matmul_ops(lambda h=heads: index_scores(*indexer_inputs(h), CAUSAL_ROWS,
                                                               causal)),
                      matmul_ops(lambda h=heads: dsa.attention_probability_sum(
                          *attention_inputs(h), CAUSAL_ROWS, 0.3, causal)))
              for heads in (4, 16)}
    assert counts[4] == counts[16] == (2 * blocks, blocks), counts


def test_dsa_layer_matmuls_do_not_grow_with_heads():
    """A whole training step of the layer (sparse, indexer trained, plain rows and packed
    documents): the same number of matmul ops with 4 heads and 4 indexer heads as with 16."""
    def step(heads: int, packed: bool):
        layer = randomize_(DeepSeekSparseAttention(dim=DIM, args=dsa_args(
            n_heads=heads, index_n_heads=heads, indexer_loss_coeff=0.5)), seed=8)
        layout, seq_idx, _ = token_layout(packed)
        x, probe = inputs(seq_idx.shape[0])
        return lambda: run_backward(dict(layer.named_parameters()), lambda x: layer(x, layout),
                                    x, probe)
    for packed in (False, True):
        assert matmul_ops(step(4, packed)) == matmul_ops(step(16, packed)), packed


def assert_same_scores(got, expected, tol, what):
    """-inf at the same places, the finite scores equal to `tol` relative."""
    assert torch.equal(got.isneginf(), expected.isneginf()), what
    finite = expected.isfinite()
    assert_matches(got[finite], expected[finite], tol, what)


def scores_and_target(dtype, causal: bool):
    """index_scores and attention_probability_sum (16 heads) on inputs drawn in float64."""
    (iq, ik, iw), (q, k) = ([t.to(dtype) for t in make(16, torch.float64)]
                            for make in (indexer_inputs, attention_inputs))
    return (index_scores(iq, ik, iw, CAUSAL_ROWS, causal),
            dsa.attention_probability_sum(q, k, CAUSAL_ROWS, 0.3, causal))


@pytest.mark.parametrize("causal", [False, True])
def test_row_blocks_give_the_one_block_results(monkeypatch, causal):
    """A budget of 3 rows' worth splits SEQ = 20 query rows into 7 blocks; the scores and the
    target equal the one-block call's to fp32 rounding (1e-6 relative; observed: bitwise for
    non-causal blocks of several rows, ~1e-7 where the causal cut changes the matmul's key
    count), to 1e-14 in float64, and the fp32 results the float64 ones to 1e-5."""
    per_row = 2 * 16 * SEQ  # batch * heads * keys
    assert len(dsa.query_blocks(SEQ, per_row, causal)) == (dsa.CAUSAL_BLOCKS if causal else 1)
    dtypes = {torch.float32: 1e-6, torch.float64: 1e-14}
    one = {dtype: scores_and_target(dtype, causal) for dtype in dtypes}
    monkeypatch.setattr(dsa, "BLOCK_ELEMENTS", 3 * per_row)
    assert len(dsa.query_blocks(SEQ, per_row, causal)) == 7
    blocked = {dtype: scores_and_target(dtype, causal) for dtype in dtypes}
    for dtype, tol in dtypes.items():
        assert_same_scores(blocked[dtype][0], one[dtype][0], tol, f"{dtype} scores")
        assert_matches(blocked[dtype][1], one[dtype][1], tol, f"{dtype} target")
    assert_same_scores(one[torch.float32][0], one[torch.float64][0], 1e-5, "fp32 vs f64 scores")
    assert_matches(one[torch.float32][1], one[torch.float64][1], 1e-5, "fp32 vs f64 target")


@pytest.mark.parametrize("packed", [False, True])
def test_dsa_layer_with_row_blocks(monkeypatch, packed):
    """The layer (float64, sparse, indexer trained; plain rows take the causal blocks) gives
    the same output, loss and gradients with one-row blocks as with the default budget."""
    layout, seq_idx, _ = token_layout(packed)
    layer = randomize_(DeepSeekSparseAttention(dim=DIM, args=dsa_args(indexer_loss_coeff=0.5)),
                       seed=9)
    x, probe = inputs(seq_idx.shape[0])
    params = dict(layer.named_parameters())

    def run():
        for param in params.values():
            param.grad = None
        return run_backward(params, lambda x: layer(x, layout), x, probe)
    default = run()
    monkeypatch.setattr(dsa, "BLOCK_ELEMENTS", 1)
    assert len(dsa.query_blocks(SEQ, 2 * 7 * SEQ, causal=False)) == SEQ
    blocked = run()
    for what, i in (("output", 0), ("indexer loss", 1), ("input grad", 3)):
        assert_matches(blocked[i], default[i], 1e-12, what)
    assert default[1] > 0
    for name, grad in default[2].items():
        assert grad is not None and blocked[2][name] is not grad, name
        assert_matches(blocked[2][name], grad, 1e-12, f"grad {name}")


# ------------------------------------------------------------------------- transformers
def hf_config(config_type, a: MLAArgs, **extra):
    rope = {"rope_type": "default", "rope_theta": a.rope_theta}
    if a.yarn_factor != 1.0:
        rope |= {"rope_type": "yarn", "factor": a.yarn_factor, "beta_fast": a.yarn_beta_fast,
                 "original_max_position_embeddings": a.yarn_original_max_position_embeddings,
                 "beta_slow": a.yarn_beta_slow, "mscale": a.yarn_mscale,
                 "mscale_all_dim": a.yarn_mscale_all_dim}
    return config_type(
        hidden_size=DIM, num_attention_heads=a.n_heads, num_key_value_heads=a.n_heads,
        q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank, qk_rope_head_dim=a.qk_rope_head_dim,
        qk_nope_head_dim=a.qk_nope_head_dim, v_head_dim=a.v_head_dim, rope_parameters=rope,
        max_position_embeddings=256, attn_implementation="eager", **extra)


def hf_inputs(rotary_type, config, x, seq_idx, positions):
    """transformers' (cos, sin) of the positions, its additive [B, 1, T, T] mask (finfo.min
    outside the causal in-document keys), and the boolean [B, T, T] mask of those keys."""
    cos, sin = rotary_type(config)(x, positions.long())
    rows = torch.arange(x.shape[1])
    allowed = (rows[None, None] <= rows[None, :, None]) & (seq_idx[:, :, None] == seq_idx[:, None])
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(x.dtype).min)
    return (cos, sin), additive[:, None], allowed


@pytest.mark.parametrize(("changes", "packed"), [
    (dict(), False), (dict(q_lora_rank=None, rope_interleave=False), True),
    (dict(rope_interleave=False, **YARN_ATTENTION_FACTOR), False),
    (dict(q_lora_rank=None, yarn_factor=4.0, yarn_mscale=1.0, yarn_mscale_all_dim=1.0), True),
], ids=["lora-interleaved", "full-rank-half-split-packed", "yarn", "full-rank-yarn-packed"])
def test_mla_matches_transformers_deepseek_v3(changes, packed):
    a = MLAArgs(**mla_fields(**changes))
    config = hf_config(DeepseekV3Config, a, rope_interleave=a.rope_interleave)
    hf = randomize_(hf_v3.DeepseekV3Attention(config, layer_idx=0), seed=3, dtype=torch.float32)
    ours = MultiLatentAttention(dim=DIM, args=a)
    ours.load_state_dict(hf.state_dict(), strict=True)
    layout, seq_idx, positions = token_layout(packed)
    x, _ = inputs(seq_idx.shape[0], torch.float32)
    rope, mask, _ = hf_inputs(hf_v3.DeepseekV3RotaryEmbedding, config, x, seq_idx, positions)
    with torch.no_grad():
        expected = hf(hidden_states=x, position_embeddings=rope, attention_mask=mask)[0]
        assert_matches(ours(x, layout), expected, F32_TOL, "MLA vs DeepseekV3Attention")


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_mla_output_gate_matches_transformers_bailing_hybrid(packed):
    """`mla.output_gate` (Ling 3.0's MLA): a sigmoid gate per head from g_proj, on the
    attention's output before o_proj; transformers' BailingHybridAttention loads as it is (its
    rotary pairs are interleaved, its queries full-rank)."""
    from transformers.models.bailing_hybrid import BailingHybridConfig
    from transformers.models.bailing_hybrid import modeling_bailing_hybrid as hf_bailing

    a = MLAArgs(**mla_fields(q_lora_rank=None, output_gate=True))
    config = hf_config(BailingHybridConfig, a, num_hidden_layers=1)
    hf = randomize_(hf_bailing.BailingHybridAttention(config, layer_idx=0), seed=3,
                    dtype=torch.float32)
    ours = MultiLatentAttention(dim=DIM, args=a)
    ours.load_state_dict(hf.state_dict(), strict=True)
    layout, seq_idx, positions = token_layout(packed)
    x, _ = inputs(seq_idx.shape[0], torch.float32)
    rope, mask, _ = hf_inputs(hf_bailing.BailingHybridRotaryEmbedding, config, x, seq_idx,
                              positions)
    with torch.no_grad():
        expected = hf(hidden_states=x, position_embeddings=rope, attention_mask=mask)[0]
        assert_matches(ours(x, layout), expected, F32_TOL, "MLA vs BailingHybridAttention")
        ungated = MultiLatentAttention(dim=DIM, args=MLAArgs(**mla_fields(q_lora_rank=None)))
        ungated.load_state_dict(hf.state_dict(), strict=False)
        assert not torch.allclose(ungated(x, layout), expected, rtol=1e-3)


@pytest.mark.parametrize(("changes", "packed"), [
    (dict(index_topk=SEQ), False), (dict(), True), (dict(), False),
    (dict(**YARN_ATTENTION_FACTOR), True)], ids=["all-keys", "top4-packed", "top4", "top4-yarn"])
def test_dsa_matches_transformers_deepseek_v32(changes, packed):
    """transformers' indexer does not train: our coefficient-0 layer is the one to compare.
    Its V3.2 attention rotates interleaved pairs, the indexer half-split ones."""
    a = dsa_args(**changes)
    config = hf_config(DeepseekV32Config, a, index_n_heads=a.index_n_heads,
                       index_head_dim=a.index_head_dim, index_topk=a.index_topk)
    hf = randomize_(hf_v32.DeepseekV32Attention(config, layer_idx=0), seed=4, dtype=torch.float32)
    ours = DeepSeekSparseAttention(dim=DIM, args=a)
    ours.load_state_dict(hf.state_dict(), strict=True)
    layout, seq_idx, positions = token_layout(packed)
    x, _ = inputs(seq_idx.shape[0], torch.float32, seed=1)
    rope, mask, allowed = hf_inputs(hf_v32.DeepseekV32RotaryEmbedding, config, x, seq_idx, positions)
    with torch.no_grad():
        expected = hf(hidden_states=x, position_embeddings=rope, attention_mask=mask)[0]
        # The sets: transformers' indexer returns indices (masked keys among them in short rows).
        picked = hf.indexer(x, hf.q_a_layernorm(hf.q_a_proj(x)), rope, mask[:, 0], None)
        hf_sets = torch.zeros_like(allowed).scatter(-1, picked.long(), True) & allowed
        cos, sin = mla.rotary_cos_sin(a, layout, SEQ, x)
        scores = index_scores(*ours.indexer(x, ours.query_latent(x), cos, sin), allowed)
        our_picks = top_keys(scores, min(a.index_topk, SEQ), layout)
        our_sets = torch.zeros_like(allowed).scatter(-1, our_picks, True) & allowed
        assert torch.equal(our_sets, hf_sets)
        assert (our_sets.sum(-1) == allowed.sum(-1).clamp_max(a.index_topk)).all()
        assert_matches(ours(x, layout)[0], expected, F32_TOL, "DSA vs DeepseekV32Attention")


YARN_CASES = {  # MLAArgs fields
    "deepseek-v3": dict(qk_rope_head_dim=64, rope_theta=10000.0, yarn_factor=40.0,
                        yarn_original_max_position_embeddings=4096, yarn_mscale=1.0,
                        yarn_mscale_all_dim=1.0),
    "attention-factor": mla_fields(**YARN_ATTENTION_FACTOR),
    "no-mscale-all-dim": mla_fields(yarn_factor=8.0, yarn_beta_fast=16.0, yarn_beta_slow=2.0),
}


@pytest.mark.parametrize("fields", YARN_CASES.values(), ids=YARN_CASES.keys())
def test_yarn_frequencies_match_transformers(fields):
    """Against ROPE_INIT_FUNCTIONS["yarn"] (fp32 frequencies) and the float64 reference."""
    a = MLAArgs(**fields)
    ours, factor = mla.rotary_frequencies(a, torch.float64, "cpu")
    hf, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config(DeepseekV3Config, a))
    assert_matches(ours, hf, 1e-6, "inverse frequencies vs transformers (fp32)")
    assert factor == pytest.approx(hf_factor, rel=1e-12)
    freqs, reference_factor = reference_frequencies(a)
    assert_matches(ours, torch.tensor(freqs, dtype=torch.float64), 1e-14, "vs reference")
    assert factor == pytest.approx(reference_factor, rel=1e-14)


@pytest.mark.parametrize(("factor", "mscale_all_dim"), [(40.0, 1.0), (4.0, 0.5), (4.0, 0.0),
                                                       (1.0, 1.0)])
def test_softmax_scale_matches_transformers(factor, mscale_all_dim):
    a = MLAArgs(qk_nope_head_dim=128, qk_rope_head_dim=64, yarn_factor=factor,
                yarn_mscale_all_dim=mscale_all_dim)
    rope = {"rope_type": "yarn" if factor != 1.0 else "default", "factor": factor,
            "mscale_all_dim": mscale_all_dim}
    expected = hf_v3.yarn_apply_mscale(rope, 192 ** -0.5)
    assert mla.softmax_scale(a) == pytest.approx(expected, rel=1e-14)
    if factor == 40.0:  # DeepSeek-V3: (1 + 0.1 ln 40)^2 / sqrt(192) = 0.135234...
        assert expected == pytest.approx((1 + 0.1 * math.log(40)) ** 2 / math.sqrt(192))
        assert expected == pytest.approx(0.135234, abs=1e-6)


# ------------------------------------------------------------------------- FLOPs, validation
def test_core_flops_follow_megatron():
    """Per token forward: MLA T*n*(dn+dr+dv); DSA min(T, 2K)*n*(dn+dr+dv) + T*nI*dI (dense:
    T instead of min(T, 2K))."""
    small_mla = MLAArgs(**mla_fields())  # n 3, dn + dr + dv = 19; nI 7, dI 11, K 4
    assert mla.KIND.core_flops(small_mla, DIM, 20) == 20 * 57 == 1140
    assert dsa.KIND.core_flops(dsa_args(), DIM, 20) == 8 * 57 + 20 * 77 == 1996
    assert dsa.KIND.core_flops(dsa_args(mode="dense"), DIM, 20) == 1140 + 1540 == 2680
    v32 = dict(n_heads=128, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
               index_n_heads=64, index_head_dim=128, index_topk=2048)  # 128 * 320 = 40960 / key
    big_mla = MLAArgs(**{k: v for k, v in v32.items() if not k.startswith("index")})
    assert mla.KIND.core_flops(big_mla, 7168, 4096) == 4096 * 40960 == 167_772_160
    assert mla.KIND.core_flops(big_mla, 7168, 1024) == 41_943_040
    sparse, dense = DSAArgs(**v32), DSAArgs(**v32, mode="dense")
    assert dsa.KIND.core_flops(sparse, 7168, 4096) == 167_772_160 + 4096 * 8192 == 201_326_592
    assert dsa.KIND.core_flops(sparse, 7168, 1024) == 41_943_040 + 8_388_608 == 50_331_648
    # Past T = 2K the top-k caps the attention: 4096 keys, not 8192.
    assert dsa.KIND.core_flops(sparse, 7168, 8192) == 167_772_160 + 67_108_864 == 234_881_024
    assert dsa.KIND.core_flops(dense, 7168, 8192) == 335_544_320 + 67_108_864 == 402_653_184
    assert dsa.KIND.core_flops(dense, 7168, 1024) == 50_331_648


@pytest.mark.parametrize(("kind", "changes", "message"), [
    (mla.KIND, dict(qk_rope_head_dim=7), "qk_rope_head_dim=7"),
    (mla.KIND, dict(yarn_factor=0.5), "yarn_factor=0.5"),
    (dsa.KIND, dict(qk_rope_head_dim=7), "qk_rope_head_dim=7"),
    (dsa.KIND, dict(q_lora_rank=None), "q_lora_rank=None"),
    (dsa.KIND, dict(index_head_dim=6), "index_head_dim=6"),
    (dsa.KIND, dict(index_topk=0), "index_topk=0"),
    (dsa.KIND, dict(mode="bogus"), "mode='bogus'"),
    (dsa.KIND, dict(indexer_loss_coeff=-0.1), "indexer_loss_coeff=-0.1"),
    (dsa.KIND, dict(yarn_factor=0.5), "yarn_factor=0.5"),
])
def test_validation_names_field_and_value(kind, changes, message):
    make = (lambda **c: MLAArgs(**mla_fields(**c))) if kind is mla.KIND else dsa_args
    kind.validate(make(), DIM)  # the base is valid: the change alone is refused
    with pytest.raises(ValueError, match=re.escape(message)):
        kind.validate(make(**changes), DIM)

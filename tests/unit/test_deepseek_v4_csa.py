"""DeepSeek-V4 compressed sparse attention (model/deepseek_v4_csa.py, pattern symbol `C`).

1. A float64 reference written from the description: each document's overlapping compressed
   rows and the indexer's keys built block by block ([Ca of the block before | Cb of the
   block] under one softmax per channel, RMS norm, rotation at the block's first position),
   the indexer's scores and top-k per query, then a per-query loop over the window keys and
   the picked rows with the sink. Output, every parameter gradient and the input gradient
   agree to 1e-10 relative, for plain rows and packed rows whose documents start inside a
   compression block and a window, with a top-k that drops rows and one that keeps all.
2. The indexer's training rule (DSA's, on compressed rows): the auxiliary output is the
   coefficient times the reference KL (dense support, sparse support), its gradient reaches
   the indexer's parameters only and equals the reference's; queries with no visible row count
   0 in the mean.
3. transformers' DeepseekV4Attention (layer type "compressed_sparse_attention") loads our
   state dict 1:1 by name and gives the same output and gradients, on plain rows and (one
   document at a time) packed ones, with a top-k that drops rows.
4. Table rules: TP layouts (compressor and indexer replicated) and a TP split by hand, FLOPs,
   validation, CP refused by name.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4

from tests.run_configs import run_from_args
from tests.unit.test_deepseek_v4 import (
    DIM,
    F64_TOL,
    SEQ,
    _relative,
    _rms,
    _rotate,
    assert_matches_transformers,
    assert_tensor_parallel_parts_sum_to_the_layer,
    parity_inputs,
    randomize_,
    reference_output,
    reference_projections,
    token_layout,
    transformers_twin,
)
from tests.unit.test_deepseek_v4_hca import COMPRESSED_FIELDS, hf_forward_by_document
from titan_hybrid.model.args import hybrid_flavors
from titan_hybrid.model.common import TPLayout, tensor_parallel_layouts
from titan_hybrid.model.deepseek_v4_csa import (
    KIND,
    CompressedSparseAttention,
    DeepseekV4SparseAttentionArgs,
)
from titan_hybrid.model.layout import TokenLayout
from titan_hybrid.parallel.validate import validate_layout


def small_args(**changes) -> DeepseekV4SparseAttentionArgs:
    """test_deepseek_v4_hca's sizes (blocks of 4; documents start inside blocks at 9, 5, 18),
    3 indexer heads of 8 channels (4 rotary), top-2 of up to 5 rows."""
    fields = COMPRESSED_FIELDS | dict(index_n_heads=3, index_head_dim=8, index_topk=2)
    return DeepseekV4SparseAttentionArgs(**(fields | changes))


# ------------------------------------------------------------------------ float64 reference
def overlapping_rows(p: dict[str, torch.Tensor], prefix: str, x: torch.Tensor,
                     tokens: list[int], width: int, a: DeepseekV4SparseAttentionArgs
                     ) -> list[torch.Tensor]:
    """The rows of one document (its token indices `tokens`, in order) from the compressor
    whose parameters start with `prefix`: row w pools Ca of block w - 1 and Cb of block w."""
    ratio, rows = a.compress_ratio, []
    kv = x[tokens] @ p[prefix + "kv_proj.weight"].T  # [tokens, 2 * width]
    gate = x[tokens] @ p[prefix + "gate_proj.weight"].T
    bias = p[prefix + "position_bias"]
    for w in range(len(tokens) // ratio):
        slots_kv, slots_gate = [], []
        if w > 0:
            for j in range(ratio):
                slots_kv.append(kv[(w - 1) * ratio + j, :width])
                slots_gate.append(gate[(w - 1) * ratio + j, :width] + bias[j, :width])
        for j in range(ratio):
            slots_kv.append(kv[w * ratio + j, width:])
            slots_gate.append(gate[w * ratio + j, width:] + bias[j, width:])
        weights = torch.softmax(torch.stack(slots_gate), dim=0)  # each channel over its slots
        pooled = (weights * torch.stack(slots_kv)).sum(0)
        normed = _rms(pooled, a.norm_eps) * p[prefix + "kv_norm.weight"]
        rows.append(_rotate(normed, w * ratio, a, 1.0))
    return rows


def reference(p: dict[str, torch.Tensor], x: torch.Tensor, seq_idx: torch.Tensor,
              positions: torch.Tensor, a: DeepseekV4SparseAttentionArgs
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, the indexer's KL: mean over queries, 0 for those that see no row)."""
    batch, seq_len, _ = x.shape
    out_rows, kls = [], []
    for b in range(batch):
        q_latent, q_rotated, kv_rotated = reference_projections(p, x[b], positions[b], a)
        index_q_all = (q_latent.detach() @ p["compressor.indexer.q_b_proj.weight"].T).view(
            seq_len, a.index_n_heads, a.index_head_dim)
        index_w_all = (x[b].detach() @ p["compressor.indexer.scorer.weights_proj.weight"].T
                       ) * a.index_n_heads ** -0.5
        documents = {}
        for s in range(seq_len):
            documents.setdefault(int(seq_idx[b, s]), []).append(s)
        rows_of = {doc: overlapping_rows(p, "compressor.", x[b], tokens, a.head_dim, a)
                   for doc, tokens in documents.items()}
        keys_of = {doc: overlapping_rows(p, "compressor.indexer.", x[b].detach(), tokens,
                                         a.index_head_dim, a)
                   for doc, tokens in documents.items()}
        outputs = []
        for t in range(seq_len):
            t_pos, doc = int(positions[b, t]), int(seq_idx[b, t])
            window = [kv_rotated[s] for s in documents[doc]
                      if t_pos - a.sliding_window < int(positions[b, s]) <= t_pos]
            seen = (t_pos + 1) // a.compress_ratio  # rows of blocks ending at or before t
            q = q_rotated[t]  # [H, D]
            picked = list(range(seen))
            if seen:
                index_q = _rotate(index_q_all[t], t_pos, a, 1.0)  # [I, K]
                keys = torch.stack(keys_of[doc][:seen])  # [seen, K]
                scores = (index_w_all[t][:, None] * torch.relu(index_q @ keys.T)
                          * a.index_head_dim ** -0.5).sum(0)  # [seen]
                if a.mode == "sparse" and seen > a.index_topk:
                    by_score = sorted(range(seen), key=lambda w: -float(scores[w].detach()))
                    picked = by_score[:a.index_topk]
                support = picked if a.sparse_loss else list(range(seen))
                rows = torch.stack(rows_of[doc][:seen]).detach()
                probs = torch.softmax((q.detach() @ rows[support].T) / a.head_dim ** 0.5, -1)
                target = probs.sum(0) / probs.sum()
                kls.append((target * (target.log()
                                      - torch.log_softmax(scores[support], -1))).sum())
            kv = torch.stack(window + [rows_of[doc][w] for w in picked])  # [keys, D]
            outputs.append(reference_output(p, q, kv, t_pos, a))
        out_rows.append(torch.stack(outputs))
    # A query that sees no row counts 0 in the mean over all queries.
    return torch.stack(out_rows), torch.stack(kls).sum() / (batch * seq_len)


def _run_both(a, packed, seed=1):
    layer = randomize_(CompressedSparseAttention(dim=DIM, args=a), seed=seed)
    layout, seq_idx, positions = token_layout(packed)
    torch.manual_seed(2)
    x = torch.randn(2, SEQ, DIM, dtype=torch.float64, requires_grad=True)
    params = {name: param.detach().clone().requires_grad_() for name, param in
              layer.named_parameters()}
    x_ref = x.detach().clone().requires_grad_()
    return layer, layout, x, (params, x_ref, *reference(params, x_ref, seq_idx, positions, a))


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("changes", [{}, dict(index_topk=8), dict(mode="dense"),
                                     dict(compress_ratio=3, sliding_window=1)],
                         ids=["top2", "keeps-all", "dense", "ratio3-window1"])
def test_layer_matches_the_float64_reference_with_gradients(packed, changes):
    a = small_args(**changes)
    layer, layout, x, (params, x_ref, expected, _) = _run_both(a, packed)
    grad_out = torch.randn(2, SEQ, DIM, dtype=torch.float64)
    got, aux = layer(x, layout)
    assert aux.item() == 0.0  # coefficient 0: the indexer does not train
    got_grads = torch.autograd.grad(got, [x, *layer.parameters()], grad_out, allow_unused=True)
    expected_grads = torch.autograd.grad(expected, [x_ref, *params.values()], grad_out,
                                         allow_unused=True)
    assert _relative(got, expected) < F64_TOL
    for name, g, e in zip(["x", *params], got_grads, expected_grads, strict=True):
        if name.startswith("compressor.indexer."):  # picks rows; no gradient reaches it
            assert g is None and e is None, name
        else:
            assert _relative(g, e) < F64_TOL, name
    if packed:  # the documents matter
        assert _relative(layer(x, TokenLayout(None, None))[0], expected) > 1e-3


def test_the_indexer_picks_rows_that_change_the_output():
    """top-2 of up to 5 rows differs from keeping them all: the selection is exercised."""
    a = small_args()
    layer = randomize_(CompressedSparseAttention(dim=DIM, args=a), seed=1)
    layout, _, _ = token_layout(False)
    x = torch.randn(2, SEQ, DIM, dtype=torch.float64)
    keep_all = copy.deepcopy(layer)
    keep_all.args = small_args(index_topk=8)
    assert _relative(layer(x, layout)[0], keep_all(x, layout)[0]) > 1e-3


@pytest.mark.parametrize("changes", [{}, dict(sparse_loss=True), dict(mode="dense")],
                         ids=["dense-support", "sparse-support", "dense-mode"])
def test_indexer_loss_and_its_gradient_match_the_reference(changes):
    a = small_args(indexer_loss_coeff=0.5, **changes)
    layer, layout, x, (params, x_ref, _, expected_kl) = _run_both(a, packed=True)
    _, aux = layer(x, layout)
    assert abs(aux.item() - 0.5 * expected_kl.item()) < F64_TOL * abs(expected_kl.item())
    names = list(params)
    got_grads = dict(zip(["x", *names], torch.autograd.grad(
        aux, [x, *layer.parameters()], allow_unused=True), strict=True))
    expected_grads = dict(zip(["x", *names], torch.autograd.grad(
        0.5 * expected_kl, [x_ref, *params.values()], allow_unused=True), strict=True))
    for name in ["x", *names]:
        if name.startswith("compressor.indexer."):
            assert _relative(got_grads[name], expected_grads[name]) < 1e-9, name
        else:  # detached inputs: the indexer's loss reaches nothing else
            assert got_grads[name] is None and expected_grads[name] is None, name
    # The counters hold the KL before its coefficient, for the training log.
    loss_sum, count = layer.indexer_loss_sum.tolist()
    assert count == 1 and abs(loss_sum - expected_kl.item()) < 1e-9


# ----------------------------------------------------------------------- transformers parity
def hf_config(a: DeepseekV4SparseAttentionArgs) -> DeepseekV4Config:
    return DeepseekV4Config(
        hidden_size=DIM, num_attention_heads=a.n_heads, num_key_value_heads=1,
        head_dim=a.head_dim, q_lora_rank=a.q_lora_rank, o_groups=a.o_groups,
        o_lora_rank=a.o_lora_rank, sliding_window=a.sliding_window,
        partial_rotary_factor=a.rope_head_dim / a.head_dim, rope_theta=77.0,
        compress_rope_theta=a.rope_theta,
        compress_rates={"compressed_sparse_attention": a.compress_ratio,
                        "heavily_compressed_attention": 128},
        index_n_heads=a.index_n_heads, index_head_dim=a.index_head_dim,
        index_topk=a.index_topk, rms_norm_eps=a.norm_eps, num_hidden_layers=1,
        layer_types=["compressed_sparse_attention"], mlp_layer_types=["moe"],
        max_position_embeddings=256, attn_implementation="eager")


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed-per-document"])
def test_layer_matches_transformers_deepseek_v4_attention(packed):
    a = small_args()
    config = hf_config(a)
    ours, hf = transformers_twin(CompressedSparseAttention, a, config)
    assert isinstance(hf.compressor, hf_v4.DeepseekV4CSACompressor)
    layout, seq_idx, _ = token_layout(packed)
    x, grad_out = parity_inputs()
    expected = hf_forward_by_document(hf, config, x, seq_idx if packed else None)
    # The top-k's indices carry no gradient to the indexer, in either.
    assert_matches_transformers(ours, hf, x, layout, expected, grad_out,
                                no_gradient="compressor.indexer.")


# ----------------------------------------------------------------------------- table rules
def test_tensor_parallel_layouts_split_heads_and_replicate_compressor_and_indexer():
    with torch.device("meta"):
        layer = CompressedSparseAttention(dim=DIM, args=small_args())
    plan = tensor_parallel_layouts(layer)
    assert {name: layout for name, layout in plan.items() if layout.shard_dim is not None} == {
        "q_b_proj.weight": TPLayout(0), "o_a_proj.weight": TPLayout(0),
        "o_b_proj.weight": TPLayout(1), "sinks": TPLayout(0)}
    assert {name for name in plan if name.startswith("compressor.indexer.")} == {
        f"compressor.indexer.{name}" for name in (
            "kv_proj.weight", "gate_proj.weight", "position_bias", "kv_norm.weight",
            "q_b_proj.weight", "scorer.weights_proj.weight")}
    assert KIND.tensor_parallel_sizes(small_args(), DIM) == [
        ("compressed_sparse_attention.n_heads", 6), ("compressed_sparse_attention.o_groups", 3)]


def test_two_ranks_of_whole_groups_sum_to_the_layer():
    """What TP computes, by hand: each rank's heads and groups, with the whole compressor and
    indexer on both (the same picks), give partial outputs that sum to the layer's output."""
    a = small_args(n_heads=4, o_groups=2)
    layer = randomize_(CompressedSparseAttention(dim=DIM, args=a), seed=6)
    assert_tensor_parallel_parts_sum_to_the_layer(layer)


def test_core_flops_count_window_picked_rows_indexer_and_pooling():
    a = small_args()  # window 5, blocks of 4, top-2, 6 heads of 10, 3 indexer heads of 8
    pooling = 4 * (10 + 8)
    assert KIND.core_flops(a, DIM, 100) == (4 * (5 + 2) * 10 * 6 + 2 * 25 * 3 * 8 + pooling)
    dense = small_args(mode="dense")
    assert KIND.core_flops(dense, DIM, 100) == (4 * (5 + 25) * 10 * 6 + 2 * 25 * 3 * 8
                                                + pooling)


@pytest.mark.parametrize("changes, message", [
    (dict(n_heads=6, o_groups=4),
     "compressed_sparse_attention: n_heads=6 is not divisible by o_groups=4"),
    (dict(compress_ratio=0), "compressed_sparse_attention: compress_ratio=0 must be at least 1"),
    (dict(index_head_dim=2), "compressed_sparse_attention: index_head_dim=2 must be at least "
                             "rope_head_dim=4"),
    (dict(index_topk=0), "compressed_sparse_attention: index_topk=0 must be at least 1"),
    (dict(mode="lazy"), "compressed_sparse_attention: mode='lazy' must be one of"),
    (dict(indexer_loss_coeff=-1.0),
     "compressed_sparse_attention: indexer_loss_coeff=-1.0 must be >= 0"),
])
def test_validation_names_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        KIND.validate(small_args(**changes), DIM)


def test_context_parallel_needs_pieces_as_long_as_the_compressor_halo():
    """A piece reads the 2 * ratio - 1 tokens before it (the rest of a block and the block
    before it): blocks of 4 need pieces of 7 tokens (seq 32 at CP 2 has 8, seq 24 has 6)."""
    args = copy.deepcopy(hybrid_flavors["debug_v4_all"])
    args.pattern = "MC-MC-"
    args.compressed_sparse_attention.sliding_window = 4
    for seq_len in (32, 24):
        job = run_from_args("--training.seq_len", str(seq_len),
                            "--parallelism.context_parallel_degree", "2", model=args)
        if seq_len == 32:
            validate_layout(job, 2)
            continue
        with pytest.raises(ValueError, match=r"training.seq_len=24 with context_parallel_degree=2:"
                           r" pieces of 6 tokens are shorter than the DeepSeek-V4 compressed "
                           r"sparse attention compressor's halo \(7 tokens"):
            validate_layout(job, 2)

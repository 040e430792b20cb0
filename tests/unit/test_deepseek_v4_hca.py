"""DeepSeek-V4 heavily compressed attention (model/deepseek_v4_hca.py, pattern symbol `H`).

1. A float64 reference written from the description: each document's compressed rows built
   block by block (gated softmax over the block's tokens with the position bias, RMS norm,
   rotation at the block's first position), then a per-query loop over an explicit list of
   window keys and visible compressed rows with the sink. Output, every parameter gradient and
   the input gradient agree to 1e-10 relative, for plain rows and packed rows whose documents
   start inside a compression block of the row and inside a window.
2. transformers' DeepseekV4Attention (layer type "heavily_compressed_attention") loads our
   state dict 1:1 by name and gives the same output and gradients on plain rows, with the mask
   and the "main" / "compress" rotary tables its model builds; on packed rows (which it does
   not separate) ours equals it run on each document alone; also with YaRN on the "compress"
   table (a small pretraining length, so one of the two rotary pairs is scaled), with and
   without an attention factor. Our cos / sin equal transformers' DeepseekV4RotaryEmbedding
   "compress" table at V4's sizes (YaRN factor 16, and plain), its "main" table stays plain.
3. Table rules: TP layouts (compressor replicated) and a TP split by hand, FLOPs, validation,
   CP refused by name.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DeepseekV4Config
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4

from tests.run_configs import run_from_args
from tests.unit.test_deepseek_v4 import (
    DIM,
    F64_TOL,
    SEQ,
    SMALL_FIELDS,
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
from titan_hybrid.model.args import hybrid_flavors
from titan_hybrid.model.common import TPLayout, tensor_parallel_layouts
from titan_hybrid.model.deepseek_v4 import (
    DeepseekV4AttentionArgs,
    SlidingWindowAttention,
    rotary_cos_sin_at,
)
from titan_hybrid.model.deepseek_v4_hca import (
    KIND,
    DeepseekV4CompressedAttentionArgs,
    HeavilyCompressedAttention,
    compression_blocks,
)
from titan_hybrid.model.layout import TokenLayout
from titan_hybrid.parallel.validate import validate_layout

# test_deepseek_v4's sizes, blocks of 4 tokens: token_layout's packed rows (documents [0, 9,
# 21] and [0, 4, 5, 18, 21]) have documents that start inside blocks of the row grid (at 9, 5,
# 18) and inside windows of 5.
COMPRESSED_FIELDS = SMALL_FIELDS | dict(rope_theta=300.0, compress_ratio=4)


def small_args(**changes) -> DeepseekV4CompressedAttentionArgs:
    return DeepseekV4CompressedAttentionArgs(**(COMPRESSED_FIELDS | changes))


# ------------------------------------------------------------------------ float64 reference
def compressed_rows(p: dict[str, torch.Tensor], x: torch.Tensor, tokens: list[int],
                    a: DeepseekV4CompressedAttentionArgs) -> list[torch.Tensor]:
    """The rows of one document (its token indices `tokens`, in order): block w holds its
    positions w * ratio .. (w + 1) * ratio - 1 and rotates at position w * ratio."""
    rows = []
    for w in range(len(tokens) // a.compress_ratio):
        block = x[tokens[w * a.compress_ratio:(w + 1) * a.compress_ratio]]  # [P, dim]
        kv = block @ p["compressor.kv_proj.weight"].T
        gate = block @ p["compressor.gate_proj.weight"].T + p["compressor.position_bias"]
        weights = torch.exp(gate) / torch.exp(gate).sum(0)  # each channel over the block
        pooled = (weights * kv).sum(0)
        normed = _rms(pooled, a.norm_eps) * p["compressor.kv_norm.weight"]
        rows.append(_rotate(normed, w * a.compress_ratio, a, 1.0))
    return rows


def reference(p: dict[str, torch.Tensor], x: torch.Tensor, seq_idx: torch.Tensor,
              positions: torch.Tensor, a: DeepseekV4CompressedAttentionArgs) -> torch.Tensor:
    batch, seq_len, _ = x.shape
    out_rows = []
    for b in range(batch):
        _, q_rotated, kv_rotated = reference_projections(p, x[b], positions[b], a)
        documents = {}
        for s in range(seq_len):
            documents.setdefault(int(seq_idx[b, s]), []).append(s)
        rows_of = {doc: compressed_rows(p, x[b], tokens, a) for doc, tokens in documents.items()}
        outputs = []
        for t in range(seq_len):
            t_pos = int(positions[b, t])
            window = [kv_rotated[s] for s in documents[int(seq_idx[b, t])]
                      if t_pos - a.sliding_window < int(positions[b, s]) <= t_pos]
            # Rows of complete blocks of its document that end at or before the query.
            rows = [row for w, row in enumerate(rows_of[int(seq_idx[b, t])])
                    if (w + 1) * a.compress_ratio - 1 <= t_pos]
            assert len(rows) == (t_pos + 1) // a.compress_ratio
            kv = torch.stack(window + rows)  # [keys, D]
            outputs.append(reference_output(p, q_rotated[t], kv, t_pos, a))
        out_rows.append(torch.stack(outputs))
    return torch.stack(out_rows)


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("ratio, window", [(4, 5), (3, 1), (1, 5), (4, 40), (30, 5)],
                         ids=["ratio4", "ratio3-window1", "ratio1", "window-longer",
                              "no-block"])
def test_layer_matches_the_float64_reference_with_gradients(packed, ratio, window):
    a = small_args(compress_ratio=ratio, sliding_window=window)
    layer = randomize_(HeavilyCompressedAttention(dim=DIM, args=a), seed=1)
    layout, seq_idx, positions = token_layout(packed)
    torch.manual_seed(2)
    x = torch.randn(2, SEQ, DIM, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(2, SEQ, DIM, dtype=torch.float64)

    got = layer(x, layout)
    got_grads = torch.autograd.grad(got, [x, *layer.parameters()], grad_out,
                                    allow_unused=ratio > SEQ)
    params = {name: param.detach().clone().requires_grad_() for name, param in
              layer.named_parameters()}
    x_ref = x.detach().clone().requires_grad_()
    expected = reference(params, x_ref, seq_idx, positions, a)
    expected_grads = torch.autograd.grad(expected, [x_ref, *params.values()], grad_out,
                                         allow_unused=True)

    assert _relative(got, expected) < F64_TOL
    for name, g, e in zip(["x", *params], got_grads, expected_grads, strict=True):
        if e is None:  # no complete block: the compressor takes no part
            assert ratio > SEQ and name.startswith("compressor.") and g is None
        elif ratio == 1 and name in ("compressor.position_bias", "compressor.gate_proj.weight"):
            # The gate is a softmax over one token: 1 whatever its logit.
            assert g.abs().max() < 1e-14 and e.abs().max() < 1e-14
        else:
            assert _relative(g, e) < F64_TOL, name
    # The compressed rows and the documents matter: without them the result differs.
    if ratio <= SEQ:
        window_only = SlidingWindowAttention(dim=DIM, args=a).double()
        window_only.load_state_dict(layer.state_dict(), strict=False)
        assert _relative(window_only(x, layout), expected) > 1e-3
    if packed:
        assert _relative(layer(x, TokenLayout(None, None)), expected) > 1e-3


def test_blocks_count_from_each_document_start():
    _, seq_idx, positions = token_layout(True)
    first, complete = compression_blocks(TokenLayout(positions, seq_idx), SEQ, 4, "cpu")
    # Row 0: documents [0, 9) (blocks at 0, 4) and [9, 21) (9, 13, 17); row 1: [0, 4) (0),
    # [4, 5) and [18, 21) (none), [5, 18) (5, 9, 13). Five slots, the rest incomplete.
    assert first[0].tolist() == [0, 4, 9, 13, 17] and complete[0].all()
    assert first[1, :4].tolist() == [0, 5, 9, 13]
    assert complete[1].tolist() == [True, True, True, True, False]


# ----------------------------------------------------------------------- transformers parity
def hf_config(a: DeepseekV4CompressedAttentionArgs, hidden_size: int = DIM,
              main_theta: float = 77.0) -> DeepseekV4Config:
    # The "main" rotary base differs from the compressed layer's: the layer must take its
    # "compress" table (our rope_theta) for queries, window keys and compressed rows alike.
    # Our YaRN fields go in as a flat yarn rope_parameters, which transformers' V4 config
    # gives to the "compress" table only.
    yarn = None
    if a.rope_scaling_factor != 1.0:
        yarn = {"rope_type": "yarn", "factor": a.rope_scaling_factor,
                "original_max_position_embeddings": a.original_max_position_embeddings,
                "beta_fast": a.beta_fast, "beta_slow": a.beta_slow,
                "attention_factor": a.attention_factor}
    return DeepseekV4Config(
        hidden_size=hidden_size, num_attention_heads=a.n_heads, num_key_value_heads=1,
        head_dim=a.head_dim, q_lora_rank=a.q_lora_rank, o_groups=a.o_groups,
        o_lora_rank=a.o_lora_rank, sliding_window=a.sliding_window,
        partial_rotary_factor=a.rope_head_dim / a.head_dim, rope_theta=main_theta,
        compress_rope_theta=a.rope_theta, rope_parameters=yarn,
        compress_rates={"compressed_sparse_attention": 4,
                        "heavily_compressed_attention": a.compress_ratio},
        rms_norm_eps=a.norm_eps, num_hidden_layers=1,
        layer_types=["heavily_compressed_attention"], mlp_layer_types=["moe"],
        max_position_embeddings=256, attn_implementation="eager")


# YaRN on the small layer: 2 rotary pairs, theta 300, pretraining length 16. Pair 0 turns
# 16 / (2 pi) ~ 2.5 times over it and keeps its frequency; pair 1 turns 16 * 300^(-1/2) / (2 pi)
# ~ 0.15 times and is divided by the factor (the ramp runs over pairs 0 .. 1).
SMALL_YARN = dict(rope_scaling_factor=4.0, original_max_position_embeddings=16, beta_fast=8.0,
                  beta_slow=1.0)


def test_compress_table_matches_transformers_rotary_embedding():
    """Our cos / sin equal transformers' "compress" table: V4's sizes (64 rotary channels,
    theta 160000, YaRN factor 16 over 65536 positions, attention factor 1 by default), a
    factor of 1 (plain), and an attention factor that is not 1. The "main" table (sliding
    layers, `W`) stays plain under the same yarn config."""
    positions = torch.tensor([[0, 1, 7, 100, 4095, 65535, 300000, 1048575]])
    like = torch.zeros(1, dtype=torch.float64)
    for changes in (dict(rope_scaling_factor=16.0), dict(), dict(rope_scaling_factor=1.0),
                    dict(rope_scaling_factor=16.0, attention_factor=1.25),
                    dict(rope_scaling_factor=16.0, beta_fast=16.0, beta_slow=2.0,
                         original_max_position_embeddings=4096)):
        a = DeepseekV4CompressedAttentionArgs(n_heads=4, head_dim=512, rope_head_dim=64,
                                              **changes)
        config = hf_config(a, hidden_size=64, main_theta=10000.0)
        rotary = hf_v4.DeepseekV4RotaryEmbedding(config)
        # The scaled inverse frequencies themselves (transformers' in fp32).
        ours_freq, ours_scale = a.rotary_frequencies(torch.float64, "cpu")
        assert _relative(ours_freq, rotary.compress_inv_freq.double()) < 1e-6, changes
        assert ours_scale == rotary.compress_attention_scaling, changes
        if a.rope_scaling_factor != 1.0:  # YaRN changed some frequencies, kept others
            plain = 1.0 / a.rope_theta ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
            changed = ~torch.isclose(ours_freq, plain, rtol=1e-9)
            assert changed.any() and not changed.all(), changes
        # cos / sin at the same positions, both in fp32 (angles to 1e6 * 1 rad: fp32's own
        # rounding of the angle, ~1e6 * 6e-8, bounds the agreement).
        hf_cos, hf_sin = rotary(like.float(), position_ids=positions, layer_type="compress")
        cos, sin = rotary_cos_sin_at(a, positions, like.float())
        assert (cos - hf_cos).abs().max() < 0.1 and (sin - hf_sin).abs().max() < 0.1, changes
        # and exactly enough below 2**12 positions (fp32 angles good to ~1e-3 there), fp64 ours.
        near = positions[:, :5]
        hf_cos, hf_sin = rotary(like.float(), position_ids=near, layer_type="compress")
        cos, sin = rotary_cos_sin_at(a, near, like)
        assert (cos - hf_cos.double()).abs().max() < 1e-3, changes
        assert (sin - hf_sin.double()).abs().max() < 1e-3, changes
        # "main": plain theta 10000 whatever the compress table does.
        main_cos, _ = rotary(like.float(), position_ids=near, layer_type="main")
        window = DeepseekV4AttentionArgs(n_heads=4, head_dim=512, rope_head_dim=64)
        assert rotary.main_attention_scaling == 1.0
        assert (rotary_cos_sin_at(window, near, like)[0] - main_cos.double()).abs().max() < 1e-3


def test_small_yarn_changes_a_frequency_within_the_test_positions():
    """The parity test's YaRN config divides pair 1's frequency by the factor and keeps pair
    0's: its angles over the SEQ positions differ from plain RoPE's."""
    a = small_args(**SMALL_YARN)
    inv_freq, _ = a.rotary_frequencies(torch.float64, "cpu")
    plain, _ = small_args().rotary_frequencies(torch.float64, "cpu")
    assert torch.allclose(inv_freq[0], plain[0]) and torch.allclose(inv_freq[1], plain[1] / 4)


def hf_forward(hf: torch.nn.Module, config: DeepseekV4Config, x: torch.Tensor) -> torch.Tensor:
    """What DeepseekV4Model.forward hands its layers for one unpacked batch: the sliding-window
    mask and the "main" and "compress" rotary tables."""
    position_ids = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
    mask = create_sliding_window_causal_mask(config=config, inputs_embeds=x, attention_mask=None,
                                             cache=None, position_ids=position_ids)
    rotary = hf_v4.DeepseekV4RotaryEmbedding(config)
    tables = {kind: rotary(x, position_ids=position_ids, layer_type=kind)
              for kind in ("main", "compress")}
    return hf(x, position_embeddings=tables, position_ids=position_ids, attention_mask=mask)[0]


@pytest.mark.parametrize("rope", [{}, SMALL_YARN, SMALL_YARN | dict(attention_factor=1.25)],
                         ids=["plain-rope", "yarn", "yarn-attention-factor"])
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed-per-document"])
def test_layer_matches_transformers_deepseek_v4_attention(packed, rope):
    a = small_args(**rope)
    config = hf_config(a)
    ours, hf = transformers_twin(HeavilyCompressedAttention, a, config)
    assert isinstance(hf.compressor, hf_v4.DeepseekV4HCACompressor)
    layout, seq_idx, _ = token_layout(packed)
    x, grad_out = parity_inputs()
    expected = hf_forward_by_document(hf, config, x, seq_idx if packed else None)
    assert_matches_transformers(ours, hf, x, layout, expected, grad_out)


def hf_forward_by_document(hf: torch.nn.Module, config: DeepseekV4Config, x: torch.Tensor,
                           seq_idx: torch.Tensor | None) -> torch.Tensor:
    """hf_forward on whole rows, or (packed rows: transformers compresses whole rows) on one
    document at a time."""
    if seq_idx is None:
        return hf_forward(hf, config, x)
    rows = []
    for b in range(x.shape[0]):
        cuts = [0, *(torch.nonzero(seq_idx[b].diff()).flatten() + 1).tolist(), x.shape[1]]
        rows.append(torch.cat([hf_forward(hf, config, x[b:b + 1, start:end])
                               for start, end in zip(cuts, cuts[1:])], dim=1))
    return torch.cat(rows)


# ----------------------------------------------------------------------------- table rules
def test_tensor_parallel_layouts_split_heads_and_replicate_the_compressor():
    with torch.device("meta"):
        layer = HeavilyCompressedAttention(dim=DIM, args=small_args())
    plan = tensor_parallel_layouts(layer)
    assert {name: layout for name, layout in plan.items() if layout.shard_dim is not None} == {
        "q_b_proj.weight": TPLayout(0), "o_a_proj.weight": TPLayout(0),
        "o_b_proj.weight": TPLayout(1), "sinks": TPLayout(0)}
    assert {name for name in plan if name.startswith("compressor.")} == {
        "compressor.kv_proj.weight", "compressor.gate_proj.weight",
        "compressor.position_bias", "compressor.kv_norm.weight"}
    assert KIND.tensor_parallel_sizes(small_args(), DIM) == [
        ("heavily_compressed_attention.n_heads", 6),
        ("heavily_compressed_attention.o_groups", 3)]


def test_two_ranks_of_whole_groups_sum_to_the_layer():
    """What TP computes, by hand: each rank's heads, their groups and o_b_proj's input columns,
    with the whole compressor on both, give partial outputs that sum to the layer's output."""
    a = small_args(n_heads=4, o_groups=2)
    layer = randomize_(HeavilyCompressedAttention(dim=DIM, args=a), seed=6)
    assert_tensor_parallel_parts_sum_to_the_layer(layer)


def test_core_flops_count_the_window_the_compressed_rows_and_the_pooling():
    a = small_args()  # window 5, blocks of 4, 6 heads of 10 channels
    assert KIND.core_flops(a, DIM, 100) == 4 * (5 + 25) * 10 * 6 + 2 * 10
    assert KIND.core_flops(a, DIM, 3) == 4 * 3 * 10 * 6 + 2 * 10


@pytest.mark.parametrize("changes, message", [
    (dict(n_heads=6, o_groups=4),
     "heavily_compressed_attention: n_heads=6 is not divisible by o_groups=4"),
    (dict(rope_head_dim=3), "heavily_compressed_attention: rope_head_dim=3 must be even"),
    (dict(compress_ratio=0), "heavily_compressed_attention: compress_ratio=0 must be at least 1"),
    (dict(rope_scaling_factor=0.5),
     r"heavily_compressed_attention: rope_scaling_factor=0.5 must be at least 1 \(1: no YaRN\)"),
    (dict(rope_scaling_factor=16.0, original_max_position_embeddings=0),
     "heavily_compressed_attention: original_max_position_embeddings=0 must be at least 1"),
])
def test_validation_names_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        KIND.validate(small_args(**changes), DIM)


def test_context_parallel_needs_pieces_as_long_as_the_compressor_halo():
    """A piece reads the ratio - 1 tokens before it (the rest of a block that ends in it):
    blocks of 4 need pieces of 3 tokens (seq 16 at CP 2 has 4, seq 8 has 2)."""
    args = copy.deepcopy(hybrid_flavors["debug_v4_hca"])
    args.pattern = "MH-MH-"
    args.heavily_compressed_attention.sliding_window = 2
    job = run_from_args("--training.seq_len", "16", "--parallelism.context_parallel_degree", "2",
                        model=args)
    validate_layout(job, 2)
    job = run_from_args("--training.seq_len", "8", "--parallelism.context_parallel_degree", "2",
                        model=args)
    with pytest.raises(ValueError, match=r"pieces of 2 tokens are shorter than the DeepSeek-V4 "
                       r"heavily compressed attention compressor's halo \(3 tokens"):
        validate_layout(job, 2)

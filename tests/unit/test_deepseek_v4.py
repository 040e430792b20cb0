"""DeepSeek-V4 sliding-window attention (model/deepseek_v4.py, pattern symbol `W`).

1. A float64 reference written from the description (per-query loop over an explicit list of
   visible keys, RoPE as complex rotations, hand-written norms, sink and grouped projection):
   output, every parameter gradient and the input gradient agree to 1e-10 relative, for plain
   rows and packed rows whose documents start inside a window, with windows shorter and
   longer than the rows.
2. transformers' DeepseekV4Attention (layer type "sliding_attention") loads our state dict 1:1
   by name and gives the same output and gradients, with the mask and rotary tables its model
   builds (create_sliding_window_causal_mask, DeepseekV4RotaryEmbedding "main").
3. Table rules: TP layouts, FLOPs, validation, CP's halo rule.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DeepseekV4Config
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4

from tests.run_configs import run_from_args
from tests.unit.test_mla_dsa import randomize_  # every parameter, sinks too
from titan_hybrid.model.args import hybrid_flavors
from titan_hybrid.model.common import TPLayout, tensor_parallel_layouts
from titan_hybrid.model.deepseek_v4 import (
    KIND,
    DeepseekV4AttentionArgs,
    SlidingWindowAttention,
)
from titan_hybrid.model.layout import TokenLayout, packed_layout
from titan_hybrid.parallel.validate import validate_layout

F64_TOL = 1e-10  # relative: max |got - expected| / max |expected|
DIM, SEQ = 24, 21
# Rows of packed documents: a document starts inside the window of the queries after it.
ROW_DOCUMENTS = ([0, 9, 21], [0, 4, 5, 18, 21])


# Sizes all different (6 heads of 10 channels, 4 rotary, 3 groups of 2 heads, ranks 14 / 7),
# so that swapped sizes fail; a window of 5 tokens in 21-token rows. The compressed kinds'
# tests start from these too.
SMALL_FIELDS = dict(n_heads=6, head_dim=10, rope_head_dim=4, q_lora_rank=14, o_groups=3,
                    o_lora_rank=7, sliding_window=5, rope_theta=100.0, norm_eps=1e-6)


def small_args(**changes) -> DeepseekV4AttentionArgs:
    return DeepseekV4AttentionArgs(**(SMALL_FIELDS | changes))


def token_layout(packed: bool) -> tuple[TokenLayout, torch.Tensor, torch.Tensor]:
    """(layout, seq_idx [2, T], positions [2, T]): two plain rows or two packed ones."""
    if not packed:
        positions = torch.arange(SEQ).expand(2, SEQ)
        return TokenLayout(None, None), torch.zeros(2, SEQ, dtype=torch.int32), positions
    rows = [packed_layout(torch.tensor(cuts)) for cuts in ROW_DOCUMENTS]
    seq_idx = torch.cat([row[0] for row in rows])
    positions = torch.cat([row[1] for row in rows])
    return TokenLayout(positions, seq_idx), seq_idx, positions


# ------------------------------------------------------------------------ float64 reference
def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _rotate(x: torch.Tensor, position: int, a: DeepseekV4AttentionArgs, sign: float) -> torch.Tensor:
    """Rotate the trailing rope_head_dim channels (pairs (2i, 2i+1) as complex numbers) by
    sign * position * theta^(-2i/R)."""
    plain, rope = x[..., :-a.rope_head_dim], x[..., -a.rope_head_dim:]
    freqs = a.rope_theta ** (-torch.arange(0, a.rope_head_dim, 2, dtype=torch.float64)
                             / a.rope_head_dim)
    turn = torch.polar(torch.ones_like(freqs), sign * position * freqs)
    pairs = torch.view_as_complex(rope.reshape(*rope.shape[:-1], -1, 2).contiguous()) * turn
    return torch.cat((plain, torch.view_as_real(pairs).flatten(-2)), dim=-1)


def reference_projections(p: dict[str, torch.Tensor], x_TD: torch.Tensor,
                          positions_T: torch.Tensor, a: DeepseekV4AttentionArgs):
    """(query latent [T, q_lora_rank], each token's rotated queries [H, D], each token's
    rotated latent key / value [D]) of one row."""
    seq_len = x_TD.shape[0]
    q_latent = _rms(x_TD @ p["q_a_proj.weight"].T, a.norm_eps) * p["q_a_norm.weight"]
    q_all = _rms((q_latent @ p["q_b_proj.weight"].T).view(seq_len, a.n_heads, a.head_dim),
                 a.norm_eps)
    kv_all = _rms(x_TD @ p["kv_proj.weight"].T, a.norm_eps) * p["kv_norm.weight"]
    positions = [int(position) for position in positions_T]
    return (q_latent, [_rotate(q_all[t], positions[t], a, 1.0) for t in range(seq_len)],
            [_rotate(kv_all[s], positions[s], a, 1.0) for s in range(seq_len)])


def reference_output(p: dict[str, torch.Tensor], q_HD: torch.Tensor, kv_KD: torch.Tensor,
                     position: int, a: DeepseekV4AttentionArgs) -> torch.Tensor:
    """One query's output [dim]: softmax over its keys with the sink, the inverse rotation,
    the grouped output projection."""
    width = a.n_heads // a.o_groups * a.head_dim
    weights = torch.exp(q_HD @ kv_KD.T / a.head_dim ** 0.5)  # [H, keys]
    total = weights.sum(-1) + torch.exp(p["sinks"])
    heads = _rotate((weights / total[:, None]) @ kv_KD, position, a, -1.0)  # [H, D]
    groups = heads.reshape(a.o_groups, width)
    blocks = p["o_a_proj.weight"].view(a.o_groups, a.o_lora_rank, width)
    low_rank = torch.cat([blocks[g] @ groups[g] for g in range(a.o_groups)])
    return p["o_b_proj.weight"] @ low_rank


def reference(p: dict[str, torch.Tensor], x: torch.Tensor, seq_idx: torch.Tensor,
              positions: torch.Tensor, a: DeepseekV4AttentionArgs) -> torch.Tensor:
    batch, seq_len, _ = x.shape
    rows = []
    for b in range(batch):
        _, q_rotated, kv_rotated = reference_projections(p, x[b], positions[b], a)
        outputs = []
        for t in range(seq_len):
            t_pos = int(positions[b, t])
            keys = [s for s in range(seq_len) if seq_idx[b, s] == seq_idx[b, t]
                    and t_pos - a.sliding_window < int(positions[b, s]) <= t_pos]
            assert t in keys
            kv = torch.stack([kv_rotated[s] for s in keys])  # [keys, D]
            outputs.append(reference_output(p, q_rotated[t], kv, t_pos, a))
        rows.append(torch.stack(outputs))
    return torch.stack(rows)


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("window", [5, 1, 40], ids=["window5", "window1", "window-longer"])
def test_layer_matches_the_float64_reference_with_gradients(packed, window):
    a = small_args(sliding_window=window)
    layer = randomize_(SlidingWindowAttention(dim=DIM, args=a), seed=1)
    layout, seq_idx, positions = token_layout(packed)
    torch.manual_seed(2)
    x = torch.randn(2, SEQ, DIM, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(2, SEQ, DIM, dtype=torch.float64)

    got = layer(x, layout)
    got_grads = torch.autograd.grad(got, [x, *layer.parameters()], grad_out)
    params = {name: param.detach().clone().requires_grad_() for name, param in
              layer.named_parameters()}
    x_ref = x.detach().clone().requires_grad_()
    expected = reference(params, x_ref, seq_idx, positions, a)
    expected_grads = torch.autograd.grad(expected, [x_ref, *params.values()], grad_out)

    assert _relative(got, expected) < F64_TOL
    names = ["x", *params]
    for name, g, e in zip(names, got_grads, expected_grads, strict=True):
        assert _relative(g, e) < F64_TOL, name
    # The window and the documents matter: without them the result differs.
    if window == 5:
        wider = SlidingWindowAttention(dim=DIM, args=small_args(sliding_window=6)).double()
        wider.load_state_dict(layer.state_dict())
        assert _relative(wider(x, layout), expected) > 1e-3
    if packed and window > 1:
        assert _relative(layer(x, TokenLayout(None, None)), expected) > 1e-3


def test_query_blocks_give_the_one_block_result():
    """Rows longer than the window go in blocks of `window` queries; a window longer than the
    row is one block over all keys: both are the reference's numbers (above), and the blocked
    path agrees with a single block whose window covers exactly the same keys."""
    a = small_args(sliding_window=4)
    layer = randomize_(SlidingWindowAttention(dim=DIM, args=a), seed=5)
    layout, _, _ = token_layout(True)
    x = torch.randn(2, SEQ, DIM, dtype=torch.float64)
    whole = torch.cat([layer(x[:, :end], TokenLayout(layout.positions[:, :end],
                                                     layout.seq_idx[:, :end]))[:, -1:]
                       for end in range(1, SEQ + 1)], dim=1)
    assert _relative(layer(x, layout), whole) < F64_TOL


# ----------------------------------------------------------------------- transformers parity
def hf_config(a: DeepseekV4AttentionArgs) -> DeepseekV4Config:
    return DeepseekV4Config(
        hidden_size=DIM, num_attention_heads=a.n_heads, num_key_value_heads=1,
        head_dim=a.head_dim, q_lora_rank=a.q_lora_rank, o_groups=a.o_groups,
        o_lora_rank=a.o_lora_rank, sliding_window=a.sliding_window,
        partial_rotary_factor=a.rope_head_dim / a.head_dim, rope_theta=a.rope_theta,
        rms_norm_eps=a.norm_eps, num_hidden_layers=1, layer_types=["sliding_attention"],
        mlp_layer_types=["moe"], max_position_embeddings=256, attn_implementation="eager")


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_layer_matches_transformers_deepseek_v4_attention(packed):
    a = small_args()
    config = hf_config(a)
    ours, hf = transformers_twin(SlidingWindowAttention, a, config)
    layout, _, positions = token_layout(packed)
    x, grad_out = parity_inputs()

    # What DeepseekV4Model.forward hands its layers: the sliding-window mask (packed rows are
    # found from restarting position ids) and the "main" rotary table.
    position_ids = positions.long()
    mask = create_sliding_window_causal_mask(config=config, inputs_embeds=x, attention_mask=None,
                                             cache=None, position_ids=position_ids)
    assert mask is not None
    rope = hf_v4.DeepseekV4RotaryEmbedding(config)(x, position_ids=position_ids,
                                                   layer_type="main")
    expected = hf(x, position_embeddings={"main": rope}, position_ids=position_ids,
                  attention_mask=mask)[0]
    assert_matches_transformers(ours, hf, x, layout, expected, grad_out)


def transformers_twin(layer_type, a, config: DeepseekV4Config):
    """(ours, transformers' DeepseekV4Attention) with the same random weights, float64: the
    same parameters under the same names, none left over on either side."""
    hf = randomize_(hf_v4.DeepseekV4Attention(config, layer_idx=0), seed=3)
    ours = layer_type(dim=DIM, args=a).to(torch.float64)
    assert sorted(ours.state_dict()) == sorted(hf.state_dict())
    ours.load_state_dict(hf.state_dict(), strict=True)
    return ours, hf


def parity_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """(x, the output's cotangent) of the transformers parity tests."""
    torch.manual_seed(4)
    return (torch.randn(2, SEQ, DIM, dtype=torch.float64, requires_grad=True),
            torch.randn(2, SEQ, DIM, dtype=torch.float64))


def assert_matches_transformers(ours, hf, x, layout, expected, grad_out,
                                no_gradient: str | None = None) -> None:
    """Our layer's output and its gradients (input and every parameter, by name) against
    transformers' `expected` output of the same input and weights; the parameters under the
    prefix `no_gradient` get none in either."""
    expected_grads = torch.autograd.grad(expected, [x, *hf.parameters()], grad_out,
                                         allow_unused=no_gradient is not None)
    got = _output(ours(x, layout))
    got_grads = torch.autograd.grad(got, [x, *ours.parameters()], grad_out,
                                    allow_unused=no_gradient is not None)
    # transformers computes its rotary angles in fp32 (positions.float() * inv_freq): 1e-6.
    assert _relative(got, expected) < 1e-6
    hf_grads = dict(zip(["x", *dict(hf.named_parameters())], expected_grads, strict=True))
    for name, g in zip(["x", *dict(ours.named_parameters())], got_grads, strict=True):
        if no_gradient is not None and name.startswith(no_gradient):
            assert g is None and hf_grads[name] is None, name
        else:
            assert _relative(g, hf_grads[name]) < 1e-6, name


# ----------------------------------------------------------------------------- table rules
def test_tensor_parallel_layouts_split_heads_and_groups():
    with torch.device("meta"):
        layer = SlidingWindowAttention(dim=DIM, args=small_args())
    plan = tensor_parallel_layouts(layer)
    assert plan == {
        "q_a_proj.weight": TPLayout(None), "q_a_norm.weight": TPLayout(None),
        "q_b_proj.weight": TPLayout(0), "kv_proj.weight": TPLayout(None),
        "kv_norm.weight": TPLayout(None), "o_a_proj.weight": TPLayout(0),
        "o_b_proj.weight": TPLayout(1), "sinks": TPLayout(0)}
    assert KIND.tensor_parallel_sizes(small_args(), DIM) == [
        ("window_attention.n_heads", 6), ("window_attention.o_groups", 3)]


def test_two_ranks_of_whole_groups_sum_to_the_layer():
    """What TP computes, by hand: each rank's heads (q_b_proj rows, sinks), their groups
    (o_a_proj rows) and o_b_proj's input columns give partial outputs that sum to the
    layer's output."""
    a = small_args(n_heads=4, o_groups=2)
    layer = randomize_(SlidingWindowAttention(dim=DIM, args=a), seed=6)
    assert_tensor_parallel_parts_sum_to_the_layer(layer)


def assert_tensor_parallel_parts_sum_to_the_layer(layer) -> None:
    """Two copies of `layer`, each with its rank's half of every sharded parameter (its
    declared TP layout), give outputs that sum to the whole layer's."""
    layout, _, _ = token_layout(True)
    x = torch.randn(2, SEQ, DIM, dtype=torch.float64)
    total = 0
    for rank in range(2):
        part = copy.deepcopy(layer)
        for name, layout_of in tensor_parallel_layouts(layer).items():
            if layout_of.shard_dim is not None:
                param = part.get_parameter(name)
                param.data = param.data.chunk(2, dim=layout_of.shard_dim)[rank].clone()
        total = total + _output(part(x, layout))
    assert _relative(total, _output(layer(x, layout))) < F64_TOL


def _output(result):
    """A layer's output, without the auxiliary loss of the kinds that return one."""
    return result[0] if isinstance(result, tuple) else result


def test_core_flops_count_the_window():
    a = small_args()
    assert KIND.core_flops(a, DIM, 100) == 4 * 5 * 10 * 6
    assert KIND.core_flops(a, DIM, 3) == 4 * 3 * 10 * 6


@pytest.mark.parametrize("changes, message", [
    (dict(n_heads=6, o_groups=4), "window_attention: n_heads=6 is not divisible by o_groups=4"),
    (dict(rope_head_dim=3), "window_attention: rope_head_dim=3 must be even"),
    (dict(rope_head_dim=12), "window_attention: rope_head_dim=12 must be even"),
    (dict(sliding_window=0), "window_attention: sliding_window=0 must be at least 1"),
])
def test_validation_names_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        KIND.validate(small_args(**changes), DIM)


def test_context_parallel_needs_pieces_as_long_as_the_window_halo():
    def job(seq_len):
        return run_from_args("--training.seq_len", str(seq_len),
                             "--parallelism.context_parallel_degree", "2",
                             model=hybrid_flavors["debug_v4"])

    validate_layout(job(64), 2)  # pieces of 16 >= 15 halo rows
    with pytest.raises(ValueError, match=r"training.seq_len=32 with context_parallel_degree=2: "
                       r"pieces of 8 tokens are shorter than the DeepSeek-V4 sliding-window "
                       r"attention window's halo \(15 tokens\)"):
        validate_layout(job(32), 2)

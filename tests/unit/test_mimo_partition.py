"""MIMO language-input partitioning, single process: exact shard contents for every rank of a
CP x TP layout (sizes passed directly), the local packed-sequence description, every error."""

import pytest
import torch

from titan_hybrid.mimo import PackedSeqParams, PartitionAdapter, shard_language_inputs


def coded_inputs(seq: int, batch: int = 2, hidden: int = 3):
    """embeddings[s, b, h] = s*1000 + b*100 + h; labels[b, s] = b*1000 + s; loss_mask = -labels."""
    s = torch.arange(seq)[:, None, None]
    b = torch.arange(batch)[None, :, None]
    embeddings = (s * 1000 + b * 100 + torch.arange(hidden)).double()
    labels = (torch.arange(batch)[:, None] * 1000 + torch.arange(seq)).long()
    return embeddings, labels, -labels.double()


def kept(starts_and_lengths, cp: int, rank: int) -> list[int]:
    """Expected positions by hand: each sequence in 2*cp chunks, rank keeps r then 2cp-1-r."""
    out = []
    for start, length in starts_and_lengths:
        chunk = length // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            out += [start + c * chunk + k for k in range(chunk)]
    return out


def check_contents(outputs, positions, sp_positions, batch=2, hidden=3):
    embeddings, labels, loss_mask, _ = outputs
    expected_e = torch.tensor([[[s * 1000 + b * 100 + h for h in range(hidden)]
                                for b in range(batch)] for s in sp_positions]).double()
    expected_l = torch.tensor([[b * 1000 + s for s in positions] for b in range(batch)])
    assert torch.equal(embeddings, expected_e)
    assert torch.equal(labels, expected_l)
    assert torch.equal(loss_mask, -expected_l.double())


@pytest.mark.parametrize("cp, tp, sp, seq", [(2, 1, False, 8), (4, 1, False, 16), (1, 2, True, 6),
                                             (2, 2, True, 16), (2, 2, False, 8),
                                             (2, 3, True, 24)])
def test_every_rank_holds_exactly_its_zigzag_then_sp_slice(cp, tp, sp, seq):
    inputs = coded_inputs(seq)
    for cp_rank in range(cp):
        positions = kept([(0, seq)], cp, cp_rank) if cp > 1 else list(range(seq))
        for tp_rank in range(tp):
            piece = len(positions) // tp
            sp_positions = positions[tp_rank * piece:(tp_rank + 1) * piece] if sp else positions
            out = shard_language_inputs(*inputs, cp_size=cp, cp_rank=cp_rank, tp_size=tp,
                                        tp_rank=tp_rank, sequence_parallel=sp)
            check_contents(out, positions, sp_positions)  # labels: CP-sharded, never SP
            assert out[3] is None


def test_cp2_zigzag_by_hand():
    _, labels, loss_mask = coded_inputs(8, batch=1)
    rank0 = shard_language_inputs(None, labels, loss_mask, cp_size=2, cp_rank=0)[1]
    rank1 = shard_language_inputs(None, labels, loss_mask, cp_size=2, cp_rank=1)[1]
    assert rank0.tolist() == [[0, 1, 6, 7]] and rank1.tolist() == [[2, 3, 4, 5]]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_cp_shards_over_all_ranks_are_a_permutation_of_the_sequence(cp):
    seq = 2 * cp * 5
    embeddings, labels, loss_mask = coded_inputs(seq)
    shards = [shard_language_inputs(embeddings, labels, loss_mask, cp_size=cp, cp_rank=r)
              for r in range(cp)]
    union = torch.cat([e for e, *_ in shards])
    assert sorted(union[:, 0, 0].long().div(1000, rounding_mode="floor").tolist()) \
        == list(range(seq))
    assert torch.equal(union.sort(dim=0).values, embeddings)
    assert torch.equal(torch.cat([l for _, l, *_ in shards], dim=1).sort(dim=1).values, labels)


def test_embeddings_none_still_shards_labels_and_loss_mask():
    _, labels, loss_mask = coded_inputs(16)
    out = shard_language_inputs(None, labels, loss_mask, cp_size=2, cp_rank=1, tp_size=2,
                                tp_rank=1, sequence_parallel=True)
    assert out[0] is None
    expected = torch.tensor([[b * 1000 + s for s in kept([(0, 16)], 2, 1)] for b in range(2)])
    assert torch.equal(out[1], expected) and torch.equal(out[2], -expected.double())


def test_no_parallelism_and_tp_without_sp_return_the_inputs():
    inputs = coded_inputs(6)
    for kwargs in ({}, {"tp_size": 2, "tp_rank": 1}):
        out = shard_language_inputs(*inputs, cp_size=1, cp_rank=0, **kwargs)
        assert all(a is b for a, b in zip(out[:3], inputs))


def test_sharding_is_differentiable_and_dropped_positions_get_zero_gradient():
    embeddings = coded_inputs(8)[0].requires_grad_()
    _, labels, loss_mask = coded_inputs(8)
    out = shard_language_inputs(embeddings, labels, loss_mask, cp_size=2, cp_rank=0, tp_size=2,
                                tp_rank=1, sequence_parallel=True)[0]
    out.sum().backward()
    assert embeddings.grad[:, 0, 0].tolist() == [0, 0, 0, 0, 0, 0, 1, 1]


def packed(real, padded=None):
    as_tensor = (lambda b: None if b is None else torch.tensor(b, dtype=torch.int32))
    return PackedSeqParams(cu_seqlens_q=as_tensor(real), cu_seqlens_kv=as_tensor(real),
                           cu_seqlens_q_padded=as_tensor(padded),
                           cu_seqlens_kv_padded=as_tensor(padded))


def test_thd_without_padding_zigzags_each_sequence_and_describes_the_local_row():
    bounds = [0, 4, 12, 16]
    embeddings, labels, loss_mask = coded_inputs(16, batch=1)
    for rank in range(2):
        positions = kept([(0, 4), (4, 8), (12, 4)], 2, rank)
        out = shard_language_inputs(embeddings, labels, loss_mask, packed(bounds), cp_size=2,
                                    cp_rank=rank)
        check_contents(out, positions, positions, batch=1)
        params = out[3]
        for field in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded",
                      "cu_seqlens_kv_padded"):
            assert getattr(params, field).tolist() == [0, 2, 6, 8], field
            assert getattr(params, field).dtype == torch.int32
        assert params.max_seqlen_q == params.max_seqlen_kv == 4


def test_thd_with_padding_counts_the_local_real_tokens():
    # Sequences with 3 real of 4 padded and 5 real of 12 padded; chunks of 1 and 3 for cp=2.
    # rank 0 keeps 0 | 3 (pad) and 4,5,6 (real) | 13,14,15 (pad); rank 1: 1,2 | 7,8 real, 9-12.
    params = packed([0, 3, 8], [0, 4, 16])
    embeddings, labels, loss_mask = coded_inputs(16, batch=1)
    expected_real = {0: [0, 1, 4], 1: [0, 2, 4]}
    for rank in range(2):
        out = shard_language_inputs(embeddings, labels, loss_mask, params, cp_size=2,
                                    cp_rank=rank)
        positions = kept([(0, 4), (4, 12)], 2, rank)
        check_contents(out, positions, positions, batch=1)
        local = out[3]
        assert local.cu_seqlens_q.tolist() == local.cu_seqlens_kv.tolist() == expected_real[rank]
        assert local.cu_seqlens_q_padded.tolist() == [0, 2, 8]
        assert local.cu_seqlens_kv_padded.tolist() == [0, 2, 8]
        assert local.max_seqlen_q == local.max_seqlen_kv == 6
    assert params.cu_seqlens_q.tolist() == [0, 3, 8]  # the input is not modified


def test_thd_with_sp_scatters_embeddings_of_the_local_row():
    params = packed([0, 8, 16])
    embeddings, labels, loss_mask = coded_inputs(16, batch=1)
    positions = kept([(0, 8), (8, 8)], 2, 1)
    out = shard_language_inputs(embeddings, labels, loss_mask, params, cp_size=2, cp_rank=1,
                                tp_size=2, tp_rank=1, sequence_parallel=True)
    check_contents(out, positions, positions[4:], batch=1)
    assert out[3].cu_seqlens_q.tolist() == [0, 4, 8]


def test_thd_with_cp1_returns_the_params_unchanged():
    params = packed([0, 3, 7], [0, 4, 8])
    inputs = coded_inputs(8, batch=1)
    out = shard_language_inputs(*inputs, params, cp_size=1, cp_rank=0)
    assert out[3] is params and all(a is b for a, b in zip(out[:3], inputs))


def test_adapter_without_groups_has_degree_one():
    adapter = PartitionAdapter(sequence_parallel=True)
    assert (adapter.cp_size, adapter.cp_rank, adapter.tp_size, adapter.tp_rank) == (1, 0, 1, 0)
    inputs = coded_inputs(5)
    assert all(a is b for a, b in zip(adapter.shard(*inputs)[:3], inputs))


def error(match, *args, **kwargs):
    with pytest.raises(ValueError, match=match):
        shard_language_inputs(*args, **kwargs)


def test_divisibility_errors_name_field_value_and_rule():
    error(r"sequence length S=12 is not divisible by 2 \* cp_size = 8", *coded_inputs(12),
          cp_size=4, cp_rank=0)
    error(r"sequence length S=5 is not divisible by tp_size = 2", *coded_inputs(5), cp_size=1,
          cp_rank=0, tp_size=2, tp_rank=0, sequence_parallel=True)
    # S / cp = 6 would split over tp=2, but the rule is S % (2 * cp * tp).
    error(r"sequence length S=12 is not divisible by 2 \* cp_size \* tp_size = 8",
          *coded_inputs(12), cp_size=2, cp_rank=0, tp_size=2, tp_rank=0, sequence_parallel=True)
    inputs = coded_inputs(12, batch=1)
    error(r"padded length of packed sequence 1=6 is not divisible by 2 \* cp_size = 4",
          *inputs, packed([0, 4, 10, 12], [0, 4, 10, 12]), cp_size=2, cp_rank=0)
    error(r"local packed length T / cp_size=6 is not divisible by tp_size = 4", *inputs,
          packed([0, 4, 12]), cp_size=2, cp_rank=0, tp_size=4, tp_rank=0, sequence_parallel=True)
    error(r"local packed length T / cp_size=3 is not divisible by tp_size = 2",
          *coded_inputs(3, batch=1), packed([0, 3]), cp_size=1, cp_rank=0, tp_size=2, tp_rank=0,
          sequence_parallel=True)


def test_dense_attention_mask_is_rejected_with_cp_and_ignored_without():
    inputs = coded_inputs(8)
    mask = torch.ones(2, 1, 8, 8, dtype=torch.bool)
    error(r"dense attention_mask .* \(cp_size=2\): use causal masking, or packed sequences "
          r"\(THD", *inputs, None, mask, cp_size=2, cp_rank=0)
    out = shard_language_inputs(*inputs, None, mask, cp_size=1, cp_rank=0)
    assert all(a is b for a, b in zip(out[:3], inputs))


def test_shape_and_params_errors():
    embeddings, labels, loss_mask = coded_inputs(8)
    error(r"embeddings \(6, 2, 3\) must be sequence-first \[S, B, H\] with S=8 and B=2",
          embeddings[:6], labels, loss_mask, cp_size=1, cp_rank=0)
    error(r"embeddings \(2, 8, 3\)", embeddings.transpose(0, 1), labels, loss_mask, cp_size=1,
          cp_rank=0)
    error(r"labels \(2, 8\) and loss_mask \(2, 7\) must both be \[B, S\]", embeddings, labels,
          loss_mask[:, :7], cp_size=1, cp_rank=0)
    error(r"packed sequences \(THD\) are one row: labels batch B=2 must be 1", embeddings, labels,
          loss_mask, packed([0, 8]), cp_size=2, cp_rank=0)
    inputs = coded_inputs(8, batch=1)
    error(r"cu_seqlens_q_padded ends at 6 but the packed row has T=8", *inputs,
          packed([0, 6], [0, 6]), cp_size=2, cp_rank=0)
    error(r"cu_seqlens_q=\[0, 5, 6\] must describe the same sequences", *inputs,
          packed([0, 5, 6], [0, 4, 8]), cp_size=2, cp_rank=0)
    error(r"cu_seqlens_q=\[0, 8, 4\] must be non-decreasing", *inputs, packed([0, 8, 4]),
          cp_size=2, cp_rank=0)
    mismatched = packed([0, 4, 8])
    mismatched.cu_seqlens_kv = torch.tensor([0, 2, 8], dtype=torch.int32)
    error(r"cu_seqlens_kv must equal cu_seqlens_q", *inputs, mismatched, cp_size=2, cp_rank=0)
    error(r"needs cu_seqlens_q", *inputs, PackedSeqParams(), cp_size=2, cp_rank=0)
    error(r"cp_rank=2 is not a rank of a cp group of size 2", *inputs, cp_size=2, cp_rank=2)
    with pytest.raises(ValueError, match=r"PackedSeqParams.qkv_format='sbhd' is not supported"):
        PackedSeqParams(qkv_format="sbhd")


def test_the_vision_language_example_refuses_a_tied_head():
    """Its front end owns the embedding, so a head tied to the language model's would train
    a weight no token reads."""
    import dataclasses

    from titan_hybrid.mimo.vision_language import VisionLanguageModel
    from titan_hybrid.model.args import hybrid_flavors

    args = dataclasses.replace(hybrid_flavors["debug"], pattern="M*", enable_weight_tying=True)
    with pytest.raises(ValueError, match="enable_weight_tying=True: this example's front end "
                                         "owns the embedding"):
        VisionLanguageModel(args, vision_dim=8, image_token_id=1)

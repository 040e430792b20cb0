"""Worker for test_context_parallel.py, run under torchrun: the same float64 model on one device
and with context parallelism over all ranks (zigzag shards), on plain rows and on packed rows.
Compares every token's logits and every parameter gradient (summed over CP ranks, as data
parallelism over the "fsdp" mesh would) with the one-device run.

Prints one line `RESULT {json}` on rank 0.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json

import torch
import torch.distributed as dist

import titan_hybrid.torchtitan_plugin  # noqa: F401  (TrainSpec, dataset; CPU runtime)
from tests import throwaway_kind
from titan_hybrid.data.zigzag import packed_zigzag_index, zigzag_index
from titan_hybrid.model.args import (
    AttentionArgs,
    DeepseekV4AttentionArgs,
    DeepseekV4CompressedAttentionArgs,
    DeepseekV4SparseAttentionArgs,
    DSAArgs,
    GDNArgs,
    KDAArgs,
    MambaArgs,
    MLAArgs,
    MLPArgs,
    hybrid_flavors,
)
from titan_hybrid.model.layout import packed_layout
from titan_hybrid.model.model import HybridModel
from titan_hybrid.parallel.collectives import record_traffic
from titan_hybrid.parallel.context_parallel import apply_context_parallel


def logits_and_aux(out):
    return out[:2] if isinstance(out, tuple) else (out, 0.0)


def compare(pattern: str, mamba_groups: int, cp: int, rank: int, linear_mode: str) -> dict:
    """Float64 logits and gradients of one pattern under CP against one device. Packed rows:
    head_a2a takes each document zigzagged on its own (the vision-language packer's layout),
    chunkwise the row zigzagged as a whole (the trainer's), with documents crossing pieces."""
    # The debug flavor's args, with the section of the tests' throwaway kind (`Z`).
    throwaway_kind.register()
    debug = hybrid_flavors["debug"]
    with_throwaway = throwaway_kind.ArgsWithThrowaway(
        **{f.name: getattr(debug, f.name) for f in dataclasses.fields(debug)})
    args = dataclasses.replace(
        with_throwaway, dim=32, vocab_size=64, max_seq_len=64, pattern=pattern,
        attention=AttentionArgs(n_heads=4, n_kv_heads=2, head_dim=8),
        mlp=MLPArgs(hidden_dim=24),
        mamba=MambaArgs(d_state=4, head_dim=8, n_groups=mamba_groups, chunk_size=8),
        gdn=GDNArgs(key_head_dim=8, value_head_dim=6, n_key_heads=2, n_value_heads=4),
        kda=KDAArgs(head_dim=8, n_heads=4),
        # a 6-token window over 8-token pieces: most windows reach into the piece before
        window_attention=DeepseekV4AttentionArgs(n_heads=4, head_dim=8, rope_head_dim=4,
                                                 q_lora_rank=16, o_groups=2, o_lora_rank=6,
                                                 sliding_window=6),
        # Blocks of 3 (C, overlapping: a 5-token halo) and 4 (H: a 3-token halo) over 8-token
        # pieces, so blocks straddle pieces; C keeps 3 of up to 10 rows and trains its indexer.
        compressed_sparse_attention=DeepseekV4SparseAttentionArgs(
            n_heads=4, head_dim=8, rope_head_dim=4, q_lora_rank=16, o_groups=2, o_lora_rank=6,
            sliding_window=6, compress_ratio=3, index_n_heads=2, index_head_dim=8, index_topk=3,
            indexer_loss_coeff=0.1),
        heavily_compressed_attention=DeepseekV4CompressedAttentionArgs(
            n_heads=4, head_dim=8, rope_head_dim=4, q_lora_rank=16, o_groups=2, o_lora_rank=6,
            sliding_window=5, compress_ratio=4),
        mla=MLAArgs(n_heads=4, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
                    qk_rope_head_dim=4, v_head_dim=6),
        # 6 of up to 32 keys per query, and a trained indexer.
        dsa=DSAArgs(n_heads=4, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
                    qk_rope_head_dim=4, v_head_dim=6, index_n_heads=2, index_head_dim=8,
                    index_topk=6, indexer_loss_coeff=0.1))
    reference = HybridModel(args)
    reference.init_weights()
    reference.double()
    model = copy.deepcopy(reference)
    apply_context_parallel(model, dist.group.WORLD, linear_mode)

    seq_len = 8 * cp * 2
    tokens = torch.randint(0, 64, (2, seq_len), generator=torch.Generator().manual_seed(1))
    # chunkwise: documents that start inside a piece, exactly at a piece's start, and that
    # span several pieces (and ranks); head_a2a: lengths divisible by 2 * cp (per document)
    bounds = ([0, 3 * cp + 1, 8 * cp, 13 * cp, seq_len] if linear_mode == "chunkwise" else
              [0, 4 * cp, 10 * cp, seq_len])
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
    seq_idx, positions = packed_layout(cu_seqlens)
    report = {}
    for case in ("plain", "packed"):
        if case == "plain":
            index = zigzag_index(seq_len, cp, rank)
            full_kwargs = {}
            local_kwargs = {"positions": index[None].expand(2, -1)}
        else:
            index = (zigzag_index(seq_len, cp, rank) if linear_mode == "chunkwise" else
                     packed_zigzag_index(cu_seqlens, cp, rank))
            full_kwargs = {"positions": positions.expand(2, -1), "seq_idx": seq_idx.expand(2, -1)}
            local_kwargs = {name: value[:, index] for name, value in full_kwargs.items()}
        for m in (reference, model):
            m.zero_grad()
        want, want_aux = logits_and_aux(reference(tokens, **full_kwargs))
        (want.square().mean() + want_aux).backward()
        got, got_aux = logits_and_aux(model(tokens[:, index], **local_kwargs))
        # The same scalar: each rank's share of the mean over all tokens (an auxiliary loss
        # is a mean over each rank's own tokens, which are half of them).
        (got.square().sum() / want.numel() + got_aux / cp).backward()

        logits_error = (got - want[:, index]).abs().max().item()
        grad_errors = {}
        for (name, p_ref), (_, p) in zip(reference.named_parameters(), model.named_parameters()):
            grad = p.grad.clone()
            dist.all_reduce(grad)
            grad_errors[name] = ((grad - p_ref.grad).abs().max() / p_ref.grad.abs().max()).item()
        errors = [None] * cp
        dist.all_gather_object(errors, {"logits": logits_error, "grads": grad_errors})
        report[case] = {
            "logits": max(e["logits"] for e in errors),
            "grads": max(max(e["grads"].values()) for e in errors),
            "worst_grad": max(errors[0]["grads"], key=errors[0]["grads"].get),
            "logit_scale": want.abs().max().item(),
        }
    return report


def count_traffic(cp: int, rank: int, linear_mode: str) -> dict:
    """Bytes this rank receives in the forward and the backward of a one-`M`-layer float64 model,
    as parallel/collectives.record_traffic counts them, with and without packed documents."""
    args = dataclasses.replace(
        hybrid_flavors["debug"], dim=32, vocab_size=64, max_seq_len=64, pattern="M",
        mamba=MambaArgs(d_state=4, head_dim=8, n_groups=2, chunk_size=8))
    model = HybridModel(args)
    model.init_weights()
    model.double()
    apply_context_parallel(model, dist.group.WORLD, linear_mode)
    seq_len = 8 * cp * 2
    index = zigzag_index(seq_len, cp, rank)
    tokens = torch.randint(0, 64, (2, seq_len), generator=torch.Generator().manual_seed(1))
    seq_idx, positions = packed_layout(torch.tensor([0, 5, seq_len], dtype=torch.int32))
    counted = {"args": {"seq_len": seq_len, "batch": 2}}
    for case, kwargs in (("plain", {"positions": index[None].expand(2, -1)}),
                         ("packed", {"positions": positions.expand(2, -1)[:, index],
                                     "seq_idx": seq_idx.expand(2, -1)[:, index]})):
        with record_traffic() as forward:
            logits = model(tokens[:, index], **kwargs)
        with record_traffic() as backward:
            logits.square().mean().backward()
        counted[case] = {"forward": sum(forward.received),
                         "backward": sum(backward.received)}
    return counted


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pattern", default="M*G-M", help="comma-separated patterns")
    parser.add_argument("--mamba-groups", type=int, default=2)
    parser.add_argument("--linear-mode", default="head_a2a")
    parser.add_argument("--count-traffic", action="store_true")
    options = parser.parse_args()
    dist.init_process_group("gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    if options.count_traffic:
        results = count_traffic(cp, rank, options.linear_mode)
    else:
        results = {pattern: compare(pattern, options.mamba_groups, cp, rank,
                                    options.linear_mode)
                   for pattern in options.pattern.split(",")}
    if rank == 0:
        print("RESULT " + json.dumps(results), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

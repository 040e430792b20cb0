"""Worker for test_mimo_partition.py, run under torchrun: every rank shards the same coded inputs
with a PartitionAdapter built from explicit CP / TP groups of a (cp, tp) device mesh and checks
its exact contents against positions worked out here by plain loops.

World size 2 runs the CP-only, SP-only, packed (THD) CP and dense-mask cases; world size 4 runs
CP x SP and packed CP x SP. Prints one line `RESULT {json}` on rank 0: per case, one entry per
global rank.
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

# The partitioner needs only torch. Skipping the package __init__ (torchtitan, TrainSpec
# registration: ~9 s of imports per process) keeps the 4-rank launch cheap on 2 cores.
_package = types.ModuleType("titan_hybrid")
_package.__path__ = [str(Path(__file__).resolve().parents[2] / "titan_hybrid")]
sys.modules.setdefault("titan_hybrid", _package)

from titan_hybrid.mimo import PackedSeqParams, PartitionAdapter  # noqa: E402

BATCH, HIDDEN = 2, 3


def coded(seq: int, batch: int):
    """embeddings[s, b, h] = s*1000 + b*100 + h; labels[b, s] = b*1000 + s; loss_mask = -labels."""
    embeddings = torch.tensor([[[s * 1000 + b * 100 + h for h in range(HIDDEN)]
                                for b in range(batch)] for s in range(seq)], dtype=torch.float32)
    labels = torch.tensor([[b * 1000 + s for s in range(seq)] for b in range(batch)])
    return embeddings, labels, -labels.float()


def expected_positions(docs: list[tuple[int, int]], cp: int, cp_rank: int) -> list[int]:
    """docs: (start, padded length). Chunks of length / (2 cp); this rank keeps cp_rank, then
    2 cp - 1 - cp_rank, of every document."""
    positions = []
    for start, length in docs:
        chunk = length // (2 * cp)
        for number in (cp_rank, 2 * cp - 1 - cp_rank):
            for k in range(chunk):
                positions.append(start + number * chunk + k)
    return positions


def run_case(mesh, *, use_cp: bool, use_tp: bool, seq: int, batch: int, docs=None, real=None):
    cp, tp = mesh["cp"].size(), mesh["tp"].size()
    cp_rank, tp_rank = mesh.get_local_rank("cp"), mesh.get_local_rank("tp")
    adapter = PartitionAdapter(cp_group=mesh.get_group("cp") if use_cp else None,
                               tp_group=mesh.get_group("tp") if use_tp else None,
                               sequence_parallel=True)
    params = None
    if docs is not None:
        padded = [0]
        for _, length in docs:
            padded.append(padded[-1] + length)
        real_bounds = [0]
        for length in real:
            real_bounds.append(real_bounds[-1] + length)
        params = PackedSeqParams(cu_seqlens_q=torch.tensor(real_bounds, dtype=torch.int32),
                                 cu_seqlens_kv=torch.tensor(real_bounds, dtype=torch.int32),
                                 cu_seqlens_q_padded=torch.tensor(padded, dtype=torch.int32),
                                 cu_seqlens_kv_padded=torch.tensor(padded, dtype=torch.int32))
    embeddings, labels, loss_mask, local = adapter.shard(*coded(seq, batch), params)

    positions = expected_positions(docs or [(0, seq)], cp, cp_rank) if use_cp else list(range(seq))
    piece = len(positions) // tp if use_tp else len(positions)
    mine = positions[tp_rank * piece:(tp_rank + 1) * piece] if use_tp else positions
    want_e = torch.tensor([[[s * 1000 + b * 100 + h for h in range(HIDDEN)] for b in range(batch)]
                           for s in mine], dtype=torch.float32)
    want_l = torch.tensor([[b * 1000 + s for s in positions] for b in range(batch)])
    result = {"sizes": [adapter.cp_size, adapter.cp_rank, adapter.tp_size, adapter.tp_rank],
              "mesh": [cp_rank, tp_rank],
              "embeddings_ok": torch.equal(embeddings, want_e),
              "labels_ok": torch.equal(labels, want_l),
              "loss_mask_ok": torch.equal(loss_mask, -want_l.float()),
              "embedding_positions": [int(v) // 1000 for v in embeddings[:, 0, 0].tolist()],
              "label_positions": labels[0].tolist()}
    if docs is not None:
        # Local real-token count of each document: kept positions before its padding.
        local_real, local_padded = [0], [0]
        for (doc_start, length), real_length in zip(docs, real):
            kept = expected_positions([(doc_start, length)], cp, cp_rank)
            local_real.append(local_real[-1] + sum(p < doc_start + real_length for p in kept))
            local_padded.append(local_padded[-1] + len(kept))
        result["params_ok"] = (local.cu_seqlens_q.tolist() == local_real
                               and local.cu_seqlens_kv.tolist() == local_real
                               and local.cu_seqlens_q_padded.tolist() == local_padded
                               and local.cu_seqlens_kv_padded.tolist() == local_padded
                               and local.cu_seqlens_q.dtype == torch.int32
                               and local.max_seqlen_q == local.max_seqlen_kv
                               == max(length for _, length in docs) // cp)
        result["cu_seqlens_q"] = local.cu_seqlens_q.tolist()
    return result


def dense_mask_case(mesh) -> str:
    adapter = PartitionAdapter(cp_group=mesh.get_group("cp"))
    embeddings, labels, loss_mask = coded(8, BATCH)
    try:
        adapter.shard(embeddings, labels, loss_mask,
                      attention_mask=torch.ones(BATCH, 1, 8, 8, dtype=torch.bool))
    except ValueError as error:
        return str(error)
    return "no error"


def main() -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    results = {}
    # THD documents: (start, padded length) with real lengths; padding at each one's end.
    docs = [(0, 4), (4, 12), (16, 8)]
    real = [3, 12, 5]
    if world == 2:
        cp_mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("cp", "tp"))
        tp_mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("cp", "tp"))
        results["cp2"] = run_case(cp_mesh, use_cp=True, use_tp=False, seq=12, batch=BATCH)
        results["sp2"] = run_case(tp_mesh, use_cp=False, use_tp=True, seq=6, batch=BATCH)
        results["thd_cp2"] = run_case(cp_mesh, use_cp=True, use_tp=False, seq=24, batch=1,
                                      docs=docs, real=real)
        results["dense_mask_cp2"] = dense_mask_case(cp_mesh)
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
        results["cp2_sp2"] = run_case(mesh, use_cp=True, use_tp=True, seq=16, batch=BATCH)
        results["thd_cp2_sp2"] = run_case(mesh, use_cp=True, use_tp=True, seq=24, batch=1,
                                          docs=docs, real=real)
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        merged = {case: [per_rank[case] for per_rank in gathered] for case in results}
        print("RESULT " + json.dumps(merged), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()

"""Multimodal (MIMO) language-input partitioning for context and sequence parallelism.

A multimodal model splices modality embeddings (image, audio) into the token embeddings, so the
language model's input arrives full length on every rank; `PartitionAdapter.shard` cuts it down
to what this rank's decoder layers hold. Embeddings are sequence-first ([S, B, H]; packed
sequences: [T, 1, H]), labels and loss_mask batch-first ([B, S]).

- CP: the load-balanced zigzag of `titan_hybrid.data.zigzag`, the index the CP model code
  uses, so the two agree by construction. Packed rows are zigzagged one sequence at a time.
- SP: after CP, tp rank t keeps the t-th contiguous slice of the embeddings. Labels and
  loss_mask are not SP-sliced: the loss runs after the logits are gathered over TP.

Gradients go back through plain indexing, so positions a rank dropped get zero gradient there:
modules before the split that are replicated over CP or TP must have their gradients summed over
those groups (CP: the data-parallel reduction over dp_shard x cp; TP: Partial gradients).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from titan_hybrid.data.zigzag import packed_zigzag_index, zigzag_index


@dataclass
class PackedSeqParams:
    """Sequences packed back to back in ONE row (Megatron's "thd"): int32 [n+1] boundaries
    starting at 0. `*_padded` boundaries include the padding at the end of each sequence; the
    plain ones count real tokens only. Queries and keys share boundaries in self-attention."""

    qkv_format: str = "thd"
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_kv: torch.Tensor | None = None
    cu_seqlens_q_padded: torch.Tensor | None = None
    cu_seqlens_kv_padded: torch.Tensor | None = None
    max_seqlen_q: int | None = None
    max_seqlen_kv: int | None = None

    def __post_init__(self) -> None:
        if self.qkv_format != "thd":
            raise ValueError(f"PackedSeqParams.qkv_format={self.qkv_format!r} is not supported: "
                             "only 'thd' (sequences packed back to back in one row)")


def _bounds(params: PackedSeqParams, total: int) -> tuple[list[int], list[int], torch.device]:
    """(padded, real) boundaries of a packed row of `total` positions, validated, and their
    device."""
    if params.cu_seqlens_q is None and params.cu_seqlens_q_padded is None:
        raise ValueError("packed_seq_params needs cu_seqlens_q (or cu_seqlens_q_padded)")
    for q_name, kv_name in (("cu_seqlens_q", "cu_seqlens_kv"),
                            ("cu_seqlens_q_padded", "cu_seqlens_kv_padded")):
        q, kv = getattr(params, q_name), getattr(params, kv_name)
        # One row of tokens attends to itself: a different key layout would be silently lost.
        if q is not None and kv is not None and q.tolist() != kv.tolist():
            raise ValueError(f"packed_seq_params.{kv_name} must equal {q_name} (self-attention "
                             f"over one packed row): {kv.tolist()} != {q.tolist()}")
    padded_name = ("cu_seqlens_q_padded" if params.cu_seqlens_q_padded is not None
                   else "cu_seqlens_q")
    padded_tensor = getattr(params, padded_name)
    padded = padded_tensor.tolist()
    real = params.cu_seqlens_q.tolist() if params.cu_seqlens_q is not None else padded
    for name, bounds in ((padded_name, padded), ("cu_seqlens_q", real)):
        if len(bounds) < 2 or bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"packed_seq_params.{name}={bounds} must be non-decreasing sequence "
                             "boundaries [n+1] starting at 0")
    if padded[-1] != total:
        raise ValueError(f"packed_seq_params.{padded_name} ends at {padded[-1]} but the packed row "
                         f"has T={total} positions (labels.shape[1]); they must be equal")
    if len(real) != len(padded) or any(r1 - r0 > p1 - p0 for r0, r1, p0, p1
                                       in zip(real, real[1:], padded, padded[1:])):
        raise ValueError(f"packed_seq_params.cu_seqlens_q={real} must describe the same sequences "
                         f"as cu_seqlens_q_padded={padded}, each no longer than its padded length")
    return padded, real, padded_tensor.device


def _check_divisible(field: str, value: int, rule: str, divisor: int, why: str) -> None:
    if value % divisor:
        raise ValueError(f"{field}={value} is not divisible by {rule} = {divisor}: {why}")


def _local_packed_params(padded: list[int], real: list[int], index: torch.Tensor, cp: int,
                         device: torch.device) -> PackedSeqParams:
    """Boundaries of the local row. Padding is a suffix of each sequence and the zigzag keeps
    positions in increasing order, so the local real tokens also lead each local sequence."""
    padded_t = torch.tensor(padded)
    lengths = padded_t.diff()
    seq_of = torch.repeat_interleave(torch.arange(len(lengths)), lengths)[index]
    is_real = index < padded_t[seq_of] + torch.tensor(real).diff()[seq_of]
    local_real = torch.zeros(len(lengths), dtype=torch.long).index_add_(0, seq_of, is_real.long())
    cu_real = torch.cat((torch.zeros(1, dtype=torch.long), local_real.cumsum(0)))
    cu_real = cu_real.to(device=device, dtype=torch.int32)
    cu_padded = (padded_t // cp).to(device=device, dtype=torch.int32)
    max_len = int((lengths // cp).max())
    return PackedSeqParams(cu_seqlens_q=cu_real, cu_seqlens_kv=cu_real.clone(),
                           cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded.clone(),
                           max_seqlen_q=max_len, max_seqlen_kv=max_len)


def shard_language_inputs(embeddings: torch.Tensor | None, labels: torch.Tensor,
                          loss_mask: torch.Tensor, packed_seq_params: PackedSeqParams | None = None,
                          attention_mask: torch.Tensor | None = None, *, cp_size: int, cp_rank: int,
                          tp_size: int = 1, tp_rank: int = 0, sequence_parallel: bool = False):
    """This rank's part of the language inputs; see the module docstring. Every check runs
    before any indexing. Returns (embeddings, labels, loss_mask, packed_seq_params)."""
    for name, size, rank in (("cp", cp_size, cp_rank), ("tp", tp_size, tp_rank)):
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"{name}_rank={rank} is not a rank of a {name} group of size {size}")
    sp = tp_size if sequence_parallel else 1
    if labels.dim() != 2 or labels.shape != loss_mask.shape:
        raise ValueError(f"labels {tuple(labels.shape)} and loss_mask {tuple(loss_mask.shape)} "
                         "must both be [B, S]")
    batch, seq = labels.shape
    if embeddings is not None and (embeddings.dim() != 3 or embeddings.shape[:2] != (seq, batch)):
        raise ValueError(f"embeddings {tuple(embeddings.shape)} must be sequence-first [S, B, H] "
                         f"with S={seq} and B={batch} from labels [B, S]")
    if attention_mask is not None and cp_size > 1:
        raise ValueError(f"a dense attention_mask is not supported with context parallelism "
                         f"(cp_size={cp_size}): use causal masking, or packed sequences (THD, "
                         "packed_seq_params) to keep documents apart")
    index, local_params = None, packed_seq_params
    if packed_seq_params is None:
        if cp_size > 1 and sp > 1:
            _check_divisible("sequence length S", seq, "2 * cp_size * tp_size", 2 * cp_size * sp,
                             "zigzag CP needs 2*cp equal chunks and SP splits them over tp ranks")
        elif cp_size > 1:
            _check_divisible("sequence length S", seq, "2 * cp_size", 2 * cp_size,
                             "zigzag CP needs 2*cp equal chunks")
        elif sp > 1:
            _check_divisible("sequence length S", seq, "tp_size", sp,
                             "sequence parallelism gives each tp rank an equal slice")
        if cp_size > 1:
            index = zigzag_index(seq, cp_size, cp_rank)
    else:
        if batch != 1:
            raise ValueError(f"packed sequences (THD) are one row: labels batch B={batch} "
                             "must be 1")
        padded, real, device = _bounds(packed_seq_params, seq)
        if cp_size > 1:
            for i, (start, end) in enumerate(zip(padded, padded[1:])):
                _check_divisible(f"padded length of packed sequence {i}", end - start,
                                 "2 * cp_size", 2 * cp_size,
                                 "zigzag CP splits every sequence into 2*cp equal chunks; pad "
                                 "each one (cu_seqlens_q_padded)")
        if sp > 1:
            _check_divisible("local packed length T / cp_size", seq // cp_size, "tp_size", sp,
                             "sequence parallelism gives each tp rank an equal slice")
        if cp_size > 1:
            index = packed_zigzag_index(torch.tensor(padded), cp_size, cp_rank)
            local_params = _local_packed_params(padded, real, index, cp_size, device)

    if index is not None:
        labels = labels.index_select(1, index.to(labels.device))
        loss_mask = loss_mask.index_select(1, index.to(loss_mask.device))
        if embeddings is not None:
            embeddings = embeddings.index_select(0, index.to(embeddings.device))
    if embeddings is not None and sp > 1:
        piece = embeddings.shape[0] // sp
        embeddings = embeddings.narrow(0, tp_rank * piece, piece)
    return embeddings, labels, loss_mask, local_params


def _size_and_rank(group: dist.ProcessGroup | None, name: str) -> tuple[int, int]:
    if group is None:  # a degree of 1; never the default (world) group
        return 1, 0
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"this process is not a member of {name}_group")
    return dist.get_world_size(group), rank


class PartitionAdapter:
    """Shards language-model inputs over EXPLICIT context- and tensor-parallel groups.
    `None` means a degree of 1."""

    def __init__(self, *, cp_group: dist.ProcessGroup | None = None,
                 tp_group: dist.ProcessGroup | None = None, sequence_parallel: bool = False):
        self.cp_group, self.tp_group = cp_group, tp_group
        self.sequence_parallel = sequence_parallel
        self.cp_size, self.cp_rank = _size_and_rank(cp_group, "cp")
        self.tp_size, self.tp_rank = _size_and_rank(tp_group, "tp")

    def shard(self, embeddings: torch.Tensor | None, labels: torch.Tensor,
              loss_mask: torch.Tensor, packed_seq_params: PackedSeqParams | None = None,
              attention_mask: torch.Tensor | None = None):
        """[S, B, H] -> [S / (cp * sp), B, H]; labels and loss_mask [B, S] -> [B, S / cp]."""
        return shard_language_inputs(embeddings, labels, loss_mask, packed_seq_params,
                                     attention_mask, cp_size=self.cp_size, cp_rank=self.cp_rank,
                                     tp_size=self.tp_size, tp_rank=self.tp_rank,
                                     sequence_parallel=self.sequence_parallel)

"""Parameter count and training FLOPs per token (Megatron's convention: count the cores).

6 FLOPs per token per matmul weight (forward 2, backward 4), excluding the embedding lookup but
including the LM head, plus the sequence-mixing cores that 6N misses: each layer kind states its
core's forward FLOPs per token (`LayerKind.core_flops`: self-attention over the full unmasked
sequence as torchtitan counts it; MLA and DSA causally, as Megatron's hybrid FLOPs code counts
them, MLA T * heads * (qk_head_dim + v_head_dim), DSA min(T, 2 * top-k) * heads *
(qk_head_dim + v_head_dim) + T * indexer heads * indexer head dim; the chunked SSD and
gated-delta scans).
With hyper-connections (`hc_mult`), each layer's stream mixing, collapse and write-back and
the hyper heads' collapses count as cores; their projections are matmul weights.
Backward is counted as twice the forward for the cores too. Parameters a token does not use
are left out (`LayerKind.inactive_params`: MoE layers count only the top_k routed experts a
token visits), and the LM head counts once more per MTP depth.
"""

from __future__ import annotations

from torch import nn

from titan_hybrid.model.hyper_connections import mixing_flops
from titan_hybrid.model.layer_kinds import kind_of
from titan_hybrid.model.pattern import members


def nparams_and_flops_per_token(args, model: nn.Module, seq_len: int) -> tuple[int, int]:
    """(parameters, training FLOPs per token) of a HybridModel built from `args`."""
    total_params = sum(p.numel() for p in model.parameters())
    embedding_params = sum(p.numel() for p in model.tok_embeddings.parameters())
    pattern = args.parsed_pattern
    # The LM head runs once more per MTP depth; a head tied to the embedding is counted in
    # neither total (model.parameters() names a shared weight once).
    head_runs = pattern.mtp_depths + (1 if args.enable_weight_tying else 0)
    active_matmul_params = (total_params - embedding_params
                            + head_runs * model.output.weight.numel())
    core = 0
    for symbol in pattern.physical_layer_symbols(include_mtp=True):
        for kind in (kind_of(member, args) for member in members(symbol)):
            active_matmul_params -= kind.inactive_params(args.section(kind), args.dim)
            core += kind.core_flops(args.section(kind), args.dim, seq_len)
        if args.hc_mult:
            core += mixing_flops(args.dim, args.hc_mult)
    if args.hc_mult:  # the hyper heads' collapses (main, and each MTP depth's)
        core += (1 + pattern.mtp_depths) * 2 * args.hc_mult * args.dim
    return total_params, 6 * active_matmul_params + 3 * core

"""Parameter count and training FLOPs per token (Megatron's convention: count the cores).

6 FLOPs per token per matmul weight (forward 2, backward 4), excluding the embedding lookup but
including the LM head, plus the sequence-mixing cores that 6N misses:
- attention: QK^T and PV over the full (unmasked) sequence, 2 * 2 * T * head_dim per head
  forward, as torchtitan and Megatron count it;
- SSD (chunked Mamba2 scan) per head per token, forward: intra-chunk C B^T and scores @ x
  (2 * Q * (N + P)), chunk-state contribution and state read-out (2 * 2 * N * P);
- gated delta rule (chunked) per value head per token, forward: intra-chunk q k^T, k k^T and
  their products with v (2 * Q * (2K + V)), state update and read-out (2 * 3 * K * V).
Backward is counted as twice the forward for the cores too. MoE layers count only the top_k
routed experts a token visits, and the LM head counts once more per MTP depth.
"""

from __future__ import annotations

from torch import nn

from titan_hybrid.model.moe import MoE
from titan_hybrid.ops.gated_delta import CHUNK_SIZE as GDN_CHUNK_SIZE
from titan_hybrid.pattern import parse_hybrid_pattern


def _core_forward_flops_per_token(symbol: str, args, seq_len: int) -> int:
    if symbol == "*":
        a = args.attention
        return 4 * seq_len * a.head_dim * a.n_heads
    if symbol == "M":
        m = args.mamba
        chunk = min(m.chunk_size, seq_len)
        n_heads = args.mamba_n_heads
        return n_heads * (2 * chunk * (m.d_state + m.head_dim) + 4 * m.d_state * m.head_dim)
    if symbol == "G":
        g = args.gdn
        chunk = min(GDN_CHUNK_SIZE, seq_len)
        k, v = g.key_head_dim, g.value_head_dim
        return g.n_value_heads * (2 * chunk * (2 * k + v) + 6 * k * v)
    return 0


def nparams_and_flops_per_token(args, model: nn.Module, seq_len: int) -> tuple[int, int]:
    total_params = sum(p.numel() for p in model.parameters())
    embedding_params = sum(p.numel() for p in model.tok_embeddings.parameters())
    # MoE layers run only top_k of their routed experts per token.
    inactive_expert_params = 0
    for module in model.modules():
        if isinstance(module, MoE):
            per_expert = (module.experts.fc1.numel() + module.experts.fc2.numel()) // args.moe.num_experts
            inactive_expert_params += per_expert * (args.moe.num_experts - args.moe.top_k)
    active_matmul_params = total_params - embedding_params - inactive_expert_params

    pattern = parse_hybrid_pattern(args.pattern)
    # The LM head runs once more per MTP depth.
    active_matmul_params += pattern.mtp_depths * model.output.weight.numel()
    core = sum(_core_forward_flops_per_token(symbol, args, seq_len)
               for symbol in pattern.physical_layer_symbols(include_mtp=True))
    return total_params, 6 * active_matmul_params + 3 * core

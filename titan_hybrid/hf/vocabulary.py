"""The tensor names that several transformers families share, declared once as key-map entries
(engine.py): the SwiGLU MLP, the llama-style attention, and the routed experts of a MoE layer.
Each takes the HF module prefix and ours."""

from __future__ import annotations

from titan_hybrid.hf.key_map_parts import ExpertSlice


def swiglu_mlp(hf: str, ours: str) -> dict[str, str]:
    """transformers' SwiGLU MLP at `hf` (gate_proj, up_proj, down_proj) as our SwiGLU at `ours`
    (an MLP's `mlp.` or a MoE layer's `moe.shared_expert.`): fc1's halves, then fc2."""
    return {f"{hf}gate_proj.weight": f"{ours}fc1.weight_w",
            f"{hf}up_proj.weight": f"{ours}fc1.weight_v",
            f"{hf}down_proj.weight": f"{ours}fc2.weight"}


def llama_attention(hf: str, ours: str, *, qk_norm: bool) -> dict[str, str]:
    """transformers' llama-style attention at `hf` (q_proj, k_proj, v_proj, o_proj, and with
    `qk_norm` q_norm and k_norm) as our attention at `ours`."""
    names = [("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv"), ("o_proj", "wo")]
    if qk_norm:
        names += [("q_norm", "q_norm"), ("k_norm", "k_norm")]
    return {f"{hf}{theirs}.weight": f"{ours}{name}.weight" for theirs, name in names}


def routed_experts(hf: str, ours: str, num_experts: int,
                   names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
                   ) -> dict[str, ExpertSlice]:
    """Expert e's SwiGLU at `hf{e}.` (its gate, up and down projections under `names`) as its
    slice of our experts at `ours` (`moe.experts.`: fc1's halves, then fc2)."""
    gate, up, down = names
    return {f"{hf}{expert}.{theirs}.weight": ExpertSlice(f"{ours}{name}", expert)
            for expert in range(num_experts)
            for theirs, name in ((gate, "fc1_w"), (up, "fc1_v"), (down, "fc2"))}

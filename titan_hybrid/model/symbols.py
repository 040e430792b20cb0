"""The pattern symbols: what the hybrid pattern grammar knows of each layer kind.

One `LayerSymbol` per kind, in the table `SYMBOLS`. The grammar (titan_hybrid.model.pattern) reads
only this module, so parsing a pattern imports no layer code; each kind's `LayerKind`
(layer_kind.py) names its symbol and reads the rest from here.
"""

from __future__ import annotations

from dataclasses import dataclass

# Megatron's checkpoint namespaces: the submodule a layer of a bracket group lives under
# (layers.i.mixer / .self_attention / .mlp), so a group holds at most one layer of each.
MIXER, SELF_ATTENTION, MLP = "mixer", "self_attention", "mlp"


@dataclass(frozen=True)
class LayerSymbol:
    symbol: str  # its character in the hybrid pattern
    name: str  # args section, submodule name and checkpoint-key word: layers.3.mamba.*
    title: str  # for messages: "Mamba2"
    namespace: str  # Megatron's checkpoint namespace (MIXER, SELF_ATTENTION or MLP)
    closes_group: bool = False  # may only be the last symbol of a bracket group (MoE)


SYMBOLS: dict[str, LayerSymbol] = {spec.symbol: spec for spec in (
    LayerSymbol(symbol="M", name="mamba", title="Mamba2", namespace=MIXER),
    LayerSymbol(symbol="G", name="gdn", title="gated DeltaNet", namespace=SELF_ATTENTION),
    # Megatron builds `K` like `G`, a TransformerLayer whose self_attention is the mixer
    # (hybrid_layer_allocation.py, hybrid_block.py of its dev branch), outside the MLA family.
    LayerSymbol(symbol="K", name="kda", title="Kimi delta attention", namespace=SELF_ATTENTION),
    # LFM2's gated short convolution (no Megatron symbol; `S` is free in its grammar).
    LayerSymbol(symbol="S", name="short_conv", title="short convolution", namespace=MIXER),
    LayerSymbol(symbol="*", name="attention", title="self-attention", namespace=SELF_ATTENTION),
    LayerSymbol(symbol="+", name="mla", title="multi-latent attention",
                namespace=SELF_ATTENTION),
    LayerSymbol(symbol="D", name="dsa", title="DeepSeek sparse attention",
                namespace=SELF_ATTENTION),
    LayerSymbol(symbol="W", name="window_attention",
                title="DeepSeek-V4 sliding-window attention", namespace=SELF_ATTENTION),
    LayerSymbol(symbol="C", name="compressed_sparse_attention",
                title="DeepSeek-V4 compressed sparse attention", namespace=SELF_ATTENTION),
    LayerSymbol(symbol="H", name="heavily_compressed_attention",
                title="DeepSeek-V4 heavily compressed attention", namespace=SELF_ATTENTION),
    LayerSymbol(symbol="-", name="mlp", title="MLP", namespace=MLP),
    LayerSymbol(symbol="E", name="moe", title="mixture of experts", namespace=MLP,
                closes_group=True),
)}

# Self-attention and the MLA family (Megatron's "MLA/DSA/CSA/HCA/Window") may not both appear
# in one model, main part and MTP depths together.
SELF_ATTENTION_SYMBOL = "*"
MLA_FAMILY = ("+", "D", "C", "H", "W")

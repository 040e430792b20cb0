"""The pattern symbols: what the hybrid pattern grammar knows of each layer kind.

One `LayerSymbol` per kind, in the table `SYMBOLS`. The grammar (titan_hybrid.pattern) reads
only this module, so parsing a pattern imports no layer code; each kind's `LayerKind`
(layer_kind.py) names its symbol and reads the rest from here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerSymbol:
    symbol: str  # its character in the hybrid pattern
    name: str  # args section, submodule name and checkpoint-key word: layers.3.mamba.*
    title: str  # for messages: "Mamba2"
    closes_group: bool = False  # may only be the last symbol of a bracket group (MoE)
    # Symbols that may not appear in the same part of a pattern (main part, MTP depth).
    excludes: tuple[str, ...] = ()


SYMBOLS: dict[str, LayerSymbol] = {spec.symbol: spec for spec in (
    LayerSymbol(symbol="M", name="mamba", title="Mamba2"),
    LayerSymbol(symbol="G", name="gdn", title="gated DeltaNet"),
    LayerSymbol(symbol="*", name="attention", title="self-attention"),
    LayerSymbol(symbol="+", name="mla", title="multi-latent attention", excludes=("*",)),
    LayerSymbol(symbol="D", name="dsa", title="DeepSeek sparse attention", excludes=("*",)),
    LayerSymbol(symbol="-", name="mlp", title="MLP"),
    LayerSymbol(symbol="E", name="moe", title="mixture of experts", closes_group=True),
)}

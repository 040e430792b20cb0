"""The table of layer kinds: the one place a new kind, or a variant of a symbol, is registered.

Adding a kind: give its symbol an entry in SYMBOLS (symbols.py: name, title, pattern rules),
write its module under model/ (the mixer, its args dataclass and a `KIND =
LayerKind(symbol=...)`, see layer_kind.py), add it to the tuple below, and give HybridModelArgs a
section of that name (model/args.py). A kind that mixes along the sequence states in its
ContextParallelRule how CP splits its core: the arguments CP all-gathers, or (a recurrent
kind) a core on model/recurrent.py's contract and its HeadChannels. A kind whose mixer counts
something for the training log names its counters, their reduction and its metrics in
`statistics` (KindStatistics); titan_hybrid.training.kind_statistics collects them for every
kind alike. Adding a variant of a symbol: its module (its KIND with `variant=LayerSymbol(...)`),
its args section in HybridModelArgs and one entry in VARIANTS below; the symbol's option
(`hybrid.m_layers`, ...) then takes its value. docs/architecture.md has the steps.
"""

from __future__ import annotations

from titan_hybrid.model import (
    attention,
    deepseek_v4,
    deepseek_v4_csa,
    deepseek_v4_hca,
    dsa,
    gdn,
    gdn2,
    gdp,
    kda,
    mamba,
    mamba1,
    mamba3,
    mla,
    mlp,
    moe,
    short_conv,
)
from titan_hybrid.model.layer_kind import LayerKind

LAYER_KINDS: dict[str, LayerKind] = {
    kind.symbol: kind for kind in (mamba.KIND, gdn.KIND, kda.KIND, short_conv.KIND, attention.KIND,
                                   mla.KIND, dsa.KIND,
                                   deepseek_v4.KIND, deepseek_v4_csa.KIND, deepseek_v4_hca.KIND, mlp.KIND,
                                   moe.KIND)
}

# What a symbol builds instead of its own kind when a model option says so, as Megatron selects
# such mixers (a stack spec, not a symbol): {symbol: (the HybridModelArgs field and job option
# `hybrid.<field>`, {value: kind})}; the first value is the symbol's own kind, the default.
# Megatron's names: gdp_stack_spec (GDP), experimental_attention_variant "gdn2".
VARIANTS: dict[str, tuple[str, dict[str, LayerKind]]] = {
    mamba.KIND.symbol: ("m_layers", {"mamba2": mamba.KIND, "gdp": gdp.KIND,
                                      "mamba1": mamba1.KIND, "mamba3": mamba3.KIND}),
    gdn.KIND.symbol: ("g_layers", {"gdn": gdn.KIND, "gdn2": gdn2.KIND}),
}


def default_variant(flag: str) -> str:
    """The value of the variant option `flag` (a HybridModelArgs field) that builds its
    symbol's own kind: the first of VARIANTS' values."""
    return next(next(iter(kinds)) for field, kinds in VARIANTS.values() if field == flag)


# Every kind a model may hold: the table's and the variants'.
ALL_KINDS: list[LayerKind] = [*LAYER_KINDS.values(), *(
    kind for _, kinds in VARIANTS.values() for kind in kinds.values()
    if kind not in LAYER_KINDS.values())]


def kind_of(symbol: str, args) -> LayerKind:
    """The kind a symbol builds in a model of these args (HybridModelArgs): its variant, where
    VARIANTS names one."""
    if symbol not in VARIANTS:
        return LAYER_KINDS[symbol]
    field, kinds = VARIANTS[symbol]
    return kinds[getattr(args, field)]

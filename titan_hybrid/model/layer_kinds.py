"""The table of layer kinds: the one place a new kind is registered.

Adding a kind: write its module under model/ (the mixer, its args dataclass and a `KIND =
LayerKind(...)`, see layer_kind.py), add it to the tuple below, and give HybridModelArgs a
section of that name (model/args.py); a kind that mixes along the sequence also needs a
context-parallel wrapper in parallel/context_parallel.py before CP accepts it.
"""

from __future__ import annotations

from titan_hybrid.model import attention, gdn, mamba, mlp, moe
from titan_hybrid.model.layer_kind import LayerKind

LAYER_KINDS: dict[str, LayerKind] = {
    kind.symbol: kind for kind in (mamba.KIND, gdn.KIND, attention.KIND, mlp.KIND, moe.KIND)
}

"""titan_hybrid's kernel custom ops, declared in one place.

`kernel_op(name)` is `torch.library.custom_op` in the `titan_hybrid` namespace. With
`saved_by_selective_ac=True` the op says, where it is defined, that per-op selective activation
checkpointing keeps its outputs instead of running it again in the backward
(parallel/activation_checkpoint.py): a sequence-mixing scan's forward is a whole kernel pass to
recompute, while its outputs are a small part of the layer's activations. A new kernel's forward
declares itself, so no list elsewhere can leave it out (KDA's once was).
"""

from __future__ import annotations

import torch

NAMESPACE = "titan_hybrid"
_SAVED_BY_SELECTIVE_AC: list[str] = []


def kernel_op(name: str, *, saved_by_selective_ac: bool = False):
    """Decorator: the function as the custom op `titan_hybrid::name` (no mutated inputs)."""
    if saved_by_selective_ac:
        _SAVED_BY_SELECTIVE_AC.append(name)
    return torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=())


def ops_saved_by_selective_ac() -> set:
    """The overloads (what a checkpoint policy is called with) of the ops declared
    `saved_by_selective_ac` by the op modules imported so far."""
    namespace = getattr(torch.ops, NAMESPACE)
    return {getattr(namespace, name).default for name in _SAVED_BY_SELECTIVE_AC}

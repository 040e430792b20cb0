"""Behaviour added to a module by extending its class, as FSDP2's `fully_shard` does.

Parallel code changes what some modules of the single-device model do (tensor parallelism: read
parameters as local views; context parallelism: a compressor that exchanges pieces; compile: a
compiled forward) without writing their parameter slots or assigning a `forward` to the
instance: the module becomes an instance of a subclass of (the mixin, its own class), made once
per pair. Names, parameters, buffers, hooks and state-dict keys stay what they were, the class
keeps its name and module (code that looks at `type(module).__module__` sees the model's), and
`isinstance` checks against the model's classes still hold.
"""

from __future__ import annotations

from torch import nn

_EXTENDED: dict[tuple[type, type], type] = {}


def extend_class(module: nn.Module, mixin: type) -> None:
    """Make `module` an instance of a subclass of (`mixin`, its class); nothing if it is one
    already. The mixin's methods come first and reach the module's own through super()."""
    cls = type(module)
    if isinstance(module, mixin):
        return
    if (mixin, cls) not in _EXTENDED:
        _EXTENDED[mixin, cls] = type(cls.__name__, (mixin, cls),
                                     {"__module__": cls.__module__,
                                      "__qualname__": cls.__qualname__})
    module.__class__ = _EXTENDED[mixin, cls]

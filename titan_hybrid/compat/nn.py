"""nn.Module internals. Checked on torch 2.11 and 2.13-2.15."""

from __future__ import annotations

from torch import nn

import titan_hybrid.compat  # noqa: F401  (the version check)


def parameter_slots(module: nn.Module) -> dict:
    """`module`'s own parameter registry (name -> Parameter or None), to write into directly.

    Private name: `nn.Module._parameters`. Tensor parallelism swaps each DTensor parameter for
    its local view (a plain tensor that carries the gradient back to the parameter) during
    the forward, and puts the parameter back after it. Assignment through setattr refuses a
    plain tensor under a parameter's name (TypeError), and deleting the parameter first would
    unregister it from FSDP, the optimizer and the state dict; writing the registry entry is
    the one way to swap the value while the parameter stays registered. Use the public
    `named_parameters(recurse=False)` / setattr wherever the value is a Parameter.
    """
    return module._parameters

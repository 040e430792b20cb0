"""torch's DeviceMesh internals: one dimension of a mesh split into several named ones.

Private name: `DeviceMesh._unflatten(dim, sizes, names, backend_override=)`, with which both
torchtitan generations build their own meshes from the world mesh. A mesh made this way shares
the world mesh's root, so FSDP2 can combine its dimensions with torchtitan's (a mesh from a
separate `init_device_mesh` cannot be combined). Checked on torch 2.14 and 2.15 (the torches
torchtitan 0.3 runs on, the only ones that call it).
"""

from __future__ import annotations

import torch.distributed.fsdp  # noqa: F401  (registers the "fake" process-group backend)

import titan_hybrid.compat  # noqa: F401  (the version check)


def split_dimensions(mesh, sizes: tuple[int, ...], names: tuple[str, ...],
                     without_groups: tuple[str, ...] = ()):
    """`mesh` (one dimension) as the dimensions `names` of `sizes`; the dimensions named in
    `without_groups` get no process group of their own (torchtitan's "fake" backend: for
    dimensions of size 1 that nothing communicates over)."""
    return mesh._unflatten(0, sizes, names,
                           backend_override={name: "fake" for name in without_groups})

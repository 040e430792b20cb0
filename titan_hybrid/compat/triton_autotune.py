"""mamba_ssm's autotuned SSD kernels, and the table in which each keeps its tuning choices.

`@triton.autotune` wraps a kernel in a `triton.runtime.autotuner.Autotuner`. Its tuning state
has no public API: `configs` (the candidate Configs, as declared), `keys` (the names of the
arguments its tuning key starts with) and `cache` (tuning key -> the Config chosen for it). On
a call, `Autotuner.run` builds the key (those arguments' values, then `str(dtype)` of every
argument that has a dtype, in the call's order) and benchmarks every config only when the key
is not in `cache`. Triton fills `cache` itself from its disk cache (`check_disk_cache`, with a
Config rebuilt from JSON); `prefill` does the same with the autotuner's own Config object, so
whatever Triton compares or calls on it (its pre_hook) is the declared one. Checked on triton
3.7.1 (the interpreter tests run it); on 3.6, the lent GPU host's, as far as the
`.autotune.json` files it wrote show (the same key and Config fields); main, read at commit
00940173, keeps these attributes (and `arg_names`, `base_fn`).

The kernels are module-level objects of mamba_ssm's SSD modules (SSD_MODULES), imported when
`ssd_autotuners` is called: only after the start-up probe found mamba_ssm usable
(titan_hybrid.ops.kernels), as for the launchers in kernel_packages.py.
"""

from __future__ import annotations

import importlib

import titan_hybrid.compat  # noqa: F401  (the torch / torchtitan version check)
from titan_hybrid.compat.kernel_packages import import_kernel_module

# mamba_ssm 2.3.2.post1: where its SSD scan's autotuned kernels are defined.
SSD_MODULES = tuple(f"mamba_ssm.ops.triton.ssd_{name}" for name in
                    ("bmm", "chunk_state", "chunk_scan", "state_passing", "combined"))
# What makes two Configs the same launch (Config.__eq__ compares these and the pre_hook).
CONFIG_FIELDS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def _autotuner_in(value, autotuner_type):
    for _ in range(3):  # through @triton.heuristics wrappers
        if isinstance(value, autotuner_type) or not hasattr(value, "fn"):
            break
        value = value.fn
    return value if isinstance(value, autotuner_type) else None


def ssd_autotuners() -> dict:
    """mamba_ssm's SSD kernels that autotune, by kernel name (the name Triton gives their
    `.autotune.json` files): {name: Autotuner}."""
    autotuner_type = importlib.import_module("triton.runtime.autotuner").Autotuner
    found = {}
    for module in SSD_MODULES:
        for value in vars(import_kernel_module(module)).values():
            if (autotuner := _autotuner_in(value, autotuner_type)) is not None:
                found[autotuner.base_fn.__name__] = autotuner
    return found


def describe(config) -> dict:
    """A Config as the picks table records it (JSON: no pre_hook)."""
    return {"kwargs": dict(config.kwargs),
            **{field: getattr(config, field, None) for field in CONFIG_FIELDS}}


def configs(autotuner) -> list:
    """The autotuner's candidate Configs, in declaration order."""
    return list(autotuner.configs)


def own_config(autotuner, described: dict):
    """The autotuner's own Config that `described` (as `describe` writes it) records; None when
    it has none such (another mamba_ssm version's configs)."""
    for config in autotuner.configs:
        if describe(config) == {"kwargs": described["kwargs"],
                                **{field: described.get(field) for field in CONFIG_FIELDS}}:
            return config
    return None


def key_names(autotuner) -> list[str]:
    """The arguments whose values start the tuning key (dtypes of the tensor arguments follow)."""
    return list(autotuner.keys)


def argument_names(autotuner) -> list[str]:
    return list(autotuner.arg_names)


def tuning_table(autotuner) -> dict:
    """The autotuner's table of choices, tuning key -> Config: the live object, so a caller can
    save and restore it."""
    return autotuner.cache


def prefill(autotuner, key: tuple, config) -> None:
    """Make `config` the autotuner's choice for `key`, as if it had tuned for it."""
    autotuner.cache[tuple(key)] = config

"""The GPU kernel packages' launchers that titan_hybrid's custom ops call, under public names.

The custom ops (titan_hybrid/ops) call each kernel's forward and backward launcher, not the
package's autograd Function: the backward then gets exactly the residuals it needs, and
torch.compile sees one opaque node per direction. Those launchers sit below the packages'
public APIs: mamba_ssm's are private (`_mamba_chunk_scan_combined_fwd`, `_layer_norm_fwd`,
...), and fla's and causal-conv1d's, though public-named, are internals whose arguments and
results carry no promise between releases. So they are used only on the versions they were
checked on, the pins of pyproject.toml's gpu extra:

    mamba-ssm 2.3.2.post1, fla-core 0.6.0, causal-conv1d 1.7.0

A kernel package is optional: on another version it is not an import error but a package the
ops cannot use. `version_refusal` says why; the start-up probe (titan_hybrid.ops.kernels) asks
it before the ops may call a launcher, so such a run takes the torch paths with one warning
line. The launchers below assume the probe has passed: they do not check again per call.

Importing this module imports no kernel package (they are optional, slow to import, and the
tests make them importable only inside `tests.triton_kernels.kernels_on()`): each launcher
imports its module when called, which is a dictionary lookup once the probe has imported it.
Nothing is cached here, so a test that swaps a package (a stand-in, a broken one) is seen at
once.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from dataclasses import dataclass

import titan_hybrid.compat  # noqa: F401  (the torch / torchtitan version check)


@dataclass(frozen=True)
class CheckedPackage:
    distribution: str  # the name pip installs it under (importlib.metadata's key)
    version: str  # the one version the launchers were checked on


CHECKED_PACKAGES = {
    "mamba_ssm": CheckedPackage("mamba-ssm", "2.3.2.post1"),
    "fla": CheckedPackage("fla-core", "0.6.0"),
    "causal_conv1d": CheckedPackage("causal-conv1d", "1.7.0"),
}


def installed_version(package: str) -> str | None:
    """The installed version of a kernel package (an import name of CHECKED_PACKAGES): its
    distribution's metadata, which needs no import; failing that (a source tree on sys.path,
    the CPU stand-in of tests/stand_ins) the `__version__` of the package if it is already
    imported. None when neither says."""
    try:
        return importlib.metadata.version(CHECKED_PACKAGES[package].distribution)
    except importlib.metadata.PackageNotFoundError:
        return getattr(sys.modules.get(package), "__version__", None)


def version_refusal(package: str) -> str | None:
    """Why titan_hybrid's custom ops may not call `package`'s launchers: its installed version
    is not the checked one (a local build tag, `+cu12torch2.6`, is ignored) or is unknown. None
    when they may."""
    checked = CHECKED_PACKAGES[package].version
    version = installed_version(package)
    if version is None:
        return (f"{package}'s version is unknown (no {CHECKED_PACKAGES[package].distribution} "
                f"distribution metadata, no {package}.__version__), titan_hybrid's custom ops "
                f"were checked on {checked}")
    if version.split("+")[0] != checked:
        return f"{package} {version} installed, titan_hybrid's custom ops were checked on {checked}"
    return None


@dataclass(frozen=True)
class Launcher:
    """A kernel package's function, imported when called: `package` is its import name."""

    package: str
    module: str
    name: str

    def __call__(self, *args, **kwargs):
        return getattr(importlib.import_module(self.module), self.name)(*args, **kwargs)


_SSD = "mamba_ssm.ops.triton.ssd_combined"
_GATED_NORM = "mamba_ssm.ops.triton.layernorm_gated"
_GATED_DELTA = "fla.ops.gated_delta_rule.chunk"
_L2NORM = "fla.modules.norm.l2norm"

# mamba_ssm 2.3.2.post1: what its MambaChunkScanCombinedFn and LayerNormFn (the gated RMS norm)
# call. Forward -> (out, out before the z gate, dt, dA_cumsum, states, final_states); backward
# -> (dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinitial_states).
ssd_scan_fwd = Launcher("mamba_ssm", _SSD, "_mamba_chunk_scan_combined_fwd")
ssd_scan_bwd = Launcher("mamba_ssm", _SSD, "_mamba_chunk_scan_combined_bwd")
# Forward -> (out, mean, rstd); backward -> (dx, dweight, dbias, dz).
gated_rms_norm_fwd = Launcher("mamba_ssm", _GATED_NORM, "_layer_norm_fwd")
gated_rms_norm_bwd = Launcher("mamba_ssm", _GATED_NORM, "_layer_norm_bwd")

# fla-core 0.6.0: what its ChunkGatedDeltaRuleFunction calls.
gated_delta_rule_fwd = Launcher("fla", _GATED_DELTA, "chunk_gated_delta_rule_fwd")
gated_delta_rule_bwd = Launcher("fla", _GATED_DELTA, "chunk_gated_delta_rule_bwd")
l2norm_fwd = Launcher("fla", _L2NORM, "l2norm_fwd")
l2norm_bwd = Launcher("fla", _L2NORM, "l2norm_bwd")
prepare_chunk_indices = Launcher("fla", "fla.ops.utils.index", "prepare_chunk_indices")

# causal-conv1d 1.7.0: what its CausalConv1dFn calls (causal_conv1d.cpp_functions).
causal_conv1d_fwd = Launcher("causal_conv1d", "causal_conv1d.cpp_functions",
                             "causal_conv1d_fwd_function")
causal_conv1d_bwd = Launcher("causal_conv1d", "causal_conv1d.cpp_functions",
                             "causal_conv1d_bwd_function")

LAUNCHERS = (ssd_scan_fwd, ssd_scan_bwd, gated_rms_norm_fwd, gated_rms_norm_bwd,
             gated_delta_rule_fwd, gated_delta_rule_bwd, l2norm_fwd, l2norm_bwd,
             prepare_chunk_indices, causal_conv1d_fwd, causal_conv1d_bwd)


def launcher_modules(package: str) -> tuple[str, ...]:
    """The modules `package`'s launchers come from, in order: what the probe imports."""
    return tuple(dict.fromkeys(launcher.module for launcher in LAUNCHERS
                               if launcher.package == package))

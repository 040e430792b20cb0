"""The GPU kernel packages' launchers that titan_hybrid's custom ops call, under public names,
and the check that an installed package still has them as the ops call them.

The custom ops (titan_hybrid/ops) call each kernel's forward and backward launcher, not the
package's autograd Function: the backward then gets exactly the residuals it needs, and
torch.compile sees one opaque node per direction. Those launchers sit below the packages'
public APIs: mamba_ssm's are private (`_mamba_chunk_scan_combined_fwd`, `_layer_norm_fwd`,
...), and fla's and causal-conv1d's, though public-named, are internals whose arguments and
results carry no promise between releases. So a package is used only when both hold:

- Its version is in the accepted range, the same as pyproject.toml's gpu extra:

      mamba-ssm >=2.3.2.post1,<2.4   fla-core >=0.6.0,<0.7   causal-conv1d >=1.7.0,<1.8
      tilelang ==0.1.8 (what mamba-ssm 2.3.2.post1 pins: its Mamba-3 MIMO kernels)

  The floor is the version the triton_interpreter tests run (scripts/bootstrap.sh; causal-
  conv1d's stand-in has its signatures): nothing older was checked, and an older one may lack
  a kernel fix. The ceiling is the next minor release, because a signature cannot show what
  a launcher returns (the ops unpack six results of the gated-delta forward and nine
  gradients of the SSD backward) or what its values mean (fla has shipped a variant of the
  gated-delta forward whose cumulative gate is in base 2); these packages rework their
  launchers in minor releases and fix kernels in place in patch releases. A patch release
  outside the tested one is accepted rather than sent to the torch path, which is ~3x slower
  on a GPU.
- Every launcher the ops call exists, with the parameters they pass: those passed by position
  first and in that order, those passed by keyword present, and every other one optional
  (`Launcher.mismatch`, read with `inspect.signature` once the probe has imported the
  package). This is what catches a patch release that renames or inserts a parameter.

A kernel package is optional: an unusable one is not an import error but a package the ops
cannot use. `version_refusal` and `launcher_refusal` say why, naming the package, its version
and the launcher or parameter; the start-up probe (titan_hybrid.ops.kernels) asks them before
the ops may call a launcher, so such a run takes the torch paths and says so. The launchers
below assume the probe has passed: they do not check again per call.

Importing this module imports no kernel package (they are optional, slow to import, and the
tests make them importable only inside `tests.triton_kernels.kernels_on()`): each launcher
imports its module when called, which is a dictionary lookup once the probe has imported it.
Nothing is cached here, so a test that swaps a package (a stand-in, a broken one) is seen at
once.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
import types
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

import titan_hybrid.compat  # noqa: F401  (the torch / torchtitan version check)


@dataclass(frozen=True)
class AcceptedVersions:
    distribution: str  # the name pip installs it under (importlib.metadata's key)
    specifiers: str  # PEP 440, as in pyproject.toml's gpu extra (see the module docstring)


ACCEPTED_VERSIONS = {
    "mamba_ssm": AcceptedVersions("mamba-ssm", ">=2.3.2.post1,<2.4"),
    "fla": AcceptedVersions("fla-core", ">=0.6.0,<0.7"),
    "causal_conv1d": AcceptedVersions("causal-conv1d", ">=1.7.0,<1.8"),
    "tilelang": AcceptedVersions("tilelang", "==0.1.8"),
}


def installed_version(package: str) -> str | None:
    """The installed version of a kernel package (an import name of ACCEPTED_VERSIONS): its
    distribution's metadata, which needs no import; failing that (a source tree on sys.path,
    the CPU stand-in of tests/stand_ins) the `__version__` of the package if it is already
    imported. None when neither says."""
    try:
        return importlib.metadata.version(ACCEPTED_VERSIONS[package].distribution)
    except importlib.metadata.PackageNotFoundError:
        return getattr(sys.modules.get(package), "__version__", None)


def version_refusal(package: str) -> str | None:
    """Why titan_hybrid's custom ops may not call `package`'s launchers: its installed version
    is outside the accepted range (a local build tag, `+cu12torch2.6`, is ignored; a pre-release
    inside the range is accepted, the launcher check still applies) or is unknown. None when
    the version is no obstacle."""
    accepted = ACCEPTED_VERSIONS[package]
    version = installed_version(package)
    if version is None:
        return (f"{package}'s version is unknown (no {accepted.distribution} distribution "
                f"metadata, no {package}.__version__), titan_hybrid's custom ops accept "
                f"{accepted.distribution}{accepted.specifiers}")
    try:
        inside = SpecifierSet(accepted.specifiers).contains(Version(version), prereleases=True)
    except InvalidVersion:
        inside = False
    if not inside:
        return (f"{accepted.distribution} {version} is installed, titan_hybrid's custom ops "
                f"accept {accepted.distribution}{accepted.specifiers}")
    return None


def launcher_refusal(package: str, launchers: tuple[Launcher, ...]) -> str | None:
    """Why titan_hybrid's custom ops may not call `launchers` (of `package`, whose modules
    import): the first one missing or whose parameters no longer take the ops' call. None
    when all of them do."""
    for launcher in launchers:
        if mismatch := launcher.mismatch():
            return (f"{ACCEPTED_VERSIONS[package].distribution} {installed_version(package)}: "
                    f"{mismatch}")
    return None


# mamba-ssm's package __init__ first imports its compiled Mamba1 scan (selective_scan_cuda), which
# does not build against torch >= 2.14: its build compiles it as C++17, and torch 2.14's
# headers require C++20 (docs/gpu_and_performance.md has the recorded builds). titan_hybrid calls
# none of it, only the Triton and TileLang kernels, which install without it
# (MAMBA_SKIP_CUDA_BUILD=TRUE). Where that extension is not installed, the package is entered
# bare (its module, with its __path__, without running its __init__), so its kernel modules
# import; where it is installed, the package imports as usual.
_EXTENSION_THE_INIT_IMPORTS = {"mamba_ssm": "selective_scan_cuda"}


def import_kernel_module(name: str) -> types.ModuleType:
    """`importlib.import_module(name)` for a module of a kernel package, entering mamba_ssm bare
    where its package __init__ could not import (above)."""
    if (module := sys.modules.get(name)) is not None:
        return module
    package = name.partition(".")[0]
    extension = _EXTENSION_THE_INIT_IMPORTS.get(package)
    if extension and package not in sys.modules and importlib.util.find_spec(extension) is None:
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.submodule_search_locations is not None:
            sys.modules[package] = importlib.util.module_from_spec(spec)
    return importlib.import_module(name)


_BY_POSITION = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_BY_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


@dataclass(frozen=True)
class Launcher:
    """A kernel package's function, imported when called: `package` is its import name.
    `positional` and `keywords` are the parameters titan_hybrid's ops pass it, by position (in
    this order) and by keyword: every call passes exactly these, which `mismatch` checks the
    installed function still takes."""

    package: str
    module: str
    name: str
    positional: tuple[str, ...] = ()
    keywords: tuple[str, ...] = ()

    def __call__(self, *args, **kwargs):
        assert len(args) == len(self.positional) and kwargs.keys() == set(self.keywords), (
            f"{self.name}: the call differs from the parameters declared for the launcher check")
        return getattr(import_kernel_module(self.module), self.name)(*args, **kwargs)

    def mismatch(self) -> str | None:
        """Why the installed function would not take the ops' call (its module must import):
        it is missing, a parameter passed by position has another name or place, one passed by
        keyword is gone, or one the ops do not pass has no default. None when it takes it."""
        function = getattr(import_kernel_module(self.module), self.name, None)
        if function is None:
            return f"{self.module} has no {self.name}, which titan_hybrid's custom ops call"
        where = f"{self.module}.{self.name}"
        try:
            parameters = list(inspect.signature(function).parameters.values())
        except (TypeError, ValueError):  # a builtin without a text signature
            return f"{where} has no signature to check the custom ops' call against"
        by_position = [p.name for p in parameters if p.kind in _BY_POSITION]
        for index, name in enumerate(self.positional):
            found = by_position[index] if index < len(by_position) else None
            if found != name:
                now = f"`{found}`" if found else "nothing"
                return (f"{where} takes {now} as parameter {index + 1}, where titan_hybrid's "
                        f"custom ops pass `{name}`")
        by_keyword = {p.name for p in parameters if p.kind in _BY_KEYWORD}
        for name in self.keywords:
            if name not in by_keyword:
                return (f"{where} has no parameter `{name}`, which titan_hybrid's custom ops "
                        "pass")
        passed = {*self.positional, *self.keywords}
        for p in parameters:
            if p.name not in passed and p.default is p.empty and p.kind not in _VARIADIC:
                return (f"{where} requires `{p.name}`, which titan_hybrid's custom ops do not "
                        "pass")
        return None


_SSD = "mamba_ssm.ops.triton.ssd_combined"
_SSD_BMM = "mamba_ssm.ops.triton.ssd_bmm"
_SSD_SCAN = "mamba_ssm.ops.triton.ssd_chunk_scan"
_SSD_STATE = "mamba_ssm.ops.triton.ssd_chunk_state"
_SSD_PASSING = "mamba_ssm.ops.triton.ssd_state_passing"
_GATED_NORM = "mamba_ssm.ops.triton.layernorm_gated"
_GATED_DELTA = "fla.ops.gated_delta_rule.chunk"
_L2NORM = "fla.modules.norm.l2norm"
_CONV = "causal_conv1d.cpp_functions"

# mamba_ssm 2.3.2.post1: what its MambaChunkScanCombinedFn and LayerNormFn (the gated RMS norm)
# call. Forward -> (out, out before the z gate, dt after softplus [b, h, chunks, chunk],
# dA_cumsum [b, h, chunks, chunk], the states entering each chunk [b, chunks, h, p, n] in C's
# dtype, final_states).
_SSD_OPTIONS = ("D", "z", "dt_bias", "initial_states", "seq_idx", "dt_softplus", "dt_limit")
ssd_scan_fwd = Launcher("mamba_ssm", _SSD, "_mamba_chunk_scan_combined_fwd",
                        ("x", "dt", "A", "B", "C", "chunk_size"), _SSD_OPTIONS)
# The steps of its backward (_mamba_chunk_scan_combined_bwd), which titan_hybrid.ops.ssd_backward
# calls itself so that what the forward computed (dt after softplus, its chunked cumulative
# decay, the chunk states) is reused instead of recomputed.
bmm_chunk_fwd = Launcher("mamba_ssm", _SSD_BMM, "_bmm_chunk_fwd", ("a", "b", "chunk_size"),
                         ("seq_idx", "output_dtype"))
bmm_chunk_bwd = Launcher("mamba_ssm", _SSD_BMM, "_bmm_chunk_bwd", ("a", "dout"),
                         ("residual", "out"))
chunk_scan_bwd_dz = Launcher("mamba_ssm", _SSD_SCAN, "_chunk_scan_bwd_dz",
                             ("x", "z", "out", "dout"), ("chunk_size", "has_ddAcs", "D"))
chunk_scan_bwd_dstates = Launcher("mamba_ssm", _SSD_SCAN, "_chunk_scan_bwd_dstates",
                                  ("C", "dA_cumsum", "dout"), ("seq_idx", "dtype"))
state_passing_bwd = Launcher("mamba_ssm", _SSD_PASSING, "_state_passing_bwd",
                             ("states", "dA_chunk_cumsum", "dout"),
                             ("dfinal_states", "seq_idx", "has_initial_states", "dstates_dtype",
                              "states_dtype", "chunk_size"))
chunk_scan_chunk_state_bwd_dx = Launcher(
    "mamba_ssm", _SSD, "_chunk_scan_chunk_state_bwd_dx",
    ("x", "dt", "dA_cumsum", "B", "CB", "dout", "dstates"), ("D", "seq_idx", "dx"))
chunk_state_bwd_db = Launcher("mamba_ssm", _SSD_STATE, "_chunk_state_bwd_db",
                              ("x", "dt", "dA_cumsum", "dstates"), ("seq_idx", "B", "ngroups"))
chunk_scan_bwd_dC = Launcher("mamba_ssm", _SSD_SCAN, "_chunk_scan_bwd_dC",
                             ("prev_states", "dA_cumsum", "dout"), ("seq_idx", "C", "ngroups"))
chunk_scan_bwd_dcb = Launcher("mamba_ssm", _SSD_SCAN, "_chunk_scan_bwd_dcb",
                              ("x", "dt", "dA_cumsum", "dout"), ("seq_idx", "ngroups"))
chunk_scan_bwd_ddAcs_stable = Launcher("mamba_ssm", _SSD_SCAN, "_chunk_scan_bwd_ddAcs_stable",
                                       ("x", "dt", "dA_cumsum", "dout", "cb"))
chunk_cumsum_bwd = Launcher("mamba_ssm", _SSD_STATE, "_chunk_cumsum_bwd",
                            ("ddA", "ddt_out", "dt", "A"),
                            ("dt_bias", "dt_softplus", "dt_limit", "ddt"))
SSD_BACKWARD_STEPS = (bmm_chunk_fwd, bmm_chunk_bwd, chunk_scan_bwd_dz, chunk_scan_bwd_dstates,
                      state_passing_bwd, chunk_scan_chunk_state_bwd_dx, chunk_state_bwd_db,
                      chunk_scan_bwd_dC, chunk_scan_bwd_dcb, chunk_scan_bwd_ddAcs_stable,
                      chunk_cumsum_bwd)
# Forward -> (out, mean, rstd); backward -> (dx, dweight, dbias, dz), dz written into `dz` when
# given.
_NORM_OPTIONS = ("z", "group_size", "norm_before_gate", "is_rms_norm")
gated_rms_norm_fwd = Launcher("mamba_ssm", _GATED_NORM, "_layer_norm_fwd",
                              ("x", "weight", "bias", "eps"), _NORM_OPTIONS)
gated_rms_norm_bwd = Launcher("mamba_ssm", _GATED_NORM, "_layer_norm_bwd",
                              ("dy", "x", "weight", "bias", "eps", "mean", "rstd"),
                              _NORM_OPTIONS + ("dz",))

# ... and what its Mamba-3 SISO function (_Mamba3Function, in its module
# mamba_ssm.ops.triton.mamba3.mamba3_siso_combined) calls, without entering or final states. The angles' running sum
# -> (its values, the final one); the scan -> (out, out before the z gate, the chunks' states,
# the cumulative log decays and their sums, q rotated, k rotated and scaled, q . k, the
# trapezoid's scale and gamma, None); its backward in four steps, then the angles' sum's.
# Importing the scan's modules sets Triton's allocator for the whole process (their kernels
# build TMA descriptors): the start-up probe does it once it imports them.
_MAMBA3 = "mamba_ssm.ops.triton.mamba3"
mamba3_angles_fwd = Launcher("mamba_ssm", f"{_MAMBA3}.angle_dt", "angle_dt_fwd",
                             ("angle", "dt"), ("chunk_size", "cu_seqlens"))
mamba3_siso_fwd = Launcher(
    "mamba_ssm", f"{_MAMBA3}.mamba3_siso_fwd", "mamba3_siso_fwd",
    ("Q", "K", "V", "ADT", "DT", "Trap", "Q_bias", "K_bias", "Angles", "D", "Z"),
    ("chunk_size", "store_states_adt_outv", "cu_seqlens"))
mamba3_siso_bwd_dz = Launcher("mamba_ssm", f"{_MAMBA3}.mamba3_siso_bwd", "compute_dzdo",
                              ("do", "z", "o"), ("chunk_size",))
mamba3_siso_bwd_dqkv = Launcher(
    "mamba_ssm", f"{_MAMBA3}.mamba3_siso_bwd", "compute_dqkv",
    keywords=("q", "k", "v", "da_cs", "da_cs_sum", "qk_dot", "SSM_States", "do", "D",
              "chunk_size", "Cu_Seqlens"))
mamba3_siso_bwd_rotation = Launcher(
    "mamba_ssm", f"{_MAMBA3}.mamba3_siso_bwd", "compute_dqktheta",
    keywords=("q", "k", "scale", "gamma", "q_bias", "k_bias", "angles", "dq_in", "dk_in",
              "dqk", "chunk_size", "Cu_Seqlens"))
mamba3_siso_bwd_steps = Launcher(
    "mamba_ssm", f"{_MAMBA3}.mamba3_siso_bwd", "compute_ddt_dtrap_dinput_states",
    keywords=("dscale", "dgamma", "dt", "trap", "Cu_Seqlens"))
mamba3_angles_bwd = Launcher("mamba_ssm", f"{_MAMBA3}.angle_dt", "angle_dt_bwd",
                             keywords=("grad_out", "angle", "dt", "chunk_size", "cu_seqlens"))
MAMBA3_SISO_STEPS = (mamba3_angles_fwd, mamba3_siso_fwd, mamba3_siso_bwd_dz,
                     mamba3_siso_bwd_dqkv, mamba3_siso_bwd_rotation, mamba3_siso_bwd_steps,
                     mamba3_angles_bwd)

# ... and what its Mamba-3 MIMO function (_Mamba3Function in mamba_ssm.ops.tilelang.mamba3.
# mamba3_mimo) calls: TileLang kernels, so they are grouped under the import name "tilelang",
# probed apart from mamba_ssm's Triton kernels (tilelang is an optional install, and its
# kernels compile on first use, on CUDA only). The chunks' decay sums (Triton) -> (within-chunk
# cumulative sums, the reverse sums, the segment sums); the scan -> (out, final state, final k:
# None unless asked); the backward -> (dq, dk, dv, dADT, ddt, dtrap, dq_bias, dk_bias, dmimo_v,
# dmimo_z, dmimo_o, dangles, dD, dz), with dq / dk summed over the heads of one group. Packed
# documents take the _varlen twins, with cu_seqlens.
_MIMO = "mamba_ssm.ops.tilelang.mamba3"
_MIMO_DECAYS = "mamba_ssm.ops.triton.mamba3.mamba3_mimo_utils"
_MIMO_FWD_ARGS = ("q", "k", "v", "q_bias", "k_bias", "mimo_v", "mimo_o", "z", "D", "mimo_z",
                  "angles", "dA_cs", "dA_cs_rev", "dt", "trap", "segsum", "chunk_size",
                  "rotary_dim_divisor", "dtype")
_MIMO_BWD_ARGS = ("dout", "q", "k", "v", "q_bias", "k_bias", "mimo_v", "mimo_o", "z", "mimo_z",
                  "angles", "dA_cs", "dA_cs_rev", "dt", "trap", "D", "segsum", "chunk_size",
                  "rotary_dim_divisor", "dtype")
mamba3_mimo_decays = Launcher("tilelang", _MIMO_DECAYS, "compute_dacs_segsum_triton",
                              ("da", "chunk_size"))
mamba3_mimo_decays_varlen = Launcher("tilelang", _MIMO_DECAYS,
                                     "compute_dacs_segsum_triton_varlen", ("da", "chunk_size"),
                                     ("cu_seqlens",))
mamba3_mimo_fwd = Launcher("tilelang", f"{_MIMO}.mamba3_mimo_fwd", "mamba_mimo_forward",
                           _MIMO_FWD_ARGS)
mamba3_mimo_fwd_varlen = Launcher("tilelang", f"{_MIMO}.mamba3_mimo_fwd_varlen",
                                  "mamba_mimo_forward_varlen", _MIMO_FWD_ARGS, ("cu_seqlens",))
mamba3_mimo_bwd = Launcher("tilelang", f"{_MIMO}.mamba3_mimo_bwd", "mamba_mimo_bwd_combined",
                           _MIMO_BWD_ARGS)
mamba3_mimo_bwd_varlen = Launcher("tilelang", f"{_MIMO}.mamba3_mimo_bwd_varlen",
                                  "mamba_mimo_bwd_combined_varlen", _MIMO_BWD_ARGS,
                                  ("cu_seqlens",))
MAMBA3_MIMO_STEPS = (mamba3_mimo_decays, mamba3_mimo_decays_varlen, mamba3_mimo_fwd,
                     mamba3_mimo_fwd_varlen, mamba3_mimo_bwd, mamba3_mimo_bwd_varlen)

# fla-core 0.6.0: what its ChunkGatedDeltaRuleFunction calls. Forward -> (g cumulative, o, A,
# final_state, initial_state, g_input); backward -> (dq, dk, dv, dbeta, dg, dh0, dA_log,
# ddt_bias). The backward raises on Hopper with triton >= 3.4.0, < 3.7.1, where the runtime
# refuses it alone (titan_hybrid.ops.kernels.fla_gated_delta_bwd_refusal).
_DELTA_OPTIONS = ("scale", "initial_state", "cu_seqlens", "chunk_indices", "chunk_size")
gated_delta_rule_fwd = Launcher(
    "fla", _GATED_DELTA, "chunk_gated_delta_rule_fwd",
    keywords=("q", "k", "v", "g", "beta", "output_final_state") + _DELTA_OPTIONS)
gated_delta_rule_bwd = Launcher(
    "fla", _GATED_DELTA, "chunk_gated_delta_rule_bwd",
    keywords=("q", "k", "v", "g", "beta", "A", "do", "dht") + _DELTA_OPTIONS)
# ... and what its ChunkKDAFunction calls (the gate and beta computed outside, l2norm apart).
# Forward -> (o, final_state, g cumulative (base 2), Aqk, Akk, then the residuals it recomputes
# in backward: None); backward -> (dq, dk, dv, dbeta, dg, dh0, dA_log, ddt_bias).
_KDA_OPTIONS = ("scale", "initial_state", "cu_seqlens", "chunk_indices", "chunk_size")
kda_fwd = Launcher("fla", "fla.ops.kda.chunk_fwd", "chunk_kda_fwd",
                   keywords=("q", "k", "v", "g", "beta", "output_final_state") + _KDA_OPTIONS)
kda_bwd = Launcher("fla", "fla.ops.kda.chunk_bwd", "chunk_kda_bwd",
                   keywords=("q", "k", "v", "beta", "Aqk", "Akk", "do", "dht", "g")
                   + _KDA_OPTIONS)
# ... and what its ChunkGDN2Function calls, with the same outputs but the erase and write gates
# gradients (db, dw) in place of dbeta.
gdn2_fwd = Launcher("fla", "fla.ops.gdn2.chunk_fwd", "chunk_gdn2_fwd",
                    keywords=("q", "k", "v", "g", "b", "w_gate", "output_final_state")
                    + _KDA_OPTIONS)
gdn2_bwd = Launcher("fla", "fla.ops.gdn2.chunk_bwd", "chunk_gdn2_bwd",
                    keywords=("q", "k", "v", "b", "w_gate", "Aqk", "Akk", "do", "dht", "g")
                    + _KDA_OPTIONS)
l2norm_fwd = Launcher("fla", _L2NORM, "l2norm_fwd", ("x",))
l2norm_bwd = Launcher("fla", _L2NORM, "l2norm_bwd", ("y", "rstd", "dy"))
prepare_chunk_indices = Launcher("fla", "fla.ops.utils.index", "prepare_chunk_indices",
                                 ("cu_seqlens", "chunk_size"))

# causal-conv1d 1.7.0: what its CausalConv1dFn calls.
causal_conv1d_fwd = Launcher("causal_conv1d", _CONV, "causal_conv1d_fwd_function", (
    "x", "weight", "bias", "seq_idx", "initial_states", "final_states_out", "silu_activation"))
causal_conv1d_bwd = Launcher("causal_conv1d", _CONV, "causal_conv1d_bwd_function", (
    "x", "weight", "bias", "dout", "seq_idx", "initial_states", "dfinal_states", "dx",
    "return_dinitial_states", "silu_activation"))

LAUNCHERS = (ssd_scan_fwd, *SSD_BACKWARD_STEPS, gated_rms_norm_fwd, gated_rms_norm_bwd,
             *MAMBA3_SISO_STEPS, *MAMBA3_MIMO_STEPS,
             gated_delta_rule_fwd, gated_delta_rule_bwd, kda_fwd, kda_bwd, gdn2_fwd, gdn2_bwd,
             l2norm_fwd, l2norm_bwd, prepare_chunk_indices, causal_conv1d_fwd, causal_conv1d_bwd)


def launchers_of(package: str) -> tuple[Launcher, ...]:
    """The launchers of `package` (an import name of ACCEPTED_VERSIONS) the ops call."""
    return tuple(launcher for launcher in LAUNCHERS if launcher.package == package)

"""The job's FP8 options as a TOML job and torchtitan 0.2 write them (`model.converters`,
`quantize.linear.float8.*`, `quantize.linear.mx.*`, `quantize.grouped_mm.float8.fqns`).
torchtitan 0.2 declares them; 0.3's quantize section is another one, so titan_hybrid's 0.3
trainer declares these (adapters/torchtitan_0_3/config.py builds them from here). The run reads
them as one derived Float8Section (quantize/float8.py's float8_section).
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_hybrid.config.sections import option


@dataclass(frozen=True)
class QuantizeOptions:
    """`quantize` (the converters are a 0.2 job's `model.converters`)."""
    converters: tuple[str, ...] = option((), """
        quantize.linear.float8 or quantize.linear.mx, and / or quantize.grouped_mm.float8.""",
                                         job_path="model.converters")


@dataclass(frozen=True)
class Float8LinearOptions:
    """`quantize.linear.float8`: the Linear modules in float8."""
    recipe_name: str | None = option(None, """
        tensorwise (None: the default), rowwise or rowwise_with_gw_hp.""")
    emulate: bool = option(False, """
        The float8 GEMMs as casts to float8 and back around a high-precision matmul (CPU).""")
    filter_fqns: tuple[str, ...] = option((), """
        Modules whose FQN contains one of these stay in high precision.""")
    enable_fsdp_float8_all_gather: bool = option(False, """
        FSDP gathers the weights in float8 (tensorwise scaling).""")
    precompute_float8_dynamic_scale_for_fsdp: bool = option(False, """
        Compute the gathered float8 weights' scales once per step, after the optimizer (needs
        enable_fsdp_float8_all_gather).""")


@dataclass(frozen=True)
class MXLinearOptions:
    """`quantize.linear.mx`: the Linear modules in MXFP8."""
    recipe_name: str = option("mxfp8_cublas", """
        mxfp8_cublas, mxfp8_cublas_rceil (Blackwell), mxfp8_emulated or
        mxfp8_emulated_rceil.""")
    filter_fqns: tuple[str, ...] = option(("output",), """
        Modules whose FQN contains one of these stay in high precision.""")


@dataclass(frozen=True)
class Float8GroupedMMOptions:
    """`quantize.grouped_mm.float8`: the routed experts' grouped GEMMs in float8 (rowwise)."""
    fqns: tuple[str, ...] = option((), """
        The routed experts whose FQN contains one of these (empty: all of them).""")


# Each class of FP8 options by its place in a job.
QUANTIZE_OPTIONS = {
    "quantize": QuantizeOptions,
    "quantize.linear.float8": Float8LinearOptions,
    "quantize.linear.mx": MXLinearOptions,
    "quantize.grouped_mm.float8": Float8GroupedMMOptions,
}

"""The job's FP8 options as a TOML job and torchtitan 0.2 write them (`model.converters`,
`quantize.linear.float8.*`, `quantize.linear.mx.*`, `quantize.grouped_mm.float8.fqns`).
torchtitan 0.2 declares them; 0.3's quantize section is another one, so titan_hybrid's 0.3
trainer declares these (adapters/torchtitan_0_3/config.py builds them from here). The run reads
them as one derived Float8Section (quantize/float8.py's float8_section). The
`quantize.linear.float8` options are declared in sections.py, as the base of that section
(which extends them rather than declaring them again); each FP8 option is declared once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from titan_hybrid.config.sections import Float8LinearOptions, MXRecipe, option

Converter = Literal["quantize.linear.float8", "quantize.grouped_mm.float8", "quantize.linear.mx"]


@dataclass(frozen=True)
class QuantizeOptions:
    """`quantize` (the converters are a 0.2 job's `model.converters`)."""
    converters: tuple[Converter, ...] = option((), """
        The FP8 conversions: Linear modules in float8 or in MXFP8 (one of them), and / or the
        routed experts' grouped GEMMs in float8.""", job_path="model.converters")


@dataclass(frozen=True)
class MXLinearOptions:
    """`quantize.linear.mx`: the Linear modules in MXFP8."""
    recipe_name: MXRecipe = option("mxfp8_cublas", """
        torchao's MXFP8 recipe: the cublas ones need a Blackwell GPU, the emulated ones run
        anywhere.""")
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

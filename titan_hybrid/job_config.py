"""titan_hybrid's additions to torchtitan's JobConfig.

Use with `[job] custom_config_module = "titan_hybrid.job_config"` in a TOML (or
`--job.custom_config_module titan_hybrid.job_config`); importing it also registers the
"hybrid" TrainSpec.
"""

from dataclasses import dataclass, field

import titan_hybrid  # noqa: F401  (registers the TrainSpec)


@dataclass
class Hybrid:
    pattern: str = ""
    """Hybrid layer pattern overriding the flavor's (e.g. "M*M-E", "M[M*]-", "M*-/*-")."""

    loss_curve_file: str = ""
    """If set, append each logged step's exact loss as a JSON line to this file."""


@dataclass
class JobConfig:
    hybrid: Hybrid = field(default_factory=Hybrid)

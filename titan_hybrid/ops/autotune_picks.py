"""Autotune picks measured on a GPU, so that a cold start skips Triton's timing runs.

mamba_ssm's SSD kernels autotune on first use: each compiles and times 6-11 configs, most of a
cold first step (about 140 s for nemotron_h_1b on an H200). The package ships, per GPU
architecture, the config each kernel chose there for the flavors' shapes
(titan_hybrid/assets/autotune_picks/sm90.json, written by bench/autotune_picks.py from a Triton
cache). `install_autotune_picks` enters them in the autotuners' own tables, as if each kernel
had already tuned for that tuning key in this process: a call with such a key compiles only its
pick, any other key (other shapes or dtypes) autotunes as before. A pick is always one of the
autotuner's own configs; one it does not have (another mamba_ssm release) is skipped.

Nothing happens at import. The entry points call `install_picks_at_start_up()` once, after the
kernel probe; TITAN_HYBRID_AUTOTUNE_PICKS=0 turns it off (to measure, or to tune afresh).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from titan_hybrid.compat import triton_autotune
from titan_hybrid.ops.kernels import probe_kernels

PICKS_DIR = Path(__file__).resolve().parent.parent / "assets" / "autotune_picks"
OPT_OUT = "TITAN_HYBRID_AUTOTUNE_PICKS"


def picks_file(capability: tuple[int, int]) -> Path:
    """Where the table for a compute capability is shipped: (9, 0) -> sm90.json."""
    return PICKS_DIR / f"sm{capability[0]}{capability[1]}.json"


def shipped_picks(capability: tuple[int, int]) -> dict | None:
    """The shipped table for a compute capability, None when there is none."""
    path = picks_file(capability)
    return json.loads(path.read_text()) if path.is_file() else None


@dataclass(frozen=True)
class InstalledPicks:
    installed: int
    skipped: tuple[str, ...]  # one line per pick not installed, saying why


def install_autotune_picks(table: dict) -> InstalledPicks:
    """Enter each pick of `table` (a shipped table's layout) in its kernel's autotuner. mamba_ssm
    must be usable (the start-up probe's verdict)."""
    autotuners = triton_autotune.ssd_autotuners()
    skipped = []
    for pick in table["picks"]:
        where = f"{pick['kernel']} {pick['key']}"
        autotuner = autotuners.get(pick["kernel"])
        config = None if autotuner is None else triton_autotune.own_config(
            autotuner, pick["config"])
        if autotuner is None:
            skipped.append(f"{where}: the installed mamba_ssm has no such autotuned kernel")
        elif config is None:
            skipped.append(f"{where}: its config is not one the installed mamba_ssm declares")
        else:
            triton_autotune.prefill(autotuner, tuple(pick["key"]), config)
    return InstalledPicks(len(table["picks"]) - len(skipped), tuple(skipped))


def install_picks_at_start_up() -> str | None:
    """The entry points' call: install the shipped picks for this GPU when mamba_ssm's kernels
    run here; returns the line to log, None without CUDA or without mamba_ssm."""
    if not torch.cuda.is_available() or probe_kernels()["mamba_ssm"] is not None:
        return None
    if os.environ.get(OPT_OUT) == "0":
        return f"autotune picks: not installed ({OPT_OUT}=0), mamba_ssm's kernels autotune"
    capability = torch.cuda.get_device_capability()
    table = shipped_picks(capability)
    if table is None:
        return (f"autotune picks: none shipped for {picks_file(capability).stem}, mamba_ssm's "
                "kernels autotune")
    result = install_autotune_picks(table)
    measured = table["measured"]
    line = (f"autotune picks: {result.installed} of {len(table['picks'])} installed "
            f"({picks_file(capability).name}: {measured['device']}, triton {measured['triton']},"
            f" mamba_ssm {measured['mamba_ssm']})")
    return "; ".join([line, *result.skipped])

"""A TOML job (train_configs/*.toml, with 0.2's names) as torchtitan 0.3's HybridTrainer.Config:
what `--module titan_hybrid --config NAME` and the launcher's `--job.config_file` give under 0.3.

Each TOML field lands on the 0.3 field that means the same (titan_hybrid/adapters/command_line.py
has the table of the names 0.3 spells differently); a field that has no meaning under 0.3 is
refused by name, with its replacement when there is one.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from titan_hybrid.adapters.command_line import (
    NEGATED_UNDER_0_3,
    NOT_NEEDED_UNDER_0_3,
    RENAMED_UNDER_0_3,
    refusal_under_0_3,
)


def _fields(table: dict, prefix: str = ""):
    for key, value in table.items():
        if isinstance(value, dict):
            yield from _fields(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _set(config, path: list[str], value, where: str) -> None:
    """Set the field at `path` (e.g. ["validator", "dataloader", "dataset"]) of `config`."""
    target = config
    for name in path[:-1]:
        target = getattr(target, name, None)
    if not dataclasses.is_dataclass(target) or path[-1] not in {
            f.name for f in dataclasses.fields(target)}:
        raise ValueError(f"{where} is not a field titan_hybrid's torchtitan 0.3 trainer knows")
    if isinstance(getattr(target, path[-1]), tuple) and isinstance(value, list):
        value = tuple(value)
    setattr(target, path[-1], value)


def apply_toml(config, path: Path):
    """`config` (a HybridTrainer.Config) with the TOML job at `path` applied; ValueError names
    a field that 0.3 cannot take."""
    try:
        with open(path, "rb") as f:
            job = tomllib.load(f)
    except tomllib.TOMLDecodeError as error:  # its message has no file name
        raise ValueError(f"job.config_file '{path}' is not valid TOML: {error}") from None
    for name, value in _fields(job):
        where = f"{path.name}: {name}"
        if name == "model.name" and value != "hybrid":
            raise ValueError(f"{where}='{value}' is not 'hybrid'")
        if name in NOT_NEEDED_UNDER_0_3:
            continue
        refusal = refusal_under_0_3(name)
        if refusal:
            raise ValueError(f"{path.name}: {refusal}")
        if name in NEGATED_UNDER_0_3:
            name, value = NEGATED_UNDER_0_3[name], not value
        _set(config, RENAMED_UNDER_0_3.get(name, name).split("."), value, where)
    return config

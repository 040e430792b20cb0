"""A TOML job (train_configs/*.toml, the 0.2 section names) as torchtitan 0.3's
HybridTrainer.Config: what `--module titan_hybrid --config NAME` and the launcher's
`--job.config_file` give under 0.3.

Each TOML field lands on the 0.3 field that means the same (the table below); a field that has
no meaning under 0.3 is refused by name, with its replacement when there is one.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

# (section, field) -> (0.3 section or "" for a top-level field, 0.3 field). A section
# listed alone maps every field to the same name in that 0.3 section.
RENAMED = {
    ("job", "dump_folder"): ("", "dump_folder"),
    ("model", "hf_assets_path"): ("", "hf_assets_path"),
    ("model", "flavor"): ("hybrid", "flavor"),
    ("training", "dataset"): ("dataloader", "dataset"),
    ("training", "dataset_path"): ("dataloader", "dataset_path"),
    ("validation", "enable"): ("validator", "enable"),
    ("validation", "freq"): ("validator", "freq"),
    ("validation", "steps"): ("validator", "steps"),
    ("validation", "seq_len"): ("validator", "seq_len"),
    ("validation", "local_batch_size"): ("validator", "local_batch_size"),
    ("debug", "seed"): ("debug", "seed"),
    ("profiling", "enable_profiling"): ("profiler", "enable_profiling"),
}
SAME_SECTIONS = ("hybrid", "optimizer", "lr_scheduler", "training", "parallelism",
                 "checkpoint", "activation_checkpoint", "compile", "metrics")
# What 0.3 has instead, or why nothing is needed.
IGNORED = {
    ("job", "description"): "",
    ("job", "custom_config_module"): "",  # 0.3 reads titan_hybrid's sections natively
    ("experimental", "custom_import"): "",  # --module titan_hybrid imports it
    ("model", "name"): "",
}
REFUSED = {
    ("model", "converters"): "0.3 quantizes through model-config converters",
}


def _set(config, section: str, name: str, value, where: str) -> None:
    target = getattr(config, section) if section else config
    if target is None or name not in {f.name for f in dataclasses.fields(target)}:
        raise ValueError(f"{where} is not a field titan_hybrid's torchtitan 0.3 trainer knows")
    if isinstance(getattr(target, name), tuple) and isinstance(value, list):
        value = tuple(value)
    setattr(target, name, value)


def apply_toml(config, path: Path):
    """`config` (a HybridTrainer.Config) with the TOML job at `path` applied; ValueError names
    a field that 0.3 cannot take."""
    with open(path, "rb") as f:
        job = tomllib.load(f)
    for section, fields in job.items():
        for name, value in fields.items():
            where = f"{path.name}: {section}.{name}"
            if (section, name) in IGNORED:
                continue
            if section == "model" and name == "name" and value != "hybrid":
                raise ValueError(f"{where}='{value}' is not 'hybrid'")
            if (section, name) in REFUSED:
                raise ValueError(f"{where} has no meaning under torchtitan 0.3: "
                                 f"{REFUSED[(section, name)]}")
            if section == "validation" and name in ("dataset", "dataset_path"):
                _set(config, "validator", "dataloader", dataclasses.replace(
                    config.validator.dataloader, **{name: value}), where)
            elif section == "parallelism" and name == "disable_sequence_parallel":
                _set(config, "parallelism", "enable_sequence_parallel", not value, where)
            elif (section, name) in RENAMED:
                _set(config, *RENAMED[(section, name)], value, where)
            elif section in SAME_SECTIONS:
                _set(config, section, name, value, where)
            else:
                raise ValueError(f"{where} is not a field titan_hybrid's torchtitan 0.3 "
                                 "trainer knows")
    return config

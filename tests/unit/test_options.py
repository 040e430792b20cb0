"""Each titan_hybrid option is declared once (titan_hybrid/config), and the installed
torchtitan's command line exposes exactly those that torchtitan lacks, each with that
declaration's default and help text (issue 48 item 1). Runs under either torchtitan: the 0.2
leg checks torchtitan_plugin's JobConfig, the 0.3 leg HybridTrainer.Config."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from tests.torchtitan_generation import INSTALLED
from titan_hybrid.adapters.installed import front_end
from titan_hybrid.adapters.options import declared_options
from titan_hybrid.config.sections import OVERRIDES_TORCHTITAN, help_text

if INSTALLED == (0, 2):
    from torchtitan.config import JobConfig as StockConfig

    def place(path: str) -> str | None:
        return path
else:
    from torchtitan.trainer import Trainer

    from titan_hybrid.adapters.torchtitan_0_3.config import place_under_0_3 as place

    StockConfig = Trainer.Config

# A 0.3 component's own setting, not a job option: HybridLoss's MTP weight for a user's job
# (None: the model's), which 0.2 has no loss config to hold.
COMPONENT_SETTINGS = {(0, 2): set(), (0, 3): {"loss.mtp_loss_coeff"}}[INSTALLED]


def _paths(config, prefix: str = "") -> dict:
    """Every leaf field of a config, by dotted path."""
    paths = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            paths.update(_paths(value, f"{prefix}{f.name}."))
        else:
            paths[f"{prefix}{f.name}"] = value
    return paths


@functools.cache
def _ours() -> dict:
    return _paths(front_end.parse_job([]))


def _options() -> list:
    return [(path, f) for path, f, _ in declared_options()]


def test_the_command_line_adds_exactly_the_declared_options_torchtitan_lacks():
    stock = _paths(StockConfig())
    declared = {place(path) for path, f in _options() if place(path) is not None
                and (place(path) not in stock or f.metadata.get(OVERRIDES_TORCHTITAN))}
    added = {path for path in _ours() if path not in stock}
    assert added | {path for path in declared if path in stock} == declared | COMPONENT_SETTINGS
    assert len(declared) >= 10


@pytest.mark.parametrize("path, option", _options(), ids=[p for p, _ in _options()])
def test_each_option_is_on_the_command_line_with_its_default(path, option):
    placed = place(path)
    if placed is None:  # under 0.3 a field of torchtitan's that says the opposite
        assert INSTALLED == (0, 3) and path == "parallelism.disable_sequence_parallel"
        assert _ours()["parallelism.enable_sequence_parallel"] is (not option.default)
        return
    value = _ours()[placed]
    stock = _paths(StockConfig())
    if placed not in stock or option.metadata.get(OVERRIDES_TORCHTITAN):
        assert (tuple(value) if isinstance(value, list) else value) == option.default


def test_the_help_of_each_declared_option_is_its_one_help_text(capsys):
    with pytest.raises(SystemExit) as leaving:
        front_end.parse_job(["--help"])
    assert leaving.value.code in (0, None)
    text = " ".join(capsys.readouterr().out.split())
    stock = _paths(StockConfig())
    checked = 0
    for path, option in _options():
        placed = place(path)
        if placed is None or (placed in stock and not option.metadata.get(OVERRIDES_TORCHTITAN)):
            continue  # torchtitan's own field, with torchtitan's help
        flag = "--" + placed.replace("_", "-")
        assert flag in text, flag
        words = help_text(option).split()
        after_flag = text[text.index(flag):]
        assert " ".join(words) in after_flag[:len(" ".join(words)) + 400], (flag, words)
        checked += 1
    assert checked >= 10

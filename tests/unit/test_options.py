"""Each titan_hybrid option is declared once (titan_hybrid/config), and the installed
torchtitan's command line exposes exactly those that torchtitan lacks, each with that
declaration's default and help text (issue 48 item 1). Runs under either torchtitan: the 0.2
leg checks torchtitan_plugin's JobConfig, the 0.3 leg HybridTrainer.Config."""

from __future__ import annotations

import ast
import dataclasses
import functools
from pathlib import Path

import pytest
import torchtitan

import titan_hybrid
from tests.torchtitan_generation import INSTALLED
from titan_hybrid.adapters.installed import front_end
from titan_hybrid.adapters.options import declared_options
from titan_hybrid.config.sections import OVERRIDES_TORCHTITAN, choices, help_text
from titan_hybrid.training.preflight import check_run
from titan_hybrid.training.run_config import RunConfig

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
        values = choices(_types()[path])
        if values is not None:  # an enumerated option shows its values (its Literal's)
            shown = after_flag[:len(flag) + 200].replace(" ", "")  # wrapped after a comma
            assert shown.startswith(f"{flag}{{{','.join(values)}}}"), (flag, values)
        checked += 1
    assert checked >= 10


def _types() -> dict:
    return {path: field_type for path, _, field_type in declared_options()}


@pytest.mark.parametrize("path", [path for path, field_type in _types().items()
                                  if choices(field_type) is not None])
def test_an_enumerated_options_help_names_all_its_values_or_none(path):
    """Help prose that explains each value cannot lose one: the values are the Literal's."""
    option = dict(_options())[path]
    words = set(help_text(option).replace(",", " ").replace(":", " ").replace(";", " ")
                .replace("(", " ").replace(")", " ").split())
    values = set(choices(_types()[path]))
    assert not words & values or values <= words, (path, values - words)


# Each RunConfig field is read by titan_hybrid, or from the job by torchtitan's trainer and its
# components, or refused: a field accepted and then ignored (fsdp_reshard_after_forward was)
# fails here. "Read by titan_hybrid": an attribute of its name is read by a module outside
# config/ (the declarations) and pre-flight (a check is no use).
READ_BY_TORCHTITAN = {  # field: the torchtitan module(s) that read it, by generation
    "training.max_norm": "trainer",  # its gradient clipping
    "training.gc_freq": "trainer",
    "checkpoint.interval": "checkpointer",  # titan_hybrid's manager extends torchtitan's
    "checkpoint.load_step": "trainer",  # the step it asks the checkpointer to load
    "checkpoint.initial_load_in_hf": "checkpointer",
    "lr_scheduler.warmup_steps": "lr_scheduler",
    "lr_scheduler.decay_ratio": "lr_scheduler",
    "lr_scheduler.decay_type": "lr_scheduler",
    "lr_scheduler.min_lr_factor": "lr_scheduler",
    "metrics.log_freq": "metrics",  # titan_hybrid's processor extends torchtitan's
}
TORCHTITAN_MODULES = {
    (0, 2): {"trainer": ["train.py"], "checkpointer": ["components/checkpoint.py"],
             "lr_scheduler": ["components/lr_scheduler.py"],
             "metrics": ["components/metrics.py"]},
    (0, 3): {"trainer": ["trainer.py"], "checkpointer": ["components/checkpointer/base.py",
                                                         "components/checkpointer/dcp.py"],
             "lr_scheduler": ["components/optimizer/lr_scheduler.py"],
             "metrics": ["components/metrics.py"]},
}[INSTALLED]
REFUSED = {"parallelism.fsdp_reshard_after_forward": "never"}  # field: a value it refuses


def _attributes_read(files) -> set[str]:
    names = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                names.add(node.attr)
    return names


def _run_config_fields() -> list[str]:
    return [f"{section.name}.{f.name}" for section in dataclasses.fields(RunConfig)
            if section.name not in ("model", "dump_folder")
            for f in dataclasses.fields(section.default_factory)]


def test_every_run_config_field_is_read_or_refused():
    package = Path(titan_hybrid.__file__).parent
    read = _attributes_read(path for path in package.rglob("*.py")
                            if path.parent.name != "config" and path.name != "preflight.py")
    ignored = [path for path in _run_config_fields() if path.rpartition(".")[2] not in read
               and path not in READ_BY_TORCHTITAN and path not in REFUSED]
    assert ignored == [], f"read by nothing, and not refused: {ignored}"


@pytest.mark.parametrize("path", READ_BY_TORCHTITAN)
def test_what_torchtitan_reads_it_reads(path):
    package = Path(torchtitan.__file__).parent
    modules = [package / name for name in TORCHTITAN_MODULES[READ_BY_TORCHTITAN[path]]]
    assert path in _run_config_fields()
    assert path.rpartition(".")[2] in _attributes_read(modules), (path, modules)


@pytest.mark.parametrize("path, value", REFUSED.items())
def test_what_titan_hybrid_does_not_honour_is_refused_by_name(path, value):
    from tests.unit.test_bad_inputs import CONFIG

    run = front_end.run_config(front_end.parse_job(["--job.config_file", CONFIG,
                                                    f"--{path}", value]))
    with pytest.raises(ValueError, match=f"^{path}={value!r} is not supported"):
        check_run(run, 1)

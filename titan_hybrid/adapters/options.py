"""titan_hybrid's options on each torchtitan's command line, and the RunConfig read back from
a parsed job: both built from the one declaration of each option (titan_hybrid/config).

- `with_options` makes a torchtitan section class (or a new one) with the options that this
  torchtitan lacks, each with the declared default and help text (a dataclass made at import,
  so that a new option is one field in titan_hybrid/config and nothing here).
- `read_sections` fills the RunConfig's sections from any parsed job, through a `read(path)`
  that finds a field by its TOML / torchtitan 0.2 path; the 0.3 adapter's reader translates
  the path with adapters/command_line.py's table of the names 0.3 spells differently.

Generated classes rather than hand-written mixins: torchtitan 0.3's config classes use
`slots=True`, which forbids combining two dataclass bases that both hold fields, and the
declarations are frozen (the RunConfig's) while tyro needs mutable sections.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import types
import typing
from collections.abc import Callable, Iterator

import tyro

from titan_hybrid.config.quantize import QUANTIZE_OPTIONS
from titan_hybrid.config.sections import (
    OVERRIDES_TORCHTITAN,
    check_choices,
    choices,
    help_text,
    job_path,
    section_choices,
)
from titan_hybrid.hf.families import model_args_from_hf
from titan_hybrid.model.args import resolve_model_args
from titan_hybrid.training.run_config import RunConfig

MISSING = object()
"""What a reader returns for a field the parsed job does not have."""

RUN_SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(RunConfig)
                if f.default_factory is not dataclasses.MISSING and f.name != "float8"}
"""The RunConfig's sections that hold options, by name (`float8` is derived from `quantize`)."""


def declared_options() -> Iterator[tuple[str, dataclasses.Field, object]]:
    """Each option titan_hybrid declares: (its job path, its field, its resolved type)."""
    for name, section_cls in (*RUN_SECTIONS.items(), *QUANTIZE_OPTIONS.items()):
        types = typing.get_type_hints(section_cls)
        for section_field in dataclasses.fields(section_cls):
            if help_text(section_field) is not None:
                yield job_path(name, section_field), section_field, types[section_field.name]


def enumerated_paths() -> frozenset[str]:
    """The job paths of the RunConfig's enumerated fields: the ones whose values it checks."""
    return frozenset(job_path(name, f) for name, section_cls in RUN_SECTIONS.items()
                     for f in dataclasses.fields(section_cls)
                     if f.name in section_choices(section_cls))


def _without_choices(field_type):
    """`field_type` with each Literal as str."""
    origin, args = typing.get_origin(field_type), typing.get_args(field_type)
    if origin is typing.Literal:
        return str
    if origin in (typing.Union, types.UnionType):
        return functools.reduce(operator.or_, map(_without_choices, args))
    if origin is tuple:
        return tuple[_without_choices(args[0]), ...]
    return field_type


def _command_line_field(section_field: dataclasses.Field, field_type) -> tuple:
    """(type, dataclasses.field) of an option on a command line: tuples become lists (tyro's
    and torchtitan's sequences), the help goes where tyro reads it. An enumerated option is a
    str there, its values shown as its metavar: the RunConfig refuses another value in one line
    (config/sections.py's check_choices), where tyro would print its boxed panel, which nothing
    of titan_hybrid's turns into one line under `torchtitan.train`."""
    default = section_field.default
    values = choices(field_type)
    arg = tyro.conf.arg(help=help_text(section_field), metavar=None if values is None else
                        "{" + ",".join(values) + "}")
    field_type = _without_choices(field_type)
    if typing.get_origin(field_type) is tuple:
        field_type = list[typing.get_args(field_type)[0]]
        spec = dataclasses.field(default_factory=lambda: list(default))
    else:
        spec = dataclasses.field(default=default)
    return typing.Annotated[field_type, arg], spec


def with_options(name: str, base: type | None, section: str,
                 place: Callable[[str], str | None] = lambda path: path, *,
                 module: str, doc: str | None = None, **dataclass_options) -> type:
    """A dataclass `name`: `base` (a torchtitan section class; None: a section of
    titan_hybrid's own) plus each option that `place` puts at `<section>.<field>` and `base`
    lacks (or whose declaration overrides torchtitan's). `place` maps a job path to this
    torchtitan's (None: not on its command line). `module` is where the class is kept, so
    that it pickles; `doc` its docstring."""
    have = {f.name for f in dataclasses.fields(base)} if base is not None else set()
    fields = []
    for path, section_field, field_type in declared_options():
        placed = place(path)
        if placed is None or placed.rpartition(".")[0] != section:
            continue
        field_name = placed.rpartition(".")[2]
        if field_name in have and not section_field.metadata.get(OVERRIDES_TORCHTITAN):
            continue
        fields.append((field_name, *_command_line_field(section_field, field_type)))
    cls = dataclasses.make_dataclass(name, fields, bases=(base,) if base else (),
                                     **dataclass_options)
    cls.__module__, cls.__qualname__ = module, name
    cls.__doc__ = doc or (f"`--{section}.*`: " + (f"torchtitan's {base.__qualname__} with "
                                                  if base else "") + "titan_hybrid's options.")
    return cls


def attribute_reader(root, place: Callable[[str], str | None] = lambda path: path):
    """read(path): the field of the parsed job `root` at `place(path)`, or MISSING."""
    def read(path: str):
        placed = place(path)
        if placed is None:
            return MISSING
        value = root
        for part in placed.split("."):
            value = getattr(value, part, MISSING)
            if value is MISSING:
                return MISSING
        return value
    return read


def read_section(section_cls: type, section: str, read):
    """`section_cls` from a parsed job: each field that `read` finds, else its default. Lists
    become tuples, so the section stays immutable."""
    values = {}
    for section_field in dataclasses.fields(section_cls):
        value = read(job_path(section, section_field))
        if value is not MISSING:
            values[section_field.name] = tuple(value) if isinstance(value, list) else value
    return section_cls(**values)


def check_quantize_choices(read) -> None:
    """ValueError for an FP8 option whose value is not one of its type's, whether or not the
    job's converters use it (a typo is a typo; under torchtitan 0.2 the command line refuses
    its own Literal fields' typos alike). `model.converters` is float8_section's to check."""
    for path, section_cls in QUANTIZE_OPTIONS.items():
        if path != "quantize":
            check_choices(path, read_section(section_cls, path, read))


def read_sections(read) -> dict:
    """The RunConfig's option sections from a parsed job."""
    return {name: read_section(cls, name, read) for name, cls in RUN_SECTIONS.items()}


def run_config_from(sections: dict, *, dump_folder: str, float8, model=None) -> RunConfig:
    """The RunConfig of these sections, its model args resolved from the flavor (or the HF
    config `hybrid.model_config`) with the job's pattern, sequence length and seed unless
    `model` is given; ValueError names a field titan_hybrid cannot run."""
    hybrid, training = sections["hybrid"], sections["training"]
    if model is None:
        model = resolve_model_args(hybrid.flavor, pattern=hybrid.pattern,
                                   seq_len=training.seq_len, seed=training.seed,
                                   hc_mult=hybrid.hc_mult, m_layers=hybrid.m_layers,
                                   g_layers=hybrid.g_layers,
                                   base=model_args_from_hf(hybrid.model_config)
                                   if hybrid.model_config else None)
    return RunConfig(model=model, dump_folder=dump_folder, float8=float8, **sections)

"""The job's names under both torchtitan generations, for the TOML front end
(`run_train.sh --job.config_file F --section.field value ...`, the same command under either).

The TOML jobs and their flags use torchtitan 0.2's names; 0.3 spells some differently and has
no place for others. This table is the one place that knows both: 0.3's TOML reader
(torchtitan_0_3/toml_job.py) and its flag translation read it, and under 0.2 a flag spelled the
0.3 way is one line naming the 0.2 spelling. tyro's boxed parse errors (an unknown flag, a value
of the wrong type, a value that is not one of a field's) become one line too
(`one_line_parse_errors`), in the words of titan_hybrid's own checks.
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
import sys
import warnings

from titan_hybrid.config.sections import choice_error

# 0.2 / TOML name -> 0.3 name.
RENAMED_UNDER_0_3 = {
    "job.dump_folder": "dump_folder",
    "job.print_config": "debug.print_config",
    "job.save_config_file": "debug.save_config_file",
    "model.hf_assets_path": "hf_assets_path",
    "model.flavor": "hybrid.flavor",
    "model.converters": "quantize.converters",  # 0.3's model spec has no converters
    "training.dataset": "dataloader.dataset",
    "training.dataset_path": "dataloader.dataset_path",
    "parallelism.enable_async_tensor_parallel": "compile.enable_async_tensor_parallel",
    **{f"validation.{name}": f"validator.{name}"
       for name in ("enable", "freq", "steps", "seq_len", "local_batch_size")},
    "validation.dataset": "validator.dataloader.dataset",
    "validation.dataset_path": "validator.dataloader.dataset_path",
    **{f"profiling.{name}": f"profiler.{name}"
       for name in ("enable_profiling", "profile_freq", "profiler_active", "profiler_warmup",
                    "save_traces_folder", "enable_memory_snapshot",
                    "save_memory_snapshot_folder")},
}
# A boolean whose 0.3 field says the opposite.
NEGATED_UNDER_0_3 = {"parallelism.disable_sequence_parallel": "parallelism.enable_sequence_parallel"}
# 0.3 needs no value for these: `--module titan_hybrid` / the trainer class stand in for them.
NOT_NEEDED_UNDER_0_3 = ("job.description", "job.custom_config_module",
                        "experimental.custom_import", "model.name")
# Fields (or whole sections, ending in ".") that mean nothing under 0.3, and why.
NO_MEANING_UNDER_0_3 = {
    "quantize.linear.mx.mxfp8_dim1_cast_kernel_choice": "torchao's MXFP8Linear picks its "
                                                       "cast kernels",
    "quantize.grouped_mm.mx.": "titan_hybrid's FP8 is quantize.grouped_mm.float8",
    "model.print_after_conversion": "titan_hybrid's model spec converts nothing",
    "model.tokenizer_path": "use --hf_assets_path",
    "memory_estimation.": "torchtitan 0.3 has no memory estimation",
    "fault_tolerance.": "torchtitan 0.3 has no torchft integration",
    "checkpoint.enable_ft_dataloader_checkpoints": "torchtitan 0.3 has no torchft integration",
    "experimental.custom_args_module": "titan_hybrid's sections are fields of its "
                                       "HybridTrainer.Config",
    "optimizer.early_step_in_backward": "titan_hybrid's trainer steps after the backward",
    "parallelism.pipeline_parallel_expert_parallel_overlap":
        "use --parallelism.expert_parallel_overlap",
    "parallelism.context_parallel_rotate_method":
        "titan_hybrid's context parallelism gathers keys and values (no ring to rotate)",
    "parallelism.expert_parallel_comm_backend": "titan_hybrid's experts exchange tokens "
                                                "with all-to-all",
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns":
        "titan_hybrid's selective AC: --activation_checkpoint.selective_ac_option",
    "activation_checkpoint.debug": "titan_hybrid's activation checkpointing has no debug mode",
    "activation_checkpoint.determinism_check": "titan_hybrid's activation checkpointing "
                                               "checks nothing",
    "activation_checkpoint.visualize_memory_budget_pareto":
        "titan_hybrid's activation checkpointing draws nothing",
    "training.dataloader.": "titan_hybrid's loader reads in the training process",
    "validation.dataloader.": "titan_hybrid's loader reads in the training process",
}
RENAMED_UNDER_0_2 = {new: old for old, new in RENAMED_UNDER_0_3.items()}
RENAMED_UNDER_0_2.update({new: f"{old} (its negation)" for old, new in NEGATED_UNDER_0_3.items()})

_FLAG = re.compile(r"--(?P<name>[a-z_][a-z0-9_.-]*)(?P<value>=.*)?$", re.IGNORECASE)


def split_flag(arg: str) -> tuple[str, bool, str | None] | None:
    """`--section.no-field=v` -> ("section.field", negated, "v"); None if not a flag."""
    match = _FLAG.match(arg)
    if match is None:
        return None
    section, _, field = match["name"].replace("-", "_").rpartition(".")
    negated = field.startswith("no_") and bool(section)
    field = field[3:] if negated else field
    value = match["value"][1:] if match["value"] else None
    return (f"{section}.{field}" if section else field), negated, value


def _no_meaning(name: str) -> str | None:
    for entry, reason in NO_MEANING_UNDER_0_3.items():
        if name == entry or (entry.endswith(".") and name.startswith(entry)):
            return reason
    return None


def refusal_under_0_3(name: str) -> str | None:
    """Why the 0.2 / TOML field `name` cannot be given under 0.3 (None: it can)."""
    reason = _no_meaning(name)
    return f"{name} has no meaning under torchtitan 0.3: {reason}" if reason else None


def flags_for_0_3(args: list[str]) -> list[str]:
    """The job's flags, written with 0.2's names, as 0.3's trainer spells them; ValueError for
    one that means nothing under 0.3."""
    out, index = [], 0
    while index < len(args):
        arg, index = args[index], index + 1
        flag = split_flag(arg)
        if flag is None:
            out.append(arg)
            continue
        name, negated, value = flag
        if name in NOT_NEEDED_UNDER_0_3:
            if name == "model.name" and (value or _next(args, index)) not in (None, "hybrid"):
                raise ValueError(f"model.name={value or _next(args, index)!r} is not 'hybrid'")
            if value is None and _next(args, index) is not None:
                index += 1  # and its value
            continue
        refusal = refusal_under_0_3(name)
        if refusal:
            raise ValueError(refusal)
        if name in NEGATED_UNDER_0_3:
            name, negated = NEGATED_UNDER_0_3[name], not negated
        name = RENAMED_UNDER_0_3.get(name, name)
        section, _, field = name.rpartition(".")
        spelled = f"{section}.no-{field}" if negated else name
        out.append(f"--{spelled}" + (f"={value}" if value is not None else ""))
    return out


def refuse_0_3_names(args: list[str]) -> None:
    """Under 0.2: ValueError naming the 0.2 spelling of a flag written the 0.3 way."""
    for arg in args:
        flag = split_flag(arg)
        if flag and flag[0] in RENAMED_UNDER_0_2:
            raise ValueError(f"--{flag[0]} is torchtitan 0.3's name; under torchtitan 0.2.2 "
                             f"use --{RENAMED_UNDER_0_2[flag[0]]}")


def _next(args: list[str], index: int) -> str | None:
    """The value after a flag, if the next argument is one."""
    if index < len(args) and not args[index].startswith("--"):
        return args[index]
    return None


def config_file(args: list[str]) -> tuple[str, list[str]]:
    """(the --job.config_file value or '', the other arguments)."""
    for index, arg in enumerate(args):
        if arg.startswith(("--job.config_file=", "--job.config-file=")):
            return arg.split("=", 1)[1], args[:index] + args[index + 1:]
        if arg in ("--job.config_file", "--job.config-file") and index + 1 < len(args):
            return args[index + 1], args[:index] + args[index + 2:]
    return "", list(args)


def job_name(flag: str) -> str:
    """`--activation-checkpoint.mode` (tyro's spelling, maybe 0.3's name) -> the job's name,
    `activation_checkpoint.mode` (a field's name has no dash)."""
    name = flag.lstrip("-").replace("-", "_")
    renamed = RENAMED_UNDER_0_2.get(name, name)
    return name if renamed.endswith(")") else renamed  # a negation keeps 0.3's name


# tyro's warning for a field whose TOML value (the parse's default) is not of its type
_DEFAULT_NOT_OF_ITS_TYPE = re.compile(r"The field `(?P<field>[^`]+)` is annotated with type "
                                      r"`typing\.Literal\[")


@contextlib.contextmanager
def one_line_parse_errors(checked_later: frozenset[str] = frozenset()):
    """tyro's boxed parse error (it prints a panel and exits with status 2) as one ValueError:
    the panel's first line, and its first suggestion. `--help` and its exit pass through.
    `checked_later`: the job's fields whose values the RunConfig checks (their choices): tyro's
    warning about such a field's TOML value is dropped, as the check says it in one line (tyro
    warns from the TOML value even when a flag then replaces it)."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(captured), \
                warnings.catch_warnings(record=True) as caught:
            yield
    except SystemExit as leaving:
        if leaving.code in (0, None):
            sys.stdout.write(captured.getvalue())
            raise
        raise ValueError(_first_line_of_panel(captured.getvalue())) from None
    else:
        sys.stderr.write(captured.getvalue())  # what the parse logged
        for caught_warning in caught:
            found = _DEFAULT_NOT_OF_ITS_TYPE.match(str(caught_warning.message))
            if found is None or job_name(found["field"]) not in checked_later:
                warnings.showwarning(caught_warning.message, caught_warning.category,
                                     caught_warning.filename, caught_warning.lineno)


# tyro's message for a flag's value that is not one of a Literal field's
_INVALID_CHOICE = re.compile(r"invalid choice '(?P<value>.*)' for argument '(?P<flag>[^']+)'\. "
                             r"Expected one of (?P<values>\(.*\))\.?$")


def _first_line_of_panel(text: str) -> str:
    """tyro's panel: a title, a rule, the message (maybe wrapped), a rule, then suggestions
    ("Perhaps you meant:") or help text."""
    lines = [line.strip().strip("│╭╮╰╯").strip() for line in text.splitlines()]
    rules = [i for i, line in enumerate(lines) if line and not set(line) - set("-─")]
    if not rules:
        return "the command line cannot be parsed"
    end = rules[1] if len(rules) > 1 else len(lines)
    message = " ".join(line for line in lines[rules[0] + 1:end] if line)
    choice = _INVALID_CHOICE.match(message)
    if choice:
        values = ast.literal_eval(choice["values"])  # an optional field's include 'None'
        return str(choice_error(job_name(choice["flag"]), choice["value"],
                                [value for value in values if value != "None"]))
    if message.startswith("Unrecognized options:"):  # tyro lists the flags' values too
        flags = [word.rstrip(",") for word in message.split()[2:] if word.startswith("--")]
        message = "unknown flag: " + ", ".join(flags)
    if "Perhaps you meant:" in lines:
        suggestion = lines[lines.index("Perhaps you meant:") + 1].split()[0]
        message += f" (did you mean {suggestion}?)"
    return message

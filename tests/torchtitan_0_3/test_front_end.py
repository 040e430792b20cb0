"""The TOML front end under torchtitan 0.3 (titan_hybrid/adapters/torchtitan_0_3/front_end.py):
`run_train.sh --job.config_file F --section.field value ...` takes the same job files and flags
as under 0.2, with the same one-line errors, and runs the same job as the config registry."""

from __future__ import annotations

import os
import re
import shlex
import subprocess

import pytest

from tests.launch import REPO_ROOT
from tests.torchtitan_0_3.test_adapter import SMALL, curve
from tests.unit.test_bad_inputs import (  # noqa: F401 (its tests, run here under 0.3 too)
    BAD_INPUTS,
    CONFIG,
    test_a_flag_that_replaces_a_toml_typo_is_taken_without_a_word,
    test_a_typo_in_the_toml_is_one_line_naming_the_values,
    test_unreadable_config_file,
)
from titan_hybrid import launch

# The launcher's bad inputs under 0.2 whose message is another one under 0.3 (None: the flag
# is accepted, as 0.3 has no use for it).
UNDER_0_3 = {
    "--optimizer.early_step_in_backward":
        "optimizer.early_step_in_backward has no meaning under torchtitan 0.3: titan_hybrid's "
        "trainer steps after the backward",
    "--fault_tolerance.enable": "fault_tolerance.enable has no meaning under torchtitan 0.3",
    "--job.custom_config_module titan_hybrid.job_config": None,
    "--validation.enable --validation.steps 0": "validation.steps=0 must be -1",
}
CASES = [(args, UNDER_0_3.get(" ".join(args), message)) for args, message in BAD_INPUTS]
CASES += [
    (("--model.converters", "float8"), "model.converters ['float8']: titan_hybrid converts"),
    (("--quantize.linear.mx.mxfp8_dim1_cast_kernel_choice", "cuda"),
     "quantize.linear.mx.mxfp8_dim1_cast_kernel_choice has no meaning under torchtitan 0.3: "
     "torchao's MXFP8Linear picks its cast kernels"),
    (("--parallelism.pipeline_parallel_expert_parallel_overlap",),
     "use --parallelism.expert_parallel_overlap"),
    (("--training.stepz", "3"), "unknown flag: --training.stepz (did you mean "
                                "--training.steps?)"),
    (("--training.steps", "abc"), "Error parsing --training.steps: invalid literal"),
]


@pytest.mark.parametrize("args, message", [c for c in CASES if c[1]],
                         ids=[" ".join(a) for a, m in CASES if m])
def test_bad_input_gets_the_same_one_line_as_under_0_2(args, message, capsys, monkeypatch):
    def no_workers(*_):
        raise AssertionError("a worker was started for a bad job")

    monkeypatch.setattr(launch, "run_workers", no_workers)
    monkeypatch.setattr(launch, "run_here", no_workers)
    code = launch.main(["--job.config_file", CONFIG, *args])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_a_toml_job_with_0_2_flags_is_the_registrys_job_with_0_3_flags():
    from torchtitan.config import ConfigManager

    from titan_hybrid.adapters.torchtitan_0_3.front_end import parse_job

    ours = parse_job([
        "--job.config_file", str(REPO_ROOT / "train_configs" / "hybrid_moe.toml"),
        "--training.steps", "3", "--model.flavor", "debug", "--validation.enable",
        "--validation.seq_len", "64", "--validation.dataset_path", "/data",
        "--parallelism.disable_sequence_parallel", "--job.dump_folder", "out",
        "--profiling.profile_freq", "5", "--experimental.custom_import",
        "titan_hybrid.torchtitan_plugin", "--model.name=hybrid", "--hybrid.pattern", "M*-E"])
    registry = ConfigManager().parse_args([
        "--module", "titan_hybrid", "--config", "hybrid_moe", "--training.steps", "3",
        "--hybrid.flavor", "debug", "--validator.enable", "--validator.seq_len", "64",
        "--validator.dataloader.dataset_path", "/data",
        "--parallelism.no-enable_sequence_parallel", "--dump_folder", "out",
        "--profiler.profile_freq", "5", "--hybrid.pattern", "M*-E"])
    assert ours == registry
    assert (ours.training.steps, ours.hybrid.flavor, ours.validator.seq_len) == (3, "debug", 64)
    assert ours.validator.dataloader.dataset_path == "/data"
    assert not ours.parallelism.enable_sequence_parallel and ours.dump_folder == "out"
    assert ours.profiler.profile_freq == 5 and ours.hybrid.pattern == "M*-E"


def readme_run_train_command() -> list[str]:
    """The run_train.sh command for torchtitan 0.3 (docs/torchtitan_0_3.md, the README's until
    issue 48), continuation lines joined."""
    text = (REPO_ROOT / "docs" / "torchtitan_0_3.md").read_text().replace("\\\n", " ")
    lines = [line for line in text.splitlines()
             if line.startswith("TITAN_HYBRID_TORCHTITAN=0.3 ") and "./run_train.sh" in line]
    assert len(lines) == 1, lines
    return shlex.split(lines[0])


def run_train(tmp_path, *args: str, ngpu: int = 1, command: list[str] | None = None):
    """`./run_train.sh --job.config_file train_configs/hybrid.toml` with `args` under
    torchtitan 0.3, or `command` (the README's, its VAR=value words as the environment); the
    bootstrap picks this venv from TITAN_HYBRID_TORCH / TITAN_HYBRID_TORCHTITAN."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    env.update(TITAN_HYBRID_TORCH="2.14", TITAN_HYBRID_TORCHTITAN="0.3", NGPU=str(ngpu),
               OMP_NUM_THREADS="1")
    words = list(command or ["./run_train.sh", "--job.config_file", CONFIG])
    while "=" in words[0]:
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    return subprocess.run(
        [*words, *SMALL, "--job.dump_folder", str(tmp_path), "--hybrid.loss_curve_file",
         "curve.jsonl", *args],
        capture_output=True, text=True, timeout=600, cwd=REPO_ROOT, env=env)


def test_the_readmes_run_train_command_runs_under_0_3_with_the_one_process_curve(tmp_path):
    command = readme_run_train_command()
    assert "--parallelism.tensor_parallel_degree" in command and "NGPU=2" in command
    one = run_train(tmp_path / "one")
    assert one.returncode == 0, one.stderr[-3000:]
    tp2 = run_train(tmp_path / "tp2", command=command)  # as written, with a short run
    assert tp2.returncode == 0, tp2.stderr[-3000:]
    reference, layout = curve(tmp_path / "one" / "curve.jsonl"), curve(
        tmp_path / "tp2" / "curve.jsonl")
    assert [r["step"] for r in layout] == [1, 2, 3]
    for ours, theirs in zip(layout, reference, strict=True):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)


# The flags of the README and of docs/ (the README's alone until issue 48 split it).
README_FLAGS = sorted(set(re.findall(r"(?<![\w-])--([a-z_]+\.[a-z0-9_.]+)", "\n".join(
    path.read_text() for path in [REPO_ROOT / "README.md", *(REPO_ROOT / "docs").glob("*.md")])))
    - {"job.config_file"})
# A value for each flag the README shows with one (booleans are bare flags).
VALUES = {
    "activation_checkpoint.mode": "full", "activation_checkpoint.selective_ac_option": "op",
    "activation_checkpoint.layer_kinds": "*-",
    "checkpoint.async_mode": "async", "checkpoint.initial_load_path": str(REPO_ROOT),
    "checkpoint.load_step": "4", "compile.backend": "aot_eager", "debug.seed": "7",
    "hybrid.flavor": "debug_moe", "hybrid.loss_curve_file": "curve.jsonl",
    "hybrid.pattern": "M*G-", "hybrid.hc_mult": "4", "hybrid.m_layers": "gdp", "hybrid.g_layers": "gdn2", "hybrid.model_config": str(REPO_ROOT / "tests" / "torchtitan_0_3" / "hf_nemotron_h"), "job.dump_folder": "out",
    "model.flavor": "debug_moe", "model.converters": "quantize.linear.float8",
    "quantize.linear.float8.recipe_name": "rowwise", "quantize.converters": "quantize.linear.float8",
    "quantize.linear.float8.filter_fqns": "layers.0",
    "quantize.linear.mx.recipe_name": "mxfp8_emulated",
    "model.hf_assets_path": str(REPO_ROOT / "titan_hybrid" / "assets" / "pydoc_bpe"),
    "parallelism.context_parallel_degree": "2",
    "parallelism.context_parallel_linear_mode": "chunkwise",
    "parallelism.data_parallel_replicate_degree": "2",
    "parallelism.data_parallel_sharding_strategy": "optim",
    "parallelism.expert_parallel_degree": "2", "parallelism.expert_tensor_parallel_degree": "2",
    "parallelism.pipeline_parallel_degree": "2",
    "parallelism.pipeline_parallel_schedule": "Interleaved1F1B",
    "parallelism.tensor_parallel_degree": "2", "training.dataset": "pydoc",
    "training.dataset_path": str(REPO_ROOT / "train_configs"),
    "training.mixed_precision_param": "bfloat16", "training.steps": "5",
    "validation.dataset_path": str(REPO_ROOT / "train_configs"),
    # 0.2's ways of naming titan_hybrid in torchtitan's own job, which 0.3 needs no value for
    "experimental.custom_import": "titan_hybrid.torchtitan_plugin",
    "job.custom_config_module": "titan_hybrid.torchtitan_plugin", "model.name": "hybrid",
}
REFUSED_UNDER_0_3 = {"fault_tolerance.enable"}  # the README's example of a flag 0.3 has no use for


@pytest.mark.parametrize("flag", README_FLAGS)
def test_every_flag_the_readme_documents_works_under_0_3(flag):
    """Each `--section.field` the README shows (0.2's spelling, or 0.3's in 0.3's own
    commands) lands on the 0.3 field that means the same, through the launcher's parse."""
    from titan_hybrid.adapters.command_line import (
        NEGATED_UNDER_0_3,
        NOT_NEEDED_UNDER_0_3,
        RENAMED_UNDER_0_3,
    )
    from titan_hybrid.adapters.torchtitan_0_3.front_end import parse_job

    value = VALUES.get(flag)
    words = ["--job.config_file", CONFIG, f"--{flag}", *([value] if value else [])]
    if flag in REFUSED_UNDER_0_3:
        with pytest.raises(ValueError, match=f"{flag} has no meaning under torchtitan 0.3"):
            parse_job(words)
        return
    config = parse_job(words)
    if flag in NOT_NEEDED_UNDER_0_3:
        return
    target = config
    for part in NEGATED_UNDER_0_3.get(flag, RENAMED_UNDER_0_3.get(flag, flag)).split("."):
        target = getattr(target, part)
    if value is None:
        assert target is (flag not in NEGATED_UNDER_0_3)
    else:
        assert (str(target) == value or (isinstance(target, (list, tuple))
                                          and list(target) == value.split(","))
                or target == type(target)(value)), (target, value)

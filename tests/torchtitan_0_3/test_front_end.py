"""The TOML front end under torchtitan 0.3 (titan_hybrid/adapters/torchtitan_0_3/front_end.py):
`run_train.sh --job.config_file F --section.field value ...` takes the same job files and flags
as under 0.2, with the same one-line errors, and runs the same job as the config registry."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.torchtitan_0_3.test_adapter import SMALL, curve
from tests.unit.test_bad_inputs import BAD_INPUTS, CONFIG
from tests.launch import REPO_ROOT
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
    (("--model.converters", "float8"), "model.converters has no meaning under torchtitan 0.3"),
    (("--quantize.linear.float8.enable",), "quantize.linear.float8.enable has no meaning"),
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


def run_train(tmp_path, *args: str, ngpu: int):
    """`./run_train.sh` as the README gives it for torchtitan 0.3 (the bootstrap picks this
    venv from TITAN_HYBRID_TORCH / TITAN_HYBRID_TORCHTITAN)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    env.update(TITAN_HYBRID_TORCH="2.14", TITAN_HYBRID_TORCHTITAN="0.3", NGPU=str(ngpu),
               OMP_NUM_THREADS="1")
    return subprocess.run(
        ["./run_train.sh", "--job.config_file", CONFIG, *SMALL, "--job.dump_folder",
         str(tmp_path), "--hybrid.loss_curve_file", "curve.jsonl", *args],
        capture_output=True, text=True, timeout=600, cwd=REPO_ROOT, env=env)


def test_run_train_sh_runs_a_toml_job_under_0_3_and_tp2_gives_its_curve(tmp_path):
    one = run_train(tmp_path / "one", ngpu=1)
    assert one.returncode == 0, one.stderr[-3000:]
    tp2 = run_train(tmp_path / "tp2", "--parallelism.tensor_parallel_degree", "2",
                    "--parallelism.disable_sequence_parallel", ngpu=2)
    assert tp2.returncode == 0, tp2.stderr[-3000:]
    reference, layout = curve(tmp_path / "one" / "curve.jsonl"), curve(
        tmp_path / "tp2" / "curve.jsonl")
    assert [r["step"] for r in layout] == [1, 2, 3]
    for ours, theirs in zip(layout, reference):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=2e-6)
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=2e-5)

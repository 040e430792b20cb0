"""titan_hybrid under torchtitan 0.3 (its adapter, titan_hybrid/adapters/torchtitan_0_3): the
config registry, real torchrun runs of `python -m torchtitan.train --module titan_hybrid`, and
the same loss curve as under torchtitan 0.2.

Collected only in the torchtitan 0.3 venv (tests/conftest.py; CI's 0.3 leg:
TITAN_HYBRID_TORCH=2.14 TITAN_HYBRID_TORCHTITAN=0.3 ./run_tests.sh tests/torchtitan_0_3). The
0.2 reference run uses the default venv, which scripts/bootstrap.sh builds if it is missing.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from tests.launch import REPO_ROOT, torchrun, torchrun_module

TRAIN_CONFIGS = REPO_ROOT / "train_configs"
SMALL = ("--training.steps", "3", "--training.seq_len", "64")



def torchtitan_run(tmp_path, *args: str, nproc: int = 1, config: str = "hybrid",
                   fork_workers: bool = True):
    """`torchrun -m torchtitan.train --module titan_hybrid --config CONFIG ARGS`, its workers
    forked by the tests' fork server (tests/launch.py), or with fork_workers=False started by
    torchrun's own launcher (for what torchrun prints)."""
    return torchrun_module(
        "torchtitan.train", "--module", "titan_hybrid", "--config", config, "--dump_folder",
        str(tmp_path), *args, nproc=nproc, fork_workers=fork_workers, PYTHONUNBUFFERED="1")


def torchtitan_0_2_run(dump_folder, *args: str, config: str = "hybrid"):
    """The same job under torchtitan 0.2.2 (titan_hybrid's launcher, the default venv)."""
    # not this venv (CI's TITAN_HYBRID_VENV names it): the default one
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VIRTUAL_ENV", "PYTHON", "TITAN_HYBRID_VENV"))}
    env.update(TITAN_HYBRID_TORCH="2.13", TITAN_HYBRID_TORCHTITAN="0.2", OMP_NUM_THREADS="1")
    return subprocess.run(
        ["bash", "-c", 'source scripts/bootstrap.sh && exec python -m titan_hybrid.launch "$@"',
         "launch", "--job.config_file", str(TRAIN_CONFIGS / f"{config}.toml"), *args,
         "--job.dump_folder", str(dump_folder)],
        capture_output=True, text=True, timeout=900, cwd=REPO_ROOT, env=env)


def curve(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_toml_job_is_a_config_function_of_the_registry():
    import titan_hybrid.config_registry as registry
    from titan_hybrid.adapters.torchtitan_0_3.trainer import HybridTrainer

    stems = sorted(path.stem for path in TRAIN_CONFIGS.glob("*.toml"))
    assert sorted(set(registry.__all__) - {"model_spec", "HybridLoss", "HybridDataLoader"}) \
        == stems and len(stems) >= 4
    for stem in stems:
        config = getattr(registry, stem)()
        job = tomllib.loads((TRAIN_CONFIGS / f"{stem}.toml").read_text())
        assert isinstance(config, HybridTrainer.Config)
        assert config.hybrid.flavor == job["model"]["flavor"]
        assert config.training.seq_len == job["training"]["seq_len"]
        assert config.training.steps == job["training"]["steps"]
        assert config.dataloader.dataset == job["training"]["dataset"]
        assert config.optimizer.lr == job["optimizer"]["lr"]
        assert config.parallelism.spmd_backend == "partial_dtensor"


# layout: (config, the one-process reference's args, the 2-process layout's args). The
# reference takes the same global batch: 2 microbatches where the layout has 2 batch ranks.
TWO_BATCHES = ("--training.global_batch_size", "16")
PP2 = ("--parallelism.pipeline_parallel_degree", "2",
       "--parallelism.pipeline_parallel_microbatch_size", "2")
LAYOUTS = {
    "fsdp2": ("hybrid", TWO_BATCHES, ()),
    "tp2": ("hybrid", (), ("--parallelism.tensor_parallel_degree", "2")),
    "cp2-chunkwise-documents": (
        "hybrid", ("--hybrid.document_masking",),
        ("--hybrid.document_masking", "--parallelism.context_parallel_degree", "2",
         "--parallelism.context_parallel_linear_mode", "chunkwise")),
    "pp2-1f1b": ("hybrid", (), PP2),
    "pp2-interleaved": ("hybrid", (), (
        *PP2, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B")),  # 2 stages a rank
    # the MoE job's aux and MTP losses on the last stage (`|` splits its 5 layers). Its
    # load-balancing loss is one per microbatch: the reference accumulates 4 microbatches of 2.
    "pp2-moe": ("hybrid_moe", ("--hybrid.pattern", "M*E|ME/*-", "--training.local_batch_size",
                               "2", "--training.global_batch_size", "8"),
                (*PP2, "--training.local_batch_size", "8")),
    "hsdp-2x1": ("hybrid", TWO_BATCHES, ("--parallelism.data_parallel_replicate_degree", "2")),
    "zero1": ("hybrid", TWO_BATCHES, ("--parallelism.data_parallel_sharding_strategy", "optim")),
    "ep2-moe": ("hybrid_moe", TWO_BATCHES, ("--parallelism.expert_parallel_degree", "2")),
    # each rank's 2 microbatches: the second's forward runs with the first's backward
    "ep2-overlap-moe": ("hybrid_moe", (*TWO_BATCHES, "--training.local_batch_size", "4"), (
        "--parallelism.expert_parallel_degree", "2", "--parallelism.expert_parallel_overlap",
        "--training.local_batch_size", "4")),
}
LOGGED = {"ep2-overlap-moe": "EP-overlap: combined 1F1B over the step's 2 microbatches"}
_references: dict = {}


def one_process_curve(tmp_path_factory, config: str, args: tuple[str, ...]) -> list[dict]:
    """The one-process run's curve, run once per (config, args) in a session."""
    if (config, args) not in _references:
        folder = tmp_path_factory.mktemp("one")
        one = torchtitan_run(folder, *args, config=config)
        assert one.returncode == 0, one.stderr[-3000:]
        _references[config, args] = curve(folder / "curve.jsonl")
    return _references[config, args]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_process_layouts_give_the_one_process_curve(tmp_path, tmp_path_factory, layout):
    config, reference_args, layout_args = LAYOUTS[layout]
    job = (*SMALL, "--hybrid.loss_curve_file", "curve.jsonl")
    one_curve = one_process_curve(tmp_path_factory, config, (*job, *reference_args))
    two = torchtitan_run(tmp_path, *job, *reference_args, *layout_args, nproc=2,
                         config=config)
    assert two.returncode == 0, two.stderr[-3000:]
    assert LOGGED.get(layout, "") in two.stdout + two.stderr
    two_curve = curve(tmp_path / "curve.jsonl")
    assert [r["step"] for r in one_curve] == [1, 2, 3]
    for a, b in zip(one_curve, two_curve, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    assert one_curve[-1]["loss"] < one_curve[0]["loss"]


def test_the_moe_job_gives_the_torchtitan_0_2_curve(tmp_path):
    """The same job under both torchtitan generations (and their torch: the 0.2 reference runs
    in the default venv): the training losses are the same; the validation losses too, to
    float32 rounding (the two torch builds' matmuls round differently)."""
    job = (*SMALL, "--hybrid.loss_curve_file", "curve.jsonl")
    ours = torchtitan_run(tmp_path / "v03", *job, "--validator.enable", "--validator.freq",
                          "2", "--validator.steps", "1", "--validator.seq_len", "64",
                          config="hybrid_moe")
    assert ours.returncode == 0, ours.stderr[-3000:]
    reference = torchtitan_0_2_run(
        tmp_path / "v02", *job, "--validation.enable", "--validation.freq", "2",
        "--validation.steps", "1", "--validation.seq_len", "64", config="hybrid_moe")
    assert reference.returncode == 0, reference.stderr[-3000:]
    theirs = curve(tmp_path / "v02" / "curve.jsonl")
    mine = curve(tmp_path / "v03" / "curve.jsonl")
    assert [sorted(r) for r in mine] == [sorted(r) for r in theirs] and len(mine) == 5
    for a, b in zip(theirs, mine, strict=True):
        for key, value in a.items():
            assert b[key] == pytest.approx(value, rel=1e-6), (a["step"], key)


@pytest.mark.parametrize("args, message", [
    (("--hybrid.pattern", "MX"), "error: hybrid pattern 'MX'"),
    (("--hybrid.flavor", "nope"), "error: model.flavor 'nope' is not a hybrid flavor"),
    (("--parallelism.context_parallel_linear_mode", "ring"),
     "error: parallelism.context_parallel_linear_mode='ring': must be one of"),
    (("--training.steps", "0"), "error: training.steps=0 must be >= 1"),
    (("--parallelism.spmd_backend", "spmd_types"),
     "error: parallelism.spmd_backend='spmd_types' must be 'partial_dtensor'"),
    (("--checkpoint.enable", "--checkpoint.keep_latest_k", "1"),
     "error: checkpoint.keep_latest_k=1 must be 0 (keep all) or >= 2"),
])
def test_a_bad_value_is_one_line_before_any_process_group(tmp_path, args, message):
    result = torchtitan_run(tmp_path, *args)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr.split(message)[0][-2000:]
    assert "Building device mesh" not in result.stdout + result.stderr


@pytest.mark.parametrize("writer", ["0.2", "0.3"])
def test_a_checkpoint_resumes_under_the_other_torchtitan(tmp_path, writer):
    """Four steps with a checkpoint at step 2, written under one torchtitan (0.3: in the
    background); its step 4 is removed, and the other torchtitan resumes from step 2: steps 3
    and 4 are the first run's."""
    job = ("--training.steps", "4", "--training.seq_len", "64", "--checkpoint.enable",
           "--checkpoint.interval", "2", "--hybrid.loss_curve_file", "curve.jsonl")
    # (under 0.3 the writer saves in the background, titan_hybrid's async mode)
    writes = ("--checkpoint.async_mode", "async") if writer == "0.3" else ()
    runs = {"0.2": lambda: torchtitan_0_2_run(tmp_path, *job),
            "0.3": lambda: torchtitan_run(tmp_path, *job, *writes)}
    first = runs[writer]()
    assert first.returncode == 0, first.stderr[-3000:]
    written = curve(tmp_path / "curve.jsonl")
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-2", "step-4"]
    shutil.rmtree(tmp_path / "checkpoint" / "step-4")
    resumed = runs["0.3" if writer == "0.2" else "0.2"]()
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step-2" in resumed.stdout + resumed.stderr  # it loaded the other's checkpoint
    again = curve(tmp_path / "curve.jsonl")
    assert [r["step"] for r in again] == [1, 2, 3, 4]
    for a, b in zip(written[2:], again[2:], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6), a["step"]


def readme_registry() -> str:
    """The user registry docs/torchtitan_0_3.md shows (the README until issue 48; the Python
    block that defines hybrid_in_my_job)."""
    blocks = (REPO_ROOT / "docs" / "torchtitan_0_3.md").read_text().split("```python\n")[1:]
    found = [block.split("```")[0] for block in blocks if "def hybrid_in_my_job" in block]
    assert len(found) == 1
    return found[0]


def readme_user_command() -> list[str]:
    """docs/torchtitan_0_3.md's command for that registry, continuation lines joined."""
    text = (REPO_ROOT / "docs" / "torchtitan_0_3.md").read_text().replace("\\\n", " ")
    lines = [line for line in text.splitlines() if "--module my_registry" in line]
    assert len(lines) == 1 and lines[0].startswith("torchrun "), lines
    return shlex.split(lines[0])


def user_job_run(tmp_path, *args: str, nproc: int = 1, command: list[str] | None = None,
                 registry: str | None = None, fork_workers: bool = True):
    """The README's registry (or `registry`, its source) under torchrun: `command` (the
    README's own, run by torchrun's launcher) or `nproc` processes with `args` (forked by the
    tests' fork server unless fork_workers=False)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "my_registry.py").write_text(registry or readme_registry())
    dump = ("--dump_folder", str(tmp_path / "out"))
    if command is not None:
        return torchrun(*command[1:], *dump, *args, PYTHONPATH=str(tmp_path))
    return torchrun_module("torchtitan.train", "--module", "my_registry", "--config",
                           "hybrid_in_my_job", *dump, *args, nproc=nproc,
                           fork_workers=fork_workers, PYTHONPATH=str(tmp_path))


def logged_losses(output: str) -> list[float]:
    """rank 0's console losses, in step order (torchtitan's metrics, 5 decimals)."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", output)
    by_step = {}
    for step, loss in re.findall(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)", plain):
        by_step.setdefault(int(step), float(loss))
    return [by_step[step] for step in sorted(by_step)]


@pytest.mark.slow  # 4 processes
def test_ep2_with_tp2_and_fsdp2_gives_the_one_process_curve(tmp_path, tmp_path_factory):
    """0.3's EP borrows TP ranks; titan_hybrid's experts keep their TP split (expert TP = TP)
    and take EP from the data-parallel ranks, as under 0.2 (parallelize.expert_meshes)."""
    job = (*SMALL, "--hybrid.loss_curve_file", "curve.jsonl", *TWO_BATCHES)
    one_curve = one_process_curve(tmp_path_factory, "hybrid_moe", job)
    four = torchtitan_run(tmp_path, *job, "--parallelism.tensor_parallel_degree", "2",
                          "--parallelism.expert_parallel_degree", "2",
                          "--parallelism.expert_tensor_parallel_degree", "2", nproc=4,
                          config="hybrid_moe")
    assert four.returncode == 0, four.stderr[-3000:]
    assert "Applied expert parallel over 2 ranks" in four.stdout + four.stderr
    for a, b in zip(one_curve, curve(tmp_path / "curve.jsonl"), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["moe/max_expert_load"] == a["moe/max_expert_load"]

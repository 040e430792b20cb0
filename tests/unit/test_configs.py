"""Every shipped job config parses, names a real flavor, and builds its model on meta."""

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torchtitan.config import ConfigManager
from torchtitan.distributed import ParallelDims

import titan_hybrid.torchtitan_plugin  # noqa: F401  (TrainSpec, dataset; CPU runtime)
from tests.run_configs import run_from_args
from titan_hybrid.adapters.torchtitan_0_2.job_config import parse_job, run_config
from titan_hybrid.config.sections import HybridSection
from titan_hybrid.model.args import hybrid_flavors
from titan_hybrid.model.model import HybridModel
from titan_hybrid.parallel.parallelize import ParallelizeJob, parallelize_hybrid
from titan_hybrid.parallel.validate import LayoutJob, validate_layout

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "train_configs").glob("*.toml"))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_parses_and_model_builds_on_meta(config):
    job = parse_job(["--job.config_file", str(config)])
    run = run_config(job)
    assert run.flavor == job.model.flavor and run.model is not hybrid_flavors[run.flavor]
    assert run.model.max_seq_len == job.training.seq_len == run.training.seq_len
    with torch.device("meta"):
        model = HybridModel(run.model)
    nparams, flops = run.model.get_nparams_and_flops(model, run.training.seq_len)
    assert nparams == sum(p.numel() for p in model.parameters()) and flops > 0


def test_gpu_flavor_is_about_one_billion_non_embedding_parameters():
    args = hybrid_flavors["nemotron_h_1b"]
    with torch.device("meta"):
        model = HybridModel(args)
    embedding = model.tok_embeddings.weight.numel() + model.output.weight.numel()
    non_embedding = sum(p.numel() for p in model.parameters()) - embedding
    assert 0.8e9 < non_embedding < 1.1e9
    _, flops = args.get_nparams_and_flops(model, 4096)
    assert flops > 6 * (non_embedding + model.output.weight.numel())  # 6N plus the cores


def test_cli_pattern_seed_and_seq_len_resolve_into_the_runs_own_model_args():
    config = [c for c in CONFIGS if c.name == "hybrid.toml"][0]
    run = run_config(parse_job(["--job.config_file", str(config), "--hybrid.pattern", "M[M*]-",
                                "--debug.seed", "7", "--training.seq_len", "96"]))
    assert (run.model.pattern, run.model.init_seed, run.model.max_seq_len) == ("M[M*]-", 7, 96)
    flavor = hybrid_flavors["debug"]
    assert (flavor.pattern, flavor.max_seq_len) != ("M[M*]-", 96)  # the flavor is untouched
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.training.seq_len = 1  # the sections are immutable


def test_a_plain_torchtitan_job_gets_titan_hybrids_fields_at_their_defaults():
    from torchtitan.config import JobConfig as TitanJobConfig

    plain = ConfigManager().parse_args(["--training.steps", "7", "--model.name", "hybrid",
                                        "--model.flavor", "debug",
                                        "--parallelism.tensor_parallel_degree", "2"])
    assert type(plain) is TitanJobConfig and not hasattr(plain, "hybrid")
    run = run_config(plain)
    assert run.training.steps == 7 and run.parallelism.tensor_parallel_degree == 2
    assert run.hybrid == HybridSection()
    assert run.parallelism.context_parallel_linear_mode == "head_a2a"  # titan_hybrid's default
    assert run.model.pattern == hybrid_flavors["debug"].pattern


@pytest.mark.parametrize("args, message", [
    (("--model.name", "llama3"), "model.name='llama3' is not 'hybrid'"),
    (("--model.flavor", "nope"), "model.flavor 'nope' is not a hybrid flavor"),
    (("--fault_tolerance.enable",), "fault_tolerance.enable=True is not supported"),
    (("--hybrid.pattern", "MX"), "'X'"),
])
def test_a_job_titan_hybrid_cannot_run_is_refused_while_mapping(args, message):
    config = [c for c in CONFIGS if c.name == "hybrid.toml"][0]
    with pytest.raises(ValueError, match=message):
        run_config(parse_job(["--job.config_file", str(config), *args]))


def test_the_layers_below_training_read_only_the_sections_they_declare():
    """parallel/ takes what it reads of a run (its Protocols), not titan_hybrid's RunConfig:
    objects holding just those sections give the same results."""
    def only(run, protocol):
        return SimpleNamespace(**{name: getattr(run, name) for name in protocol.__annotations__})

    run = run_from_args("--parallelism.tensor_parallel_degree", "2",
                        "--activation_checkpoint.mode", "full")
    assert validate_layout(only(run, LayoutJob), 4) == validate_layout(run, 4) == 2
    with torch.device("meta"):
        model = HybridModel(run.model)
    one_process = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1,
                               world_size=1)
    plan = parallelize_hybrid(model, one_process, only(run, ParallelizeJob))
    assert plan.layouts and all(type(layer).__name__ == "CheckpointWrapper"
                                for layer in model.layers.values())

"""Every shipped job config parses, names a real flavor, and builds its model on meta."""

import copy
from pathlib import Path

import pytest
import torch
from torchtitan.config import ConfigManager

import titan_hybrid.torchtitan_plugin  # noqa: F401  (TrainSpec, dataset; CPU runtime)
from titan_hybrid.model.args import hybrid_flavors
from titan_hybrid.model.model import HybridModel

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "train_configs").glob("*.toml"))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_parses_and_model_builds_on_meta(config):
    job = ConfigManager().parse_args(["--job.config_file", str(config)])
    assert job.model.name == "hybrid"
    args = copy.deepcopy(hybrid_flavors[job.model.flavor])
    args.update_from_config(job)
    with torch.device("meta"):
        model = HybridModel(args)
    nparams, flops = args.get_nparams_and_flops(model, job.training.seq_len)
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


def test_cli_pattern_overrides_the_flavor():
    config = [c for c in CONFIGS if c.name == "hybrid.toml"][0]
    job = ConfigManager().parse_args(["--job.config_file", str(config),
                                      "--hybrid.pattern", "M[M*]-"])
    args = copy.deepcopy(hybrid_flavors[job.model.flavor])
    args.update_from_config(job)
    assert args.pattern == "M[M*]-"


def test_a_plain_torchtitan_job_gets_titan_hybrids_fields_at_their_defaults():
    from torchtitan.config import JobConfig as TitanJobConfig

    from titan_hybrid.job_config import JobConfig, hybrid_job

    plain = ConfigManager().parse_args(["--training.steps", "7",
                                        "--parallelism.tensor_parallel_degree", "2"])
    assert type(plain) is TitanJobConfig
    extended = hybrid_job(plain)
    assert isinstance(extended, JobConfig) and hybrid_job(extended) is extended
    assert extended.training is plain.training and extended.training.steps == 7
    assert extended.parallelism.tensor_parallel_degree == 2
    assert extended.parallelism.data_parallel_sharding_strategy == "optim_grads_params"
    assert extended.hybrid.pattern == "" and not extended.hybrid.document_masking
    # torchtitan's own default survives for a torchtitan job (titan_hybrid's is False).
    assert extended.checkpoint.last_save_model_only is plain.checkpoint.last_save_model_only

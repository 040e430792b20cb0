"""The validator in one process (a tiny model, no process group) and its config checks."""

import contextlib
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.distributed import ParallelDims

import titan_hybrid.torchtitan_plugin  # noqa: F401  (TrainSpec, dataset; CPU runtime)
from tests.run_configs import run_from_args
from titan_hybrid.data.corpus import TOKENIZER_DIR, pydoc_split
from titan_hybrid.data.loader import validation_dataset_name
from titan_hybrid.model.args import HybridModelArgs, MoEArgs
from titan_hybrid.model.model import HybridLayer
from titan_hybrid.model.moe import KIND as MOE_KIND
from titan_hybrid.runtime.errors import JobError
from titan_hybrid.training.metrics import drop_records_from, loss_curve_path, perplexity
from titan_hybrid.training.validation import (
    HybridValidator,
    next_token_loss_sum,
    validate_validation_config,
)

VOCAB, DIM = 2048, 8


def job(*args: str):
    return run_from_args("--training.dataset", "pydoc", "--validation.enable",
                         "--validation.seq_len", "32", "--validation.local_batch_size", "2",
                         *args, config_file=None)


class TinyMoELM(nn.Module):
    """Returns (logits, aux_loss, mtp_logits) like a MoE + MTP HybridModel."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        args = HybridModelArgs(dim=DIM, moe=MoEArgs(num_experts=4, top_k=2, hidden_dim=16))
        self.layer = HybridLayer(MOE_KIND.symbol, args)  # the statistics are found by kind
        self.layer.init_weights(init_std=0.5, out_std=0.5)
        self.head = nn.Linear(DIM, VOCAB)
        self.seen_training_mode = []

    @property
    def moe(self) -> nn.Module:
        return self.layer.mixer

    def forward(self, tokens):
        self.seen_training_mode.append(self.training)
        h, aux = self.layer(self.embed(tokens), torch.zeros(()), None)
        logits = self.head(h)
        return logits, aux + 100.0, logits.flip(-1)


class Recorder:
    ntokens_since_last_log = 0

    def __init__(self):
        self.logged = []

    def log_validation(self, loss, step, extra_metrics=None):
        self.logged.append((step, loss))


def make_validator(run, metrics):
    return HybridValidator(
        run=run, dp_world_size=1, dp_rank=0,
        tokenizer=HuggingFaceTokenizer(tokenizer_path=str(TOKENIZER_DIR)),
        parallel_dims=ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1,
                                   world_size=1),
        validation_context=contextlib.nullcontext, maybe_enable_amp=contextlib.nullcontext(),
        metrics_processor=metrics)


def test_validation_loss_is_the_main_heads_token_mean_over_the_same_windows():
    model, metrics = TinyMoELM(), Recorder()
    validator = make_validator(job("--validation.steps", "3"), metrics)
    routed_before = model.moe.routed_tokens.clone()
    validator.validate([model], step=1)
    validator.validate([model], step=2)
    # The same windows each pass: equal values; the model is back in training mode and the
    # router statistics of the training steps are untouched.
    (_, first), (_, second) = metrics.logged
    assert first == second
    assert model.training and not any(model.seen_training_mode)
    assert torch.equal(model.moe.routed_tokens, routed_before)
    # Reference: main-head cross-entropy over the first 3 batches of 2 held-out windows,
    # read straight from the held-out documents (aux loss and MTP logits are not in it).
    tokenizer = HuggingFaceTokenizer(tokenizer_path=str(TOKENIZER_DIR))
    stream = [t for doc in pydoc_split("validation")
              for t in tokenizer.encode(doc, add_bos=True, add_eos=True)]
    windows = torch.tensor([stream[i * 33:(i + 1) * 33] for i in range(6)])
    with torch.no_grad():
        model.eval()
        logits = model(windows[:, :-1])[0]
    expected = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()
    assert first == pytest.approx(expected, rel=1e-6)


def test_all_windows_with_steps_minus_one_and_a_too_small_set_is_a_user_error():
    metrics = Recorder()
    validator = make_validator(job("--validation.seq_len", "512"), metrics)
    validator.validate([TinyMoELM()], step=1)
    tokenizer = HuggingFaceTokenizer(tokenizer_path=str(TOKENIZER_DIR))
    tokens = sum(len(tokenizer.encode(d, add_bos=True, add_eos=True))
                 for d in pydoc_split("validation"))
    assert metrics.ntokens_since_last_log == (tokens // 513 // 2) * 2 * 512
    with pytest.raises(JobError, match=r"validation.local_batch_size\(2\)"):
        make_validator(job("--validation.seq_len", "8192", "--training.seq_len", "8192"),
                       metrics)


def test_next_token_loss_sum_reads_the_main_head_only():
    logits, labels = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    plain = next_token_loss_sum(logits, labels)
    assert torch.equal(next_token_loss_sum((logits, torch.tensor(3.0), -logits), labels), plain)
    assert plain.item() == pytest.approx(F.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                                         reduction="sum").item())


@pytest.mark.parametrize("args, message", [
    (("--validation.freq", "0"), "validation.freq=0 must be >= 1"),
    (("--validation.local_batch_size", "0"), "validation.local_batch_size=0 must be >= 1"),
    (("--validation.seq_len", "0"), "validation.seq_len=0 must be >= 1"),
    (("--validation.dataset", "nope"), "validation.dataset 'nope' is unknown"),
    (("--validation.seq_len", "33", "--parallelism.tensor_parallel_degree", "2"),
     r"validation.seq_len=33 is not divisible by 2 = tensor_parallel_degree\(2\)"),
    (("--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2",
      "--validation.seq_len", "36"),
     r"validation.seq_len=36 is not divisible by 8 = 2 \* context_parallel_degree\(2\) \* "
     r"tensor_parallel_degree\(2\)"),
    (("--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4",
      "--validation.local_batch_size", "6"),
     "validation.local_batch_size=6 is not divisible by the pipeline's 4 microbatches"),
])
def test_bad_validation_fields_are_user_errors(args, message):
    with pytest.raises(ValueError, match=message):
        validate_validation_config(job(*args))


def test_good_and_disabled_validation_configs_pass():
    validate_validation_config(job())
    validate_validation_config(job("--parallelism.tensor_parallel_degree", "2",
                                   "--parallelism.pipeline_parallel_degree", "2",
                                   "--training.local_batch_size", "2"))
    config = job()
    # torchtitan's own parse refuses it, a TOML edit may not
    config = dataclasses.replace(config, validation=dataclasses.replace(config.validation,
                                                                        steps=0))
    with pytest.raises(ValueError, match="validation.steps=0 must be -1"):
        validate_validation_config(config)
    validate_validation_config(dataclasses.replace(
        config, validation=dataclasses.replace(config.validation, enable=False)))


def test_validation_dataset_rule():
    def validation_dataset_of(run):
        return validation_dataset_name(run.validation, run.data)

    assert validation_dataset_of(job()) == "pydoc"  # torchtitan's default under pydoc
    assert validation_dataset_of(job("--validation.dataset", "c4_test")) == "c4_test"
    assert validation_dataset_of(job("--validation.dataset_path", "/data/c4")) == "c4_validation"
    assert validation_dataset_of(job("--training.dataset", "c4_test")) == "c4_validation"


def test_loss_curve_path_and_resumed_rewrite(tmp_path):
    config = job("--job.dump_folder", str(tmp_path), "--hybrid.loss_curve_file", "c/curve.jsonl")
    assert loss_curve_path(config) == tmp_path / "c" / "curve.jsonl"

    def curve_file(path):
        return dataclasses.replace(config, hybrid=dataclasses.replace(config.hybrid,
                                                                      loss_curve_file=path))

    assert loss_curve_path(curve_file(str(tmp_path / "abs.jsonl"))) == tmp_path / "abs.jsonl"
    assert loss_curve_path(curve_file("")) is None
    curve = tmp_path / "curve.jsonl"
    curve.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n'
                     '{"step": 2, "validation_loss": 1.7}\n{"step": 3, "loss": 1.0}\n{"step": 4,')
    drop_records_from(curve, 2)
    assert curve.read_text() == '{"step": 1, "loss": 2.0}\n'
    assert perplexity(0.0) == 1.0 and perplexity(math.log(7.0)) == pytest.approx(7.0)
    assert perplexity(1e4) == math.inf

"""Every user error in a job: one short message naming the field, a non-zero exit, no traceback,
and no worker started (the launcher's pre-flight, run in this process as `run_train.sh` runs it
in its own)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from tests.launch import REPO_ROOT
from titan_hybrid import launch

CONFIG = str(REPO_ROOT / "train_configs" / "hybrid.toml")

BAD_INPUTS = [
    (("--training.steps", "-1"), "training.steps=-1 must be >= 1"),
    (("--training.steps", "0"), "training.steps=0 must be >= 1"),
    (("--training.local_batch_size", "0"), "training.local_batch_size=0 must be >= 1"),
    (("--training.seq_len", "0"), "training.seq_len=0 must be >= 1"),
    (("--training.global_batch_size", "12"),
     "training.global_batch_size=12 must be a multiple of local_batch_size(8)"),
    (("--training.max_norm", "0"), "training.max_norm=0.0 must be a finite number > 0"),
    (("--optimizer.lr", "-0.1"), "optimizer.lr=-0.1 must be a finite number >= 0"),
    (("--optimizer.lr", "nan"), "optimizer.lr=nan must be a finite number >= 0"),
    (("--optimizer.name", "SGD"), "optimizer.name='SGD': must be one of AdamW, Adam"),
    # an enumerated option's typo names its values, whichever torchtitan declares the field
    (("--optimizer.implementation", "fusd"),
     "optimizer.implementation='fusd': must be one of for-loop, foreach, fused"),
    (("--activation_checkpoint.mode", "partial"),
     "activation_checkpoint.mode='partial': must be one of selective, full, memory_budget, none"),
    (("--lr_scheduler.decay_type", "cosin"),
     "lr_scheduler.decay_type='cosin': must be one of linear, sqrt, cosine"),
    (("--checkpoint.enable", "--checkpoint.async_mode", "asnyc"),
     "checkpoint.async_mode='asnyc': must be one of disabled, async, async_with_pinned_mem"),
    (("--parallelism.fsdp_reshard_after_forward", "nevr"),
     "parallelism.fsdp_reshard_after_forward='nevr': must be one of default, always, never"),
    (("--parallelism.fsdp_reshard_after_forward", "never"),
     "parallelism.fsdp_reshard_after_forward='never' is not supported: titan_hybrid reshards as "
     "parallelism.data_parallel_sharding_strategy says"),
    # unused (the converters name none), and an optional Literal (tyro lists its values as a set)
    (("--quantize.linear.float8.recipe_name", "rowwize"),
     "quantize.linear.float8.recipe_name='rowwize': must be one of "),
    # the model's variants (model/layer_kinds.VARIANTS), which HybridModelArgs checks
    (("--hybrid.m_layers", "mamba9"), "m_layers='mamba9' is not one of ['mamba2', 'gdp'"),
    (("--hybrid.g_layers", "gdn3"), "g_layers='gdn3' is not one of ['gdn', 'gdn2'"),
    (("--optimizer.beta2", "1.5"), "optimizer.beta2=1.5 must be in [0, 1)"),
    (("--lr_scheduler.warmup_steps", "-2"), "lr_scheduler.warmup_steps=-2 must be >= 0"),
    (("--lr_scheduler.decay_ratio", "1.5"), "lr_scheduler.decay_ratio=1.5 must be in [0, 1]"),
    (("--checkpoint.enable", "--checkpoint.interval", "0"),
     "checkpoint.interval=0 must be >= 1"),
    (("--checkpoint.enable", "--checkpoint.keep_latest_k", "1"),
     "checkpoint.keep_latest_k=1 must be 0 (keep all) or >= 2"),
    (("--checkpoint.enable", "--checkpoint.async_mode", "async_with_pinned_mem"),
     "checkpoint.async_mode='async_with_pinned_mem' needs CUDA"),
    (("--checkpoint.enable", "--checkpoint.initial_load_path", "/no/such/ckpt"),
     "checkpoint.initial_load_path='/no/such/ckpt' is not a directory"),
    (("--metrics.log_freq", "0"), "metrics.log_freq=0 must be >= 1"),
    (("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option",
      "half"), "activation_checkpoint.selective_ac_option 'half' must be 'op' or a positive"),
    (("--activation_checkpoint.mode", "memory_budget"),
     "activation_checkpoint.mode 'memory_budget' needs compile.enable"),
    (("--activation_checkpoint.mode", "full", "--activation_checkpoint.layer_kinds", "KE"),
     "activation_checkpoint.layer_kinds 'KE': the pattern's main part has none of these kinds"),
    (("--optimizer.early_step_in_backward",),
     "optimizer.early_step_in_backward=True is not supported"),
    (("--job.custom_config_module", "titan_hybrid.job_config"),
     "job.custom_config_module 'titan_hybrid.job_config' cannot be imported"),
    (("--checkpoint.create_seed_checkpoint",),
     "checkpoint.create_seed_checkpoint=True needs checkpoint.enable"),
    (("--fault_tolerance.enable",), "fault_tolerance.enable=True is not supported"),
    (("--model.name", "llama3"), "model.name='llama3' is not 'hybrid'"),
    (("--validation.enable", "--validation.freq", "0"), "validation.freq"),
    (("--validation.enable", "--validation.steps", "0"), "validation steps must be positive"),
    (("--hybrid.pattern", "M[*"), "hybrid pattern 'M[*'"),
    (("--hybrid.pattern", "M*-/D-"), "'D' at position 4 cannot share a model with '*' at "
                                    "position 1"),
    (("--model.flavor", "nope"), "model.flavor 'nope' is not a hybrid flavor"),
    (("--parallelism.context_parallel_linear_mode", "ring"),
     "parallelism.context_parallel_linear_mode='ring': must be one of head_a2a, chunkwise"),
    (("--model.hf_assets_path", "/nowhere"), "model.hf_assets_path '/nowhere' holds no"),
    (("--training.dataset", "nope"), "training.dataset 'nope' is unknown"),
    (("--training.dataset", "c4_test", "--training.dataset_path", "/no/such/dir"),
     "training.dataset_path '/no/such/dir' does not exist"),
    (("--nproc", "2", "--parallelism.tensor_parallel_degree", "3"),
     "parallelism: tensor_parallel_degree=3 need a multiple of 3 processes (their product), "
     "but the world size is 2"),
    (("--nproc", "2", "--parallelism.pipeline_parallel_degree", "2", "--hybrid.pattern", "M-*"),
     "3 physical layers cannot be split evenly into 2 pipeline stages"),
    (("--nproc", "2", "--parallelism.context_parallel_degree", "2", "--training.seq_len", "254"),
     "training.seq_len=254 is not divisible by 4 = 2 * context_parallel_degree(2)"),
    (("--nproc", "2", "--parallelism.data_parallel_shard_degree", "3"),
     "world size 2 != data_parallel_replicate_degree(1) * data_parallel_shard_degree(3)"),
    (("--nproc", "2", "--parallelism.data_parallel_replicate_degree", "3"),
     "parallelism: data_parallel_replicate_degree=3 need a multiple of 3 processes"),
    (("--parallelism.data_parallel_sharding_strategy", "zero9"),
     "parallelism.data_parallel_sharding_strategy='zero9': must be one of no_shard, optim, "
     "optim_grads, optim_grads_params"),
    (("--nproc", "0"), "--nproc (NGPU)=0 must be >= 1"),
    (("--compile.enable", "--compile.components", "model,optimizer"),
     "compile.components ['optimizer']"),
    # (float8 GEMMs without a GPU that has them: the case after the list)
    (("--model.converters", "quantize.linear.float8",
      "--quantize.linear.float8.recipe_name", "rowwise", "--quantize.linear.float8.emulate",
      "--quantize.linear.float8.enable_fsdp_float8_all_gather"),
     "enable_fsdp_float8_all_gather needs tensorwise scaling"),
    (("--nproc", "2", "--parallelism.pipeline_parallel_degree", "2",
      "--model.converters", "quantize.fp4"), "model.converters ['quantize.fp4']"),
    (("--model.converters", "quantize.linear.mx", "--quantize.linear.mx.recipe_name",
      "mxfp8_emulated", "--training.seq_len", "48"),
     "training.seq_len=48 gives 48 tokens a row on each context-parallel rank, and MXFP8"),
    (("--model.converters", "quantize.linear.mx", "--quantize.linear.mx.recipe_name", "nvfp4"),
     "quantize.linear.mx.recipe_name='nvfp4': must be one of mxfp8_cublas, "
     "mxfp8_cublas_rceil, mxfp8_emulated, mxfp8_emulated_rceil"),
]


if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
    BAD_INPUTS.append((("--model.converters", "quantize.linear.float8"),
                       "quantize.linear.float8: float8 GEMMs need a GPU of compute capability "
                       "8.9 or later (Ada, Hopper, Blackwell); set "
                       "quantize.linear.float8.emulate"))
if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (10, 0):
    BAD_INPUTS.append((("--model.converters", "quantize.linear.mx"),
                       "model.converters 'quantize.linear.mx': MXFP8 needs a Blackwell GPU"))
if not torch.cuda.is_available():
    BAD_INPUTS.append((("--model.converters", "quantize.linear.mx", "--compile.enable",
                        "--quantize.linear.mx.recipe_name", "mxfp8_emulated"),
                       "compile.enable=True with MXFP8 (quantize.linear.mx) needs a GPU"))


@pytest.mark.parametrize("args, message", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_gets_one_line_naming_the_field(args, message, capsys, monkeypatch):
    def no_workers(*_):
        raise AssertionError("a worker was started for a bad job")

    monkeypatch.setattr(launch, "run_workers", no_workers)
    code = launch.main(["--job.config_file", CONFIG, *args])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert err.startswith("error: ") and err.count("\n") == 1, err  # one line
    assert "Traceback" not in err


# (tests/torchtitan_0_3/test_front_end.py runs the tests below under torchtitan 0.3 too)
@pytest.mark.parametrize("content, message", [
    ("[training\nsteps = 3\n", "job.config_file 'TMP/bad.toml' is not valid TOML: "),
    (None, "job.config_file '/no/such.toml' does not exist"),
])
def test_unreadable_config_file(tmp_path, content, message, capsys):
    path = "/no/such.toml"
    if content is not None:
        path = str(tmp_path / "bad.toml")
        (tmp_path / "bad.toml").write_text(content)
    assert launch.main(["--job.config_file", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: " + message.replace("TMP", str(tmp_path)))
    assert err.count("\n") == 1 and "Traceback" not in err, err


TYPO_IN_TOML = """
[model]
name = "hybrid"
flavor = "debug"
[optimizer]
implementation = "fusd"
"""


def test_a_typo_in_the_toml_is_one_line_naming_the_values(tmp_path, capsys):
    """A TOML value reaches the job without the command line's check (tyro only warns about
    it): the RunConfig's check refuses it."""
    (tmp_path / "job.toml").write_text(TYPO_IN_TOML)
    assert launch.main(["--job.config_file", str(tmp_path / "job.toml")]) == 2
    err = capsys.readouterr().err
    assert err == ("error: optimizer.implementation='fusd': must be one of for-loop, foreach, "
                   "fused\n"), err


def test_a_flag_that_replaces_a_toml_typo_is_taken_without_a_word(tmp_path, capsys):
    from titan_hybrid.adapters.installed import front_end

    (tmp_path / "job.toml").write_text(TYPO_IN_TOML)
    job = front_end.parse_job(["--job.config_file", str(tmp_path / "job.toml"),
                               "--optimizer.implementation", "foreach"])
    assert front_end.run_config(job).optimizer.implementation == "foreach"
    assert "fusd" not in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (("--training.stepz", "3"), "error: unknown flag: --training.stepz (did you mean "
                                "--training.steps?)"),
    (("--training.steps", "abc"), "error: Error parsing --training.steps: invalid literal"),
])
def test_what_the_parser_refuses_is_one_line_too(args, message, capsys):
    assert launch.main(["--job.config_file", CONFIG, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("flag, value, replacement", [
    ("--hybrid.flavor", "debug", "--model.flavor"),
    ("--dump_folder", "out", "--job.dump_folder"),
    ("--dataloader.dataset", "pydoc", "--training.dataset"),
    ("--validator.seq_len", "64", "--validation.seq_len"),
    ("--parallelism.enable_sequence_parallel", None, "--parallelism.disable_sequence_parallel"),
])
def test_a_flag_spelled_as_torchtitan_0_3_names_it_names_the_0_2_spelling(
        flag, value, replacement, capsys):
    from titan_hybrid.adapters.command_line import RENAMED_UNDER_0_3

    assert launch.main(["--job.config_file", CONFIG, flag, *([value] if value else [])]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag} is torchtitan 0.3's name; under torchtitan 0.2.2 use "
                          f"{replacement}") and err.count("\n") == 1, err
    # and the table the message comes from is the one 0.3's TOML reader uses
    assert RENAMED_UNDER_0_3.get(replacement[2:], flag[2:]) == flag[2:]


def test_launcher_refuses_a_bad_layout_before_torchrun_starts():
    """The real command, end to end: exit 2, one line, no worker output, in seconds."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "titan_hybrid.launch", "--nproc", "2", "--job.config_file",
         CONFIG, "--parallelism.tensor_parallel_degree", "3"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: parallelism: tensor_parallel_degree=3")
    assert "Traceback" not in proc.stderr and "[rank" not in proc.stdout + proc.stderr
    assert elapsed < 60, elapsed  # imports only; no process group, no model

"""The job `python -m titan_hybrid.hf import` writes trains in the real trainer from the
imported weights (whose logits equal transformers': tests/unit/test_hf_command.py). A job can
also name the HF folder itself as its model (`hybrid.model_config`) and start from its weights
(`initial_load_in_hf`): in one process it repeats the imported job's curve bit for bit, and
under FSDP2, TP2 or EP2 over two processes it gives that curve too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.launch import run_training
from tests.unit.test_hf_command import FAMILIES as FAMILIES_BY_NAME
from tests.unit.test_hf_command import save_tiny
from titan_hybrid.hf.__main__ import main

# The packaged tokenizer has 2048 tokens: the imported model's vocabulary must hold them.
# No gradient clipping (max_norm 1e6): the clipping coefficient max_norm / |g| rounds with the
# layout, and MoE's top-k routing can turn such a 1e-7 weight difference into another expert
# for a token near a tie (measured: deepseek_v3_moe under TP2 on torch 2.11, step 3 1.2e-4
# apart with clipping, bitwise equal without; tests/launch.py's TOP_K_CURVE_REL says the same
# of DSA's indexer). Without it the layouts' own arithmetic is what is compared.
STEPS = ("--training.steps", "3", "--training.seq_len", "64", "--training.local_batch_size",
         "2", "--training.global_batch_size", "4", "--checkpoint.interval", "1000",
         "--metrics.log_freq", "1", "--training.mixed_precision_param", "float32",
         "--training.max_norm", "1e6")


# nemotron_h_moe (Mamba2, attention, MoE) on every torch CI runs; the other families, whose
# layers' parallel code that one and the layouts' own tests exercise, on its first torch leg.
FAMILIES = ["nemotron_h_moe"] + [
    pytest.param(family, marks=[pytest.mark.extended, pytest.mark.once_per_ci])
    for family in ("nemotron_h", "nemotron_h_latent_moe", "bamba", "deepseek_v3_moe", "deepseek_v4",
                   "qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid", "granitemoehybrid",
                   "granitemoehybrid_dense", "granitemoehybrid_tied", "kimi_linear", "lfm2", "lfm2_moe", "mamba2", "falcon_h1", "bailing_hybrid", "mamba",
                   "falcon_mamba", "jamba")]


@pytest.fixture(scope="module", params=FAMILIES)
def imported(tmp_path_factory, request):
    """(the imported job, the HF folder, the one-process run, its folder) of a tiny model of
    the family."""
    tmp = tmp_path_factory.mktemp(f"hf_import_{request.param}")
    save_tiny(request.param, tmp / "hf", vocab_size=2048)
    assert main(["import", str(tmp / "hf"), str(tmp / "ours")]) == 0
    job = str(tmp / "ours" / "job.toml")
    single = run_training(tmp / "single", *STEPS, config=job).check()
    return job, tmp / "hf", single, tmp / "single"


FSDP2 = ()  # over both processes
TP2 = ("--parallelism.tensor_parallel_degree", "2")
EP2 = ("--parallelism.expert_parallel_degree", "2")
# Each family trains under TP2, where its imported shapes meet the tensor-parallel plans (FSDP2
# shards any model alike: the layouts' own tests run every kind under it), but these. Under EP2
# DeepSeek-V4's MoE layers (the hash-routed one too) split their experts over the two ranks,
# with the hyper-connection streams and V4's attention around them; Jamba's too.
LAYOUTS = {"nemotron_h_moe": (FSDP2, TP2), "deepseek_v4": (TP2, EP2), "jamba": (FSDP2, EP2)}


def from_the_hf_folder(hf_dir: Path) -> tuple[str, ...]:
    """A job's model is the HF folder itself, and it starts from the folder's weights."""
    return ("--hybrid.model_config", str(hf_dir), "--checkpoint.initial_load_path", str(hf_dir),
            "--checkpoint.initial_load_in_hf")


def test_the_hf_folder_trains_under_each_layout_on_the_imported_curve(imported, tmp_path,
                                                                       request):
    """Each layout's two ranks read their pieces of the HF folder's tensors in place (DCP's HF
    reader), also where a tensor of theirs joins several of ours (Qwen3-Next's in_proj_qkvz
    takes its rows key-head group by group from four of our components, its conv1d from
    three), and train on the curve of the imported job in one process."""
    job, hf_dir, single, _ = imported
    layouts = LAYOUTS.get(request.node.callspec.params["imported"], (TP2,))
    for index, layout in enumerate(layouts):
        result = run_training(tmp_path / str(index), *STEPS, *from_the_hf_folder(hf_dir),
                              *layout, config=job, nproc=2).check()
        assert len(result.losses) == len(single.losses) == 3
        for ours, reference in zip(result.losses, single.losses):
            assert ours == pytest.approx(reference, rel=1e-5)


@pytest.mark.parametrize("imported", ["nemotron_h_moe"], indirect=True)
def test_one_process_from_the_hf_folder_repeats_the_imported_curve_bitwise(imported, tmp_path):
    job, hf_dir, single, _ = imported
    result = run_training(tmp_path, *STEPS, *from_the_hf_folder(hf_dir), config=job).check()
    assert result.losses == single.losses


@pytest.mark.extended
@pytest.mark.once_per_ci
@pytest.mark.parametrize("imported", ["olmo_hybrid"], indirect=True)
@pytest.mark.parametrize("layout", [
    # The second stage starts with the MLP of the first attention layer: post-norm too.
    ("--parallelism.pipeline_parallel_degree", "2", "--hybrid.pattern", "G-*|-G-*-"),
    ("--parallelism.context_parallel_degree", "2"),
    ("--parallelism.context_parallel_degree", "2",
     "--parallelism.context_parallel_linear_mode", "chunkwise")])
def test_post_norm_layers_train_under_pp_and_cp_with_the_one_process_curve(imported, tmp_path,
                                                                           layout):
    """OLMo Hybrid's post-norm attention layers (and the MLPs after them): a pipeline stage
    keeps each layer's norm placement, also where a stage starts inside a decoder layer, and context parallelism's pieces normalize per token;
    both give the one-process curve of the imported model."""
    job, _, single, _ = imported
    result = run_training(tmp_path, *STEPS, *layout, config=job, nproc=2).check()
    assert len(result.losses) == len(single.losses) == 3
    for ours, reference in zip(result.losses, single.losses):
        assert ours == pytest.approx(reference, rel=1e-5)


@pytest.mark.parametrize("layout, nproc", [
    ((), 1), pytest.param(("--parallelism.tensor_parallel_degree", "2"), 2,
                          marks=pytest.mark.extended)])
def test_the_trainers_hf_export_gives_the_hf_folder_back_bitwise(tmp_path, layout, nproc):
    """A Qwen3-Next run reads the HF folder and writes its last step in HF format
    (`last_save_in_hf`) at lr 0: every tensor comes back bit for bit. DCP's HF writer keeps
    one piece of a tensor per rank, and a rank holds in_proj_qkvz as pieces of four of our
    components (under TP, conv1d too as pieces of three): those are gathered for writing."""
    import transformers
    from safetensors.torch import load_file

    save_tiny("qwen3_next", tmp_path / "hf", vocab_size=2048)
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    run_training(tmp_path / "run", *STEPS, *layout, "--training.steps", "1",
                 "--optimizer.lr", "0", "--checkpoint.initial_load_path", str(tmp_path / "hf"),
                 "--checkpoint.initial_load_in_hf", "--checkpoint.last_save_in_hf",
                 config=str(tmp_path / "ours" / "job.toml"), nproc=nproc).check()
    saved = tmp_path / "run" / "outputs" / "checkpoint" / "step-1"
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    written = {}
    for file in saved.glob("*.safetensors"):
        written.update(load_file(str(file)))
    assert sorted(written) == sorted(original)
    for key, tensor in original.items():
        assert torch.equal(written[key], tensor), key
    transformers.AutoModelForCausalLM.from_pretrained(str(saved))  # config + weights load


def test_the_trained_checkpoint_exports_to_a_folder_transformers_runs(imported, tmp_path):
    """Import, train, export: the one-process run's last checkpoint (optimizer state and all)
    becomes a folder transformers loads, whose logits equal our model's on those weights."""
    import torch
    import transformers

    from tests.unit.test_hf_command import logits_of, relative_error
    from titan_hybrid.hf.__main__ import model_args_of_job
    from titan_hybrid.hf.convert import build_model, load_checkpoint_into

    job, _, _, run = imported
    checkpoint = run / "outputs" / "checkpoint"
    assert main(["export", str(checkpoint), str(tmp_path / "back"), "--job", job]) == 0
    args, _ = model_args_of_job(Path(job))
    ours = build_model(args)
    load_checkpoint_into(ours, checkpoint / "step-3")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "back"), dtype=torch.float32, attn_implementation="eager").eval()
    error = relative_error(logits_of(ours, vocab=2048), logits_of(theirs, vocab=2048))
    assert error <= 1e-5, error


@pytest.mark.extended  # the 2.13 leg's extended run, and the 2.11 / 2.14 / 2.15 legs
def test_a_tied_head_trains_with_the_one_process_curve_and_resumes_under_tp(tmp_path):
    """Heads tied to the embedding (Granite 4.0-H's, the small Qwen3.5 ones'): one weight,
    trained by every use. FSDP2 shards it once, in one unit with the final norm and the head,
    here unevenly (an odd vocabulary), on a Qwen3.5-MoE config whose MTP depth runs the head
    again (from a fresh init: a bare config.json names the model); TP splits its vocabulary
    rows for both uses. The checkpoint holds it once, as the embedding (no `output.weight`, no
    optimizer state for it), and a one-process checkpoint of an imported Granite model
    resumes under TP2 onto the uninterrupted curve."""
    config_class, _, fields = FAMILIES_BY_NAME["qwen3_5_moe"]
    (tmp_path / "qwen").mkdir()
    config = config_class(**{**fields, "vocab_size": 2051, "tie_word_embeddings": True,
                             "mtp_num_hidden_layers": 1}).to_dict()
    (tmp_path / "qwen" / "config.json").write_text(json.dumps(config))
    fresh = (*STEPS, "--hybrid.model_config", str(tmp_path / "qwen"))
    single = run_training(tmp_path / "single", *fresh).check()
    fsdp = run_training(tmp_path / "fsdp", *fresh, nproc=2).check()
    assert len(fsdp.losses) == len(single.losses) == 3
    for ours, reference in zip(fsdp.losses, single.losses):
        assert ours == pytest.approx(reference, rel=1e-5)

    save_tiny("granitemoehybrid_tied", tmp_path / "hf", vocab_size=2048)
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    job = str(tmp_path / "ours" / "job.toml")
    saving = ("--training.steps", "4", "--checkpoint.interval", "2", "--checkpoint.folder", "ck",
              "--checkpoint.no_last_save_model_only")
    single = run_training(tmp_path / "granite", *STEPS, *saving, config=job).check()
    outputs = tmp_path / "granite" / "outputs"
    keys = dcp.FileSystemReader(str(outputs / "ck" / "step-2")).read_metadata()
    keys = keys.state_dict_metadata
    assert "tok_embeddings.weight" in keys and "output.weight" not in keys
    assert "optimizer.state.tok_embeddings.weight.exp_avg" in keys
    assert not any(key.startswith("optimizer.state.output.") for key in keys)
    shutil.rmtree(outputs / "ck" / "step-4")
    resumed = run_training(tmp_path / "granite", *STEPS, *saving,
                           "--parallelism.tensor_parallel_degree", "2", config=job,
                           nproc=2).check()
    assert "Training starts at step 3" in resumed.output
    assert len(resumed.losses) == 2
    for ours, reference in zip(resumed.losses, single.losses[2:]):
        assert ours == pytest.approx(reference, rel=1e-5)

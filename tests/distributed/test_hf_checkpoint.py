"""HF checkpoints in the real trainer. Nemotron-H: `--checkpoint.initial_load_in_hf` reads a
`transformers` checkpoint under 1 process and under TP=2 / FSDP=2 (same first loss), and
`--checkpoint.last_save_in_hf` writes it back. With lr=0 the weights do not move, so the
written checkpoint must equal the one read, bit for bit, and load into transformers, tokenizer
included. DeepSeek-V3 / V3.2: a `+-+-` / `D-D-` run's export loads into transformers'
DeepseekV3ForCausalLM / DeepseekV32ForCausalLM, whose logits equal our model's on the run's
weights."""

import dataclasses
import json

import pytest
import tokenizers
import torch
import torch.distributed.checkpoint as dcp
import transformers  # noqa: E402  (the test extra installs it)
from safetensors.torch import load_file
from transformers.models.deepseek_v32 import DeepseekV32ForCausalLM

from tests.launch import run_training
from titan_hybrid.checkpoint.state import NON_MODEL_PREFIXES
from titan_hybrid.data.corpus import TOKENIZER_DIR as TOKENIZER
from titan_hybrid.hf.families import FAMILIES
from titan_hybrid.hf.nemotron_h import nemotron_h_config
from titan_hybrid.model.args import hybrid_flavors
from titan_hybrid.model.model import HybridModel

RUN = ("--model.flavor", "debug_nemotron_h", "--training.steps", "1", "--optimizer.lr", "0",
       "--training.local_batch_size", "2", "--training.global_batch_size", "4",
       "--training.seq_len", "128")


def safetensors_of(folder):
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_source")
    args = dataclasses.replace(hybrid_flavors["debug_nemotron_h"], max_seq_len=128)
    config = {k: v for k, v in nemotron_h_config(args).items()
              if k not in ("architectures", "model_type")}
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**config))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.02 * torch.randn_like(param))
    model.save_pretrained(str(folder))
    return folder


LAYOUTS = {"1": ((), 1), "tp2": (("--parallelism.tensor_parallel_degree", "2"), 2),
           "fsdp2": ((), 2), "fsdp2_tp2": (("--parallelism.tensor_parallel_degree", "2"), 4)}


def round_trip(tmp_path, hf_checkpoint, layout):
    """Load the HF checkpoint, train one step at lr=0, save in HF format; check what was
    written and return the first loss."""
    extra, nproc = LAYOUTS[layout]
    result = run_training(
        tmp_path, *RUN, *extra, "--checkpoint.enable", "--checkpoint.folder", "ck",
        "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", str(hf_checkpoint),
        "--checkpoint.last_save_in_hf", nproc=nproc).check()
    saved = tmp_path / "outputs" / "ck" / "step-1"
    original, written = safetensors_of(hf_checkpoint), safetensors_of(saved)
    assert sorted(written) == sorted(original)
    for key, tensor in original.items():
        assert torch.equal(written[key], tensor), key
    config = json.loads((saved / "config.json").read_text())
    assert config["hybrid_override_pattern"] == "M-M*-M-"
    transformers.NemotronHForCausalLM.from_pretrained(str(saved))  # config + weights load
    assert not (saved / "sharded").exists()  # torchtitan's per-rank copy is gone
    text = "def greet(name):\n    return f'hello {name}'"
    ours = tokenizers.Tokenizer.from_file(str(TOKENIZER / "tokenizer.json")).encode(text).ids
    assert transformers.AutoTokenizer.from_pretrained(str(saved)).encode(text) == ours
    return result.losses[0]


@pytest.fixture(scope="module")
def single_process_loss(tmp_path_factory, hf_checkpoint):
    return round_trip(tmp_path_factory.mktemp("hf_1"), hf_checkpoint, "1")


@pytest.mark.parametrize("layout", [pytest.param("tp2", marks=pytest.mark.extended), "fsdp2",
                                    pytest.param("fsdp2_tp2", marks=pytest.mark.slow)])
def test_hf_checkpoint_round_trips_under_each_layout(tmp_path, hf_checkpoint,
                                                     single_process_loss, layout):
    # Same data, same weights: the first loss is a property of the checkpoint, not the layout.
    loss = round_trip(tmp_path, hf_checkpoint, layout)
    assert loss == pytest.approx(single_process_loss, rel=1e-6)


def test_hf_load_of_a_mismatched_model_names_the_keys(tmp_path, hf_checkpoint):
    result = run_training(
        tmp_path, *RUN, "--hybrid.pattern", "M-M*-M-M", "--checkpoint.enable",
        "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", str(hf_checkpoint))
    assert result.returncode != 0
    assert "backbone.layers.7.mixer.in_proj.weight" in result.output
    assert "Training starts at step" not in result.output


@pytest.mark.parametrize("pattern, flavor", [("M-*-", "debug"), ("M+-", "debug_mla")])
def test_hf_flags_with_a_model_the_format_cannot_hold_fail_at_once(tmp_path, pattern, flavor):
    result = run_training(tmp_path, "--model.flavor", flavor, "--hybrid.pattern", pattern,
                          "--training.steps", "1", "--checkpoint.enable",
                          "--checkpoint.last_save_in_hf")
    assert result.returncode != 0
    # Nemotron-H's kinds, but SwiGLU and RoPE; MLA layers, but not DeepSeek's pairs.
    expected = "DeepSeek-V3 / V3.2" if "+" in pattern else "Nemotron-H"
    assert f"cannot use the HF {expected} format" in result.output
    assert "HF checkpoints take the format of the model's layer kinds" in result.output
    assert "Training starts at step" not in result.output


DEEPSEEK = {"+-+-": ("debug_mla", transformers.DeepseekV3ForCausalLM),
            "D-D-": ("debug_dsa", DeepseekV32ForCausalLM)}


def model_entries(folder) -> dict[str, torch.Tensor]:
    """The model's entries of one of our DCP checkpoints (fused tensors as their components)."""
    reader = dcp.FileSystemReader(str(folder))
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in reader.read_metadata().state_dict_metadata.items()
             if not key.startswith(NON_MODEL_PREFIXES)}
    dcp.load(state, storage_reader=reader)
    return state


@pytest.mark.parametrize("pattern, layout", [
    ("+-+-", "1"), ("D-D-", "1"), pytest.param("D-D-", "tp2", marks=pytest.mark.extended)])
def test_deepseek_export_of_a_run_loads_into_transformers_with_our_logits(tmp_path, pattern,
                                                                          layout):
    """Step 1 is saved as our checkpoint, step 2 (the last) in HF format; at lr=0 both hold
    the same weights: the export must be them under DeepSeek's names, and transformers' model
    on it must give our model's logits."""
    flavor, model_class = DEEPSEEK[pattern]
    extra, nproc = LAYOUTS[layout]
    run_training(
        tmp_path, "--model.flavor", flavor, "--hybrid.pattern", pattern, "--training.steps", "2",
        "--optimizer.lr", "0", "--training.seq_len", "64", "--training.local_batch_size", "2",
        "--checkpoint.enable", "--checkpoint.folder", "ck", "--checkpoint.interval", "1",
        "--checkpoint.last_save_in_hf", *extra, nproc=nproc).check()
    saved = tmp_path / "outputs" / "ck"
    args = dataclasses.replace(hybrid_flavors[flavor], pattern=pattern, max_seq_len=64)
    ours = HybridModel(args).eval()
    entries = model_entries(saved / "step-1")
    for key in [key for key in entries if key.endswith("fc1.weight_w")]:
        entries[key[:-2]] = torch.cat((entries.pop(key), entries.pop(key[:-2] + "_v")))
    ours.load_state_dict(entries, strict=True)

    written = safetensors_of(saved / "step-2")
    expected = FAMILIES["deepseek"].adapter(args).to_hf(ours.state_dict())
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[key], value) for key, value in expected.items())
    assert json.loads((saved / "step-2" / "config.json").read_text())["architectures"] == [
        model_class.__name__]
    theirs = model_class.from_pretrained(str(saved / "step-2"), attn_implementation="eager")
    # 48 tokens: DSA's indexer keeps 16 keys per query, so the sparse path is compared.
    tokens = torch.randint(0, args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = theirs.eval()(tokens).logits
        got = ours(tokens)
    got = got[0] if isinstance(got, tuple) else got
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * want.abs().max().item())

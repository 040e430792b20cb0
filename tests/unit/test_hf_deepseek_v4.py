"""DeepSeek-V4 as a Hugging Face family (hf/deepseek_v4.py), beyond what every family's checks
in tests/unit/test_hf_command.py assert of it (transformers' logits within 1e-5 after an import,
its tensors back bit for bit after an export, packed documents):

- a folder in DeepSeek's release naming imports with the same weights, and exports in
  transformers' naming;
- an MTP depth in DeepSeek's names (`mtp.0.*`: transformers skips them) imports into our V4-form
  MTP, whose logits equal those computed from the same tensors with transformers' own decoder
  layer, hyper head and norm; the export writes them back bit for bit;
- what the format cannot hold is refused by name, in both directions; a quantized release's
  scale tensors are named;
- the `debug_v4_model` flavor exports a folder transformers builds and reads.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

from tests.unit.test_hf_command import (
    FAMILIES,
    add_to_hf_folder,
    exported_with_mtp,
    logits_of,
    perturbed,
    relative_error,
    save_tiny,
    tokens,
)
from titan_hybrid.hf.__main__ import main, model_args_of_job
from titan_hybrid.hf.convert import build_model, load_checkpoint_into
from titan_hybrid.hf.deepseek_v4 import release_name
from titan_hybrid.hf.families import check_hf_compatible, hf_config, hybrid_state_dict_adapter
from titan_hybrid.model.args import hybrid_flavors
from titan_hybrid.model.model import HybridModel

WIDTH = FAMILIES["deepseek_v4"][2]["hidden_size"]


def released(key: str) -> str:
    """DeepSeek's release name of a tensor transformers' save_pretrained names `key`."""
    if key == "model.embed_tokens.weight":
        return "embed.weight"
    if key.startswith("model.hc_head.hc_"):
        return "hc_head_" + key[len("model.hc_head.hc_"):]
    return key.removeprefix("model.")


def imported_model(tmp_path: Path, folder: str = "hf"):
    """(args, model) of `tmp_path/folder` imported into `tmp_path/ours`."""
    assert main(["import", str(tmp_path / folder), str(tmp_path / "ours")]) == 0
    args, _ = model_args_of_job(tmp_path / "ours" / "job.toml")
    model = build_model(args)
    load_checkpoint_into(model, tmp_path / "ours" / "checkpoint" / "step-0")
    return args, model


def test_a_release_named_folder_imports_and_exports_in_transformers_naming(tmp_path):
    reference = save_tiny("deepseek_v4", tmp_path / "hf")
    written = load_file(str(tmp_path / "hf" / "model.safetensors"))
    (tmp_path / "release").mkdir()
    save_file({released(key): value for key, value in written.items()},
              str(tmp_path / "release" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "release" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    assert "layers.1.attn.indexer.compressor.wkv.weight" in load_file(
        str(tmp_path / "release" / "model.safetensors"))

    _, model = imported_model(tmp_path, "release")
    assert relative_error(logits_of(model), logits_of(reference)) <= 1e-5
    assert main(["export", str(tmp_path / "ours" / "checkpoint"), str(tmp_path / "back"),
                 "--job", str(tmp_path / "ours" / "job.toml")]) == 0
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert back.keys() == written.keys()
    assert all(torch.equal(back[key], value) for key, value in written.items())


def test_release_names_are_transformers_own(tmp_path):
    """Each attention parameter's DeepSeek name is the one transformers' save_pretrained writes
    (its conversion mapping, reversed) for the in-memory name our layers carry."""
    model = save_tiny("deepseek_v4", tmp_path)
    written = set(load_file(str(tmp_path / "model.safetensors")))
    for key in (key for key in model.state_dict() if ".self_attn." in key):
        prefix, parameter = key.split(".self_attn.")
        assert f"{prefix}.attn.{release_name(parameter)}" in written, key


def test_an_mtp_depth_imports_predicts_like_transformers_blocks_and_exports(tmp_path):
    """DeepSeek-V4's MTP: enorm(embedding of the next token) through e_proj, added to every one
    of hnorm(the main model's streams before its hyper head) through h_proj; one decoder layer
    (sliding window, top-k MoE); its own hyper head, norm, and the main head."""
    reference = save_tiny("deepseek_v4", tmp_path / "hf")
    blocks = perturbed("deepseek_v4", 2, num_hidden_layers=1, layer_types=["sliding_attention"],
                       mlp_layer_types=["moe"])
    with torch.no_grad():
        blocks.lm_head.weight.copy_(reference.lm_head.weight)
    blocks.save_pretrained(str(tmp_path / "blocks"))
    mtp = {key.replace("model.layers.0.", "mtp.0."): value for key, value in
           load_file(str(tmp_path / "blocks" / "model.safetensors")).items()
           if key.startswith("model.layers.0.")}
    enorm, hnorm = (1 + 0.1 * torch.randn(WIDTH) for _ in range(2))
    e_proj, h_proj = (0.1 * torch.randn(WIDTH, WIDTH) for _ in range(2))
    head = blocks.model.hc_head
    mtp.update({"mtp.0.enorm.weight": enorm, "mtp.0.hnorm.weight": hnorm,
                "mtp.0.e_proj.weight": e_proj, "mtp.0.h_proj.weight": h_proj,
                "mtp.0.norm.weight": blocks.model.norm.weight.detach().clone(),
                **{f"mtp.0.hc_head_{part}": getattr(head, f"hc_{part}").detach().clone()
                   for part in ("fn", "base", "scale")}})
    add_to_hf_folder(tmp_path / "hf", mtp, num_nextn_predict_layers=1)

    args, ours = imported_model(tmp_path)
    assert args.pattern == "WECEHE/WE"
    with torch.no_grad():
        logits, _, mtp_logits = ours(tokens())
        streams = []
        hook = reference.model.hc_head.register_forward_pre_hook(
            lambda module, inputs: streams.append(inputs[0]))
        main_logits = logits_of(reference)
        hook.remove()
        eps = reference.config.rms_norm_eps

        def rms(x, weight):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

        future = reference.model.embed_tokens(F.pad(tokens()[:, 1:], (0, 1)))
        x = (F.linear(rms(future, enorm), e_proj).unsqueeze(2)
             + F.linear(rms(streams[0], hnorm), h_proj))
        hook = blocks.model.layers[0].register_forward_pre_hook(
            lambda module, inputs, kwargs: ((x, *inputs[1:]), kwargs), with_kwargs=True)
        theirs = blocks(tokens()).logits
        hook.remove()
    assert relative_error(logits, main_logits) <= 1e-5
    error = relative_error(mtp_logits, theirs)
    assert error <= 1e-5, error
    assert exported_with_mtp(tmp_path, mtp)["num_nextn_predict_layers"] == 1


@pytest.mark.parametrize("changes, named", [
    ({"n_shared_experts": 2}, "n_shared_experts=2 is not supported"),
    ({"num_key_value_heads": 2}, "num_key_value_heads=2 is not supported"),
    ({"norm_topk_prob": False}, "norm_topk_prob=False is not supported"),
    ({"router_jitter_noise": 0.1}, "router_jitter_noise=0.1 is not supported"),
    ({"mlp_layer_types": ["moe", "hash_moe", "moe"]},
     "mlp_layer_types=['moe', 'hash_moe', 'moe']: hash-routed layers ('hash_moe') come first"),
])
def test_a_config_setting_we_cannot_hold_is_named(tmp_path, capsys, changes, named):
    save_tiny("deepseek_v4", tmp_path / "hf", **changes)
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "ours").exists()


def test_a_quantized_release_is_refused_naming_its_scales(tmp_path, capsys):
    save_tiny("deepseek_v4", tmp_path / "hf")
    add_to_hf_folder(tmp_path / "hf", {"model.layers.0.ffn.experts.0.w1.scale": torch.ones(2)})
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 2
    assert ("1 tensor(s) with no place in the model: model.layers.0.ffn.experts.0.w1.scale"
            in capsys.readouterr().err)
    add_to_hf_folder(tmp_path / "hf", {}, quantization_config={"quant_method": "fp8"})
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 2
    assert "quantization_config={'quant_method': 'fp8'} is not supported" in (
        capsys.readouterr().err)


def _v4(**changes):
    return dataclasses.replace(hybrid_flavors["debug_v4_model"], **changes)


@pytest.mark.parametrize("args, named", [
    (_v4(pattern="MWE"), "hybrid.pattern 'MWE' must be DeepSeek-V4's decoder layers"),
    (_v4(pattern="WECE/CE"), "DeepSeek-V4's MTP block is one decoder layer a depth, 'WE'"),
    (_v4(hc_mult=0), "hc_mult=0: DeepSeek-V4's residual stream is hc_mult >= 1"),
    (_v4(moe=dataclasses.replace(hybrid_flavors["debug_v4_model"].moe, swiglu_limit=0.0)),
     "moe.swiglu_limit=0.0: DeepSeek-V4 always clamps its SwiGLU"),
    (_v4(moe=dataclasses.replace(hybrid_flavors["debug_v4_model"].moe,
                                 score_correction_bias=False)),
     "score_correction_bias=False"),
    (_v4(norm_eps=1e-5), "window_attention.norm_eps=1e-06 differs from norm_eps=1e-05"),
])
def test_a_model_the_format_cannot_hold_is_refused_by_name(args, named):
    with pytest.raises(ValueError) as error:
        check_hf_compatible(args)
    assert named in str(error.value)


def test_debug_v4_model_exports_a_folder_transformers_reads(tmp_path):
    """The flavor's weights, exported, load into transformers' DeepseekV4ForCausalLM, which
    computes our logits."""
    args = hybrid_flavors["debug_v4_model"]
    main_args = dataclasses.replace(args, pattern=args.pattern.split("/")[0])
    assert main_args.moe.hash_layers == 1 and args.hc_mult == 4
    model = HybridModel(main_args)
    model.init_weights()
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    adapter = hybrid_state_dict_adapter(main_args, None)
    hf = {key: value.contiguous() for key, value in adapter.to_hf(model.state_dict()).items()}
    (tmp_path / "back").mkdir()
    save_file(hf, str(tmp_path / "back" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "back" / "config.json").write_text(json.dumps(hf_config(main_args)))
    theirs = transformers.DeepseekV4ForCausalLM.from_pretrained(
        str(tmp_path / "back"), dtype=torch.float32, attn_implementation="eager").eval()
    vocab = args.vocab_size
    assert relative_error(logits_of(model, vocab), logits_of(theirs, vocab)) <= 1e-5

"""`python -m titan_hybrid.hf import / export` against transformers, per family: a tiny random
transformers model (fp32, every parameter perturbed) saved with `save_pretrained`, imported
(our logits equal theirs, relative error <= 1e-5), exported again (transformers loads the
folder and its logits equal the original model's bit for bit). Tensors without a place on the
other side, and families we cannot express, are refused by name before anything is written.
The imported job's training under FSDP2 and TP2 is in tests/distributed/test_hf_import.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from titan_hybrid.hf.__main__ import main, model_args_of_job
from titan_hybrid.hf.convert import build_model, load_checkpoint_into

REPO_ROOT = Path(__file__).resolve().parents[2]
SEQ = 20

# Each family: its transformers classes and a tiny config in transformers' own words (eager
# attention, which a reloaded model is given too: sdpa rounds differently).
FAMILIES = {
    "nemotron_h": (transformers.NemotronHConfig, transformers.NemotronHForCausalLM, dict(
        vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=40, ssm_state_size=8, mamba_num_heads=8,
        mamba_head_dim=8, n_groups=2, chunk_size=8, max_position_embeddings=64,
        layers_block_type=["mamba", "mlp", "attention", "mamba", "mlp"],
        attn_implementation="eager")),
    # Nemotron 3: MoE layers (squared-ReLU experts, biased group-limited sigmoid routing), and
    # as in Nano a Mamba2 width (12 heads of 8) that is not expand * hidden_size.
    "nemotron_h_moe": (transformers.NemotronHConfig, transformers.NemotronHForCausalLM, dict(
        vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=40, ssm_state_size=8, mamba_num_heads=12,
        mamba_head_dim=8, n_groups=2, chunk_size=8, max_position_embeddings=64,
        layers_block_type=["mamba", "moe", "attention", "moe", "mamba", "mlp"],
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=24, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, attn_implementation="eager")),
    # Nemotron 3 Super's latent MoE: routed experts on tokens projected to moe_latent_size.
    "nemotron_h_latent_moe": (transformers.NemotronHConfig, transformers.NemotronHForCausalLM,
                              dict(
        vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=40, ssm_state_size=8, mamba_num_heads=8,
        mamba_head_dim=8, n_groups=2, chunk_size=8, max_position_embeddings=64,
        layers_block_type=["mamba", "moe", "attention", "moe"], n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=24,
        moe_latent_size=16, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        attn_implementation="eager")),
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, dict(
        vocab_size=96, hidden_size=48, intermediate_size=40, num_hidden_layers=2,
        first_k_dense_replace=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
        max_position_embeddings=64, attn_implementation="eager")),
    # DeepSeek-V3 with MoE layers after its first dense one (biased group-limited routing,
    # shared experts).
    "deepseek_v3_moe": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, dict(
        vocab_size=96, hidden_size=48, intermediate_size=40, num_hidden_layers=3,
        first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=16, n_shared_experts=2, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
        max_position_embeddings=64, attn_implementation="eager")),
    "deepseek_v32": (transformers.DeepseekV32Config, transformers.DeepseekV32ForCausalLM, dict(
        vocab_size=96, hidden_size=48, intermediate_size=40, num_hidden_layers=2,
        first_k_dense_replace=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
        index_n_heads=2, index_head_dim=16, index_topk=6, max_position_embeddings=64,
        attn_implementation="eager")),
    # DeepSeek-V4: sliding, compressed sparse and heavily compressed attention, four
    # hyper-connection streams, a hash-routed first MoE layer then top-k ones.
    "deepseek_v4": (transformers.DeepseekV4Config, transformers.DeepseekV4ForCausalLM, dict(
        vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, head_dim=16,
        q_lora_rank=24, partial_rotary_factor=0.5, o_groups=2, o_lora_rank=12,
        sliding_window=6, layer_types=["sliding_attention", "compressed_sparse_attention",
                                       "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 4},
        index_n_heads=2, index_head_dim=16, index_topk=3, mlp_layer_types=["hash_moe", "moe",
                                                                           "moe"],
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, hc_mult=4,
        max_position_embeddings=64, attn_implementation="eager")),
    "qwen3_5": (Qwen3_5TextConfig, Qwen3_5ForCausalLM, dict(
        vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=40, linear_key_head_dim=8,
        linear_value_head_dim=12, linear_num_key_heads=2, linear_num_value_heads=4,
        max_position_embeddings=64, attn_implementation="eager")),
    "qwen3_5_moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, dict(
        vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_key_head_dim=8, linear_value_head_dim=12,
        linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        max_position_embeddings=64, attn_implementation="eager")),
    # Qwen3-Next: its gated DeltaNet projections by key-head group (2 value heads per key
    # head), a dense first layer (mlp_only_layers) before MoE layers; and without experts.
    "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM, dict(
        vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=40, linear_key_head_dim=8,
        linear_value_head_dim=12, linear_num_key_heads=2, linear_num_value_heads=4,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, mlp_only_layers=[0], max_position_embeddings=64,
        attn_implementation="eager")),
    "qwen3_next_dense": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM, dict(
        vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=40, linear_key_head_dim=8,
        linear_value_head_dim=12, linear_num_key_heads=2, linear_num_value_heads=4,
        num_experts=0, max_position_embeddings=64, attn_implementation="eager")),
    # OLMo Hybrid: post-norm attention layers with q / k norms across heads, gated DeltaNet
    # layers with beta in [0, 2]; with rotary embeddings, and without (rope_theta null).
    "olmo_hybrid": (transformers.OlmoHybridConfig, transformers.OlmoHybridForCausalLM, dict(
        vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=40, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
        layer_types=["linear_attention", "full_attention", "linear_attention",
                     "full_attention"], pad_token_id=0, eos_token_id=1,
        max_position_embeddings=64, attn_implementation="eager")),
    "olmo_hybrid_nope": (transformers.OlmoHybridConfig, transformers.OlmoHybridForCausalLM,
                         dict(
        vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=40, linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=16,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": None}, rms_norm_eps=1e-5,
        pad_token_id=0, eos_token_id=1, max_position_embeddings=64,
        attn_implementation="eager")),
    # Granite 4.0-H: its scalars (embedding, residual, attention, logits), MoE with a shared
    # MLP, attention without RoPE; and without experts, with RoPE.
    "granitemoehybrid": (transformers.GraniteMoeHybridConfig,
                         transformers.GraniteMoeHybridForCausalLM, dict(
        vocab_size=96, hidden_size=32, intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2,
        layer_types=["mamba", "attention", "mamba", "attention"], num_local_experts=8,
        num_experts_per_tok=2, shared_intermediate_size=24, mamba_n_heads=8, mamba_n_groups=2,
        mamba_d_state=8, mamba_d_head=8, mamba_chunk_size=8, embedding_multiplier=12.0,
        residual_multiplier=0.22, attention_multiplier=1 / 16, logits_scaling=8.0,
        position_embedding_type=None, max_position_embeddings=64,
        attn_implementation="eager")),
    "granitemoehybrid_dense": (transformers.GraniteMoeHybridConfig,
                               transformers.GraniteMoeHybridForCausalLM, dict(
        vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["mamba", "attention", "mamba"],
        num_local_experts=0, shared_intermediate_size=24, mamba_n_heads=8, mamba_n_groups=2,
        mamba_d_state=8, mamba_d_head=8, mamba_chunk_size=8, embedding_multiplier=12.0,
        residual_multiplier=0.22, attention_multiplier=1 / 16, logits_scaling=8.0,
        position_embedding_type="rope", max_position_embeddings=64,
        attn_implementation="eager")),
    # Kimi Linear: KDA and NoPE MLA layers (3 + 1), a dense MLP then DeepSeek-style MoE
    # (group-limited sigmoid routing, routed scaling, a shared expert). Measured: logits
    # 9.0e-7 from transformers' on these 20 tokens, 1.4e-6 on 150 (three KDA chunks).
    "kimi_linear": (transformers.KimiLinearConfig, transformers.KimiLinearForCausalLM, dict(
        vocab_size=96, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
        q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        num_experts=8, num_experts_per_token=2, num_shared_experts=1, n_group=2,
        topk_group=1, routed_scaling_factor=2.446, moe_renormalize=True,
        first_k_dense_replace=1, rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, linear_attn_config=dict(num_heads=2, head_dim=16,
                                                short_conv_kernel_size=4,
                                                kda_layers=[1, 2, 4], full_attn_layers=[3]),
        attn_implementation="eager")),
    # LFM2: gated short convolutions and attention (q / k norms), an MLP width derived from
    # intermediate_size (block_auto_adjust_ff_dim), the LM head tied by default; and with
    # LFM2's biases (conv_bias: the conv and its two projections), untied.
    "lfm2": (transformers.Lfm2Config, transformers.Lfm2ForCausalLM, dict(
        vocab_size=96, hidden_size=32, intermediate_size=60, block_multiple_of=8,
        block_ffn_dim_multiplier=1.5, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["conv", "full_attention", "conv", "conv"],
        max_position_embeddings=64, attn_implementation="eager")),
    "lfm2_biased": (transformers.Lfm2Config, transformers.Lfm2ForCausalLM, dict(
        vocab_size=96, hidden_size=32, intermediate_size=40, block_auto_adjust_ff_dim=False,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        layer_types=["conv", "full_attention", "conv"], conv_bias=True, conv_L_cache=4,
        tie_word_embeddings=False, max_position_embeddings=64, attn_implementation="eager")),
    # LFM2-MoE: a dense MLP layer, then MoE layers (sigmoid router with an expert bias that
    # only chooses, top-k renormalised with 1e-6, scaled; no shared expert).
    "lfm2_moe": (transformers.Lfm2MoeConfig, transformers.Lfm2MoeForCausalLM, dict(
        vocab_size=96, hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
        num_hidden_layers=4, num_dense_layers=1, num_experts=8, num_experts_per_tok=2,
        routed_scaling_factor=2.5, num_attention_heads=4, num_key_value_heads=2,
        layer_types=["conv", "conv", "full_attention", "conv"], max_position_embeddings=64,
        attn_implementation="eager")),
    # Falcon-H1: Mamba2 and attention in parallel, every µP multiplier away from 1, a Mamba2
    # width (mamba_d_ssm) that is not expand * hidden_size, dt clamped; its Mamba2 without
    # the gated norm (the released models'), and with it.
    "falcon_h1": (transformers.FalconH1Config, transformers.FalconH1ForCausalLM, dict(
        vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, mamba_d_ssm=48,
        mamba_n_heads=6, mamba_d_state=8, mamba_n_groups=2, mamba_chunk_size=8,
        time_step_limit=(0.01, 3.0), embedding_multiplier=1.7, lm_head_multiplier=0.35,
        key_multiplier=0.6, attention_in_multiplier=1.3, attention_out_multiplier=0.8,
        ssm_in_multiplier=1.2, ssm_out_multiplier=0.7, ssm_multipliers=[1.1, 0.9, 1.4, 0.6, 2.0],
        mlp_multipliers=[1.5, 0.75], max_position_embeddings=64, attn_implementation="eager")),
    "falcon_h1_gated_norm": (transformers.FalconH1Config, transformers.FalconH1ForCausalLM, dict(
        vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=64, mamba_n_heads=8,
        mamba_d_state=8, mamba_n_groups=2, mamba_chunk_size=8, mamba_rms_norm=True,
        mamba_norm_before_gate=False, max_position_embeddings=64,
        attn_implementation="eager")),
    # Ling 3.0 (bailing_hybrid): KDA (full-rank gates, the bounded forget gate) and MLA with
    # its per-head output gate, a dense MLP then DeepSeek-style MoE layers.
    "bailing_hybrid": (transformers.BailingHybridConfig, transformers.BailingHybridForCausalLM,
                       dict(
        vocab_size=96, hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        n_group=2, topk_group=1, first_k_dense_replace=1, layer_group_size=2,
        num_mtp_layers=0, pad_token_id=0, eos_token_id=1, max_position_embeddings=64,
        attn_implementation="eager")),
    # Mamba (Mamba1 layers) and Falcon-Mamba (with weightless dt / B / C norms), heads tied.
    "mamba": (transformers.MambaConfig, transformers.MambaForCausalLM, dict(
        vocab_size=96, hidden_size=16, state_size=4, num_hidden_layers=3, expand=2,
        time_step_rank=3)),
    "falcon_mamba": (transformers.FalconMambaConfig, transformers.FalconMambaForCausalLM, dict(
        vocab_size=96, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2,
        mixer_rms_eps=1e-6, tie_word_embeddings=False)),
    # Jamba: Mamba1 layers with weighted dt / B / C norms, attention without RoPE on layer 2 of
    # each 4, MoE (softmax top-2, not renormalised) on every second layer.
    "jamba": (transformers.JambaConfig, transformers.JambaForCausalLM, dict(
        vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        expert_layer_period=2, expert_layer_offset=1, attn_layer_period=4, attn_layer_offset=2,
        mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=3,
        attn_implementation="eager")),
    # Mamba2 (transformers' Mamba2Config): Mamba2 layers only, dt clamped from below.
    "mamba2": (transformers.Mamba2Config, transformers.Mamba2ForCausalLM, dict(
        vocab_size=96, hidden_size=32, num_hidden_layers=3, num_heads=8, head_dim=8,
        expand=2, state_size=8, n_groups=2, chunk_size=8, time_step_limit=(0.01, 2.0),
        tie_word_embeddings=True)),
    "bamba": (transformers.BambaConfig, transformers.BambaForCausalLM, dict(
        vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
        attn_layer_indices=[1], num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8,
        mamba_n_groups=2, mamba_d_state=8, mamba_d_head=8, mamba_chunk_size=8,
        max_position_embeddings=64, attn_implementation="eager")),
}

# DeepSeek-V4 with YaRN on the compressed layers' table (V4's published checkpoints: factor 16).
FAMILIES["deepseek_v4_yarn"] = (*FAMILIES["deepseek_v4"][:2], {
    **FAMILIES["deepseek_v4"][2], "rope_parameters": {
        "main": {"rope_type": "default", "rope_theta": 10000.0},
        "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 4.0,
                     "original_max_position_embeddings": 16, "beta_fast": 32.0,
                     "beta_slow": 1.0}}})

# LM heads tied to the embedding (tie_word_embeddings), as Granite 4.0-H's published models and
# the small Qwen3.5 ones have them: transformers saves the weight once, as the embedding.
for _family in ("qwen3_5", "granitemoehybrid"):
    _config, _model, _fields = FAMILIES[_family]
    FAMILIES[f"{_family}_tied"] = (_config, _model, {**_fields, "tie_word_embeddings": True})


# The families each test runs over. A family's conversion is the same under every torch, so
# beyond Nemotron-H (dense and MoE) the matrix runs on CI's first torch leg only (once_per_ci),
# as tests/distributed/test_hf_import.py's training runs do.
EVERY_TORCH = ("nemotron_h", "nemotron_h_moe")
FAMILY_MATRIX = [family if family in EVERY_TORCH
                 else pytest.param(family, marks=pytest.mark.once_per_ci)
                 for family in FAMILIES]


def tokens(vocab: int = 96) -> torch.Tensor:
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(0))


def perturbed(family: str, seed: int, **changes) -> torch.nn.Module:
    """A tiny random transformers model of the family, every parameter perturbed (so that
    a misplaced tensor shows)."""
    config_class, model_class, fields = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_class(config_class(**{**fields, **changes})).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
        for name, buffer in model.named_buffers():  # the routers' choice biases (init: 0)
            if name.endswith(("e_score_correction_bias", "expert_bias")):
                buffer.copy_(0.05 * torch.randn_like(buffer))
            if name.endswith("tid2eid"):  # hash routing's table (init: 0): distinct experts
                experts = model.config.n_routed_experts
                buffer.copy_(torch.rand(buffer.shape[0], experts).argsort(-1)[:, :buffer.shape[1]])
    return model


def save_tiny(family: str, folder: Path, **changes) -> torch.nn.Module:
    """perturbed(family), saved to `folder`; the model is returned."""
    model = perturbed(family, 1, **changes)
    model.save_pretrained(str(folder))
    return model


def logits_of(model, vocab: int = 96) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens(vocab))
    out = getattr(out, "logits", out)
    return out[0] if isinstance(out, tuple) else out


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours.double() - theirs.double()).norm() / theirs.double().norm()).item()


@pytest.mark.parametrize("family", FAMILY_MATRIX)
def test_import_gives_transformers_logits_and_export_gives_them_back_bitwise(tmp_path, family):
    reference = save_tiny(family, tmp_path / "hf")
    theirs = logits_of(reference)

    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    job = tmp_path / "ours" / "job.toml"
    args, _ = model_args_of_job(job)
    model = build_model(args)
    load_checkpoint_into(model, tmp_path / "ours" / "checkpoint" / "step-0")
    error = relative_error(logits_of(model), theirs)
    assert error <= 1e-5, error

    assert main(["export", str(tmp_path / "ours" / "checkpoint"), str(tmp_path / "back"),
                 "--job", str(job)]) == 0
    _, model_class, _ = FAMILIES[family]
    again = model_class.from_pretrained(str(tmp_path / "back"), dtype=torch.float32,
                                       attn_implementation="eager").eval()
    assert torch.equal(logits_of(again), theirs)
    original = reference.state_dict()
    exported = again.state_dict()
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[key], value) for key, value in original.items())


@pytest.mark.extended
@pytest.mark.once_per_ci  # the command line's own behaviour: the same under every torch
def test_the_commands_run_as_modules_and_a_user_error_is_one_line(tmp_path):
    """The documented command lines, in a fresh interpreter: an import works; a second import
    into the same folder, and a refused family, end with one line and exit status 2."""
    save_tiny("nemotron_h", tmp_path / "hf")
    command = [sys.executable, "-m", "titan_hybrid.hf", "import", str(tmp_path / "hf"),
               str(tmp_path / "ours")]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "ours" / "checkpoint" / "step-0" / "checksums.json").is_file()
    again = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    assert again.returncode == 2
    assert again.stderr.strip().splitlines() == [
        f"titan_hybrid.hf import: output folder '{tmp_path / 'ours'}' exists and is not empty"]


@pytest.mark.parametrize("model_type, reason", [
    ("zamba", "shared between positions"),
    ("zamba2", "shared between positions"),
    ("llama4", "not a supported family; supported: bailing_hybrid, bamba, deepseek_v3, "
               "deepseek_v32, "
               "deepseek_v4, falcon_h1, falcon_mamba, granitemoehybrid, jamba, kimi_linear, "
               "lfm2, "
               "lfm2_moe, mamba, mamba2, nemotron_h, olmo_hybrid, qwen3_5, qwen3_5_moe, "
               "qwen3_5_moe_text, qwen3_5_text, qwen3_next"),
])
def test_families_we_cannot_express_are_refused_by_name(tmp_path, capsys, model_type, reason):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": model_type}))
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 2
    message = capsys.readouterr().err.strip()
    assert len(message.splitlines()) == 1
    assert f"model_type '{model_type}'" in message and reason in message
    assert not (tmp_path / "ours").exists() and not (tmp_path / "ours.partial").exists()


def test_mamba_ssms_own_config_is_refused_by_name(tmp_path, capsys):
    """state-spaces/mamba2-130m's config.json (mamba_ssm's format): one line naming it and
    the format that is read."""
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({
        "d_model": 768, "d_intermediate": 0, "n_layer": 24, "vocab_size": 50277,
        "ssm_cfg": {"layer": "Mamba2"}, "attn_layer_idx": [], "attn_cfg": {},
        "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True,
        "pad_vocab_size_multiple": 16, "tie_embeddings": True}))
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 2
    message = capsys.readouterr().err.strip()
    assert len(message.splitlines()) == 1
    assert "mamba_ssm's own config.json" in message and "model_type 'mamba2'" in message
    assert not (tmp_path / "ours").exists()


def test_a_tensor_without_a_place_is_named_before_anything_is_written(tmp_path, capsys):
    save_tiny("nemotron_h", tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["backbone.layers.0.mixer.extra_scale"] = torch.ones(3)
    del tensors["backbone.layers.3.mixer.D"]
    save_file(tensors, str(weights), metadata={"format": "pt"})
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 2
    message = capsys.readouterr().err
    assert "1 tensor(s) with no place in the model: backbone.layers.0.mixer.extra_scale" in message
    assert "1 model tensor(s) it lacks: backbone.layers.3.mixer.D" in message
    assert not (tmp_path / "ours").exists() and not (tmp_path / "ours.partial").exists()


def test_a_setting_we_cannot_hold_is_named(tmp_path, capsys):
    save_tiny("nemotron_h", tmp_path / "hf", mlp_hidden_act="silu")
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 2
    assert "mlp_hidden_act='silu' is not supported" in capsys.readouterr().err
    save_tiny("nemotron_h_latent_moe", tmp_path / "latent", mlp_bias=True)
    assert main(["import", str(tmp_path / "latent"), str(tmp_path / "ours")]) == 2
    assert "mlp_bias=True is not supported (expected False)" in capsys.readouterr().err
    save_tiny("bamba", tmp_path / "bias", mlp_bias=True)
    assert main(["import", str(tmp_path / "bias"), str(tmp_path / "ours")]) == 2
    assert "mlp_bias=True is not supported (expected False)" in capsys.readouterr().err
    save_tiny("jamba", tmp_path / "jamba", mamba_proj_bias=True)
    assert main(["import", str(tmp_path / "jamba"), str(tmp_path / "ours")]) == 2
    assert "mamba_proj_bias=True is not supported (expected False)" in capsys.readouterr().err
    save_tiny("deepseek_v3", tmp_path / "tied", tie_word_embeddings=True)
    assert main(["import", str(tmp_path / "tied"), str(tmp_path / "ours")]) == 2
    assert ("tie_word_embeddings=True is not supported: titan_hybrid's deepseek_v3/deepseek_v32 "
            "models have an LM head of its own") in capsys.readouterr().err
    assert not (tmp_path / "ours").exists()


def test_export_writes_shards_with_an_index_that_transformers_reads(tmp_path):
    """A small --max-shard-gb splits the export over several files with an index; the model
    args come from an HF folder's config (--model-config)."""
    reference = save_tiny("nemotron_h", tmp_path / "hf")
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    assert main(["export", str(tmp_path / "ours" / "checkpoint" / "step-0"),
                 str(tmp_path / "back"), "--model-config", str(tmp_path / "hf"),
                 "--max-shard-gb", str(20_000 / 2**30)]) == 0
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    again = transformers.NemotronHForCausalLM.from_pretrained(
        str(tmp_path / "back"), dtype=torch.float32, attn_implementation="eager").eval()
    assert torch.equal(logits_of(again), logits_of(reference))
    shutil.rmtree(tmp_path / "back")


@pytest.mark.parametrize("family", FAMILY_MATRIX)
def test_the_adapters_name_a_tensor_without_a_place_in_either_direction(family):
    """torchtitan's checkpointer hands the adapters plain state dicts, titan_hybrid's split
    ones: in both, a model tensor the format does not name, and an HF tensor the model has no
    place for, are errors naming it (nothing is dropped)."""
    from titan_hybrid.checkpoint.state import SplitModelWrapper
    from titan_hybrid.hf.families import family_of, hybrid_state_dict_adapter
    from titan_hybrid.model.common import tensor_parallel_layouts

    config_class, _, fields = FAMILIES[family]
    config = config_class(**fields).to_dict()
    args = family_of(config).model_args(config)
    model = build_model(args)
    for state_dict in (model.state_dict(),
                       SplitModelWrapper(model, tensor_parallel_layouts(model)).state_dict()):
        adapter = hybrid_state_dict_adapter(args, None)
        hf = adapter.to_hf(state_dict)
        assert adapter.from_hf(hf).keys() == state_dict.keys()
        with pytest.raises(ValueError, match=r"1 model tensor\(s\) with no place in the HF .*"
                                             r": layers.0.extra_scale"):
            adapter.to_hf({**state_dict, "layers.0.extra_scale": torch.ones(2)})
        with pytest.raises(ValueError, match=r"1 HF tensor\(s\) with no place in the model: "
                                             r"model.layers.0.extra"):
            adapter.from_hf({**hf, "model.layers.0.extra": torch.ones(2)})


@pytest.mark.parametrize("family", FAMILY_MATRIX)
def test_the_adapters_map_transformers_own_tensors_onto_the_models(tmp_path, family):
    """An HF state dict of transformers' own making (not a view of our model: an offline
    conversion, torchtitan's checkpointer) maps onto our tensors' values, whatever order the
    format keeps its rows in (Qwen3-Next's by key-head group)."""
    from titan_hybrid.checkpoint.split import ComponentChunks
    from titan_hybrid.checkpoint.state import SplitModelWrapper
    from titan_hybrid.hf.convert import load_hf_into
    from titan_hybrid.hf.families import hybrid_state_dict_adapter, model_args_from_hf
    from titan_hybrid.model.common import tensor_parallel_layouts

    save_tiny(family, tmp_path)
    args = model_args_from_hf(tmp_path)
    model = build_model(args)
    load_hf_into(model, tmp_path, print_fn=lambda line: None)
    ours = SplitModelWrapper(model, tensor_parallel_layouts(model)).state_dict()
    stored = load_file(str(tmp_path / "model.safetensors"))
    adapter = hybrid_state_dict_adapter(args, None)
    adapter.fit_to_file({key: tuple(value.shape) for key, value in stored.items()})
    theirs = adapter.from_hf(stored)
    assert theirs.keys() == ours.keys()
    for key, value in ours.items():
        if isinstance(value, ComponentChunks):
            (_, value), = value.chunks  # one process: the whole component
        assert torch.equal(theirs[key], value), key


def mtp_blocks(family: str, reference, folder: Path, prefix: str, **changes):
    """transformers' own blocks for an MTP depth: a model of the family with just those layers
    (`changes`), every parameter perturbed, the main model's head; and its layers' HF tensors
    as mtp.layers.N (`prefix`: the HF names' model prefix)."""
    blocks = perturbed(family, 2, **changes)
    with torch.no_grad():
        blocks.lm_head.weight.copy_(reference.lm_head.weight)
    blocks.save_pretrained(str(folder))
    return blocks, {key.replace(f"{prefix}layers.", "mtp.layers."): value
                    for key, value in load_file(str(folder / "model.safetensors")).items()
                    if key.startswith(f"{prefix}layers.")}


def add_to_hf_folder(folder: Path, tensors: dict, **config) -> None:
    """Tensors and config.json fields added to an HF folder."""
    weights = folder / "model.safetensors"
    save_file({**load_file(str(weights)), **tensors}, str(weights), metadata={"format": "pt"})
    config_file = folder / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **config}))


def exported_with_mtp(tmp_path: Path, mtp: dict, prefix: str = "mtp.") -> dict:
    """The export of the imported checkpoint writes every MTP tensor (those under `prefix`)
    back bit for bit, and transformers loads the folder (skipping them); its config.json."""
    assert main(["export", str(tmp_path / "ours" / "checkpoint"), str(tmp_path / "back"),
                 "--job", str(tmp_path / "ours" / "job.toml")]) == 0
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert {key for key in back if key.startswith(prefix)} == set(mtp)
    assert all(torch.equal(back[key], value) for key, value in mtp.items())
    transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"))
    return json.loads((tmp_path / "back" / "config.json").read_text())


def mtp_matches_transformers(tmp_path: Path, reference, blocks, final_norm, embedding,
                             norm_weights, eps: float, proj: torch.Tensor):
    """Import the HF folder; our logits and MTP logits equal transformers' main logits and
    those of its own blocks: `proj` on [norm(embedding of the next token) | norm(last hidden
    state after the final norm, as Megatron's and vLLM's MTP read it)], the two norms of
    `norm_weights`, then the blocks, their final norm and the head. The imported args."""
    import torch.nn.functional as F

    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    args, _ = model_args_of_job(tmp_path / "ours" / "job.toml")
    ours = build_model(args)
    load_checkpoint_into(ours, tmp_path / "ours" / "checkpoint" / "step-0")
    with torch.no_grad():
        logits, *rest = ours(tokens())
        hidden = []
        hook = final_norm.register_forward_hook(
            lambda module, inputs, output: hidden.append(output))
        main_logits = logits_of(reference)
        hook.remove()
        norms = [type(final_norm)(proj.shape[0], eps=eps) for _ in norm_weights]
        for norm, weight in zip(norms, norm_weights):
            norm.weight.copy_(weight)
        future = embedding(F.pad(tokens()[:, 1:], (0, 1)))
        inputs = F.linear(torch.cat((norms[0](future), norms[1](hidden[0])), -1), proj)
        theirs = blocks(inputs_embeds=inputs).logits
    assert relative_error(logits, main_logits) <= 1e-5
    error = relative_error(rest[-1], theirs)
    assert error <= 1e-5, error
    return args


def test_nemotron_mtp_layers_import_predict_and_export(tmp_path):
    """Nemotron 3's MTP layers, in Megatron-Bridge's and vLLM's names (transformers does not
    model them and skips mtp.* when it loads): an HF folder with one depth of an attention and
    a MoE layer imports into our MTP depth, whose logits equal those computed from the same
    tensors with transformers' own blocks (eh_proj on [enorm(embedding of the next token) |
    hnorm(last hidden state after the final norm, as in Megatron and vLLM)], the blocks,
    final_layernorm, the shared head), and the export writes every mtp.* tensor back bit for
    bit."""
    reference = save_tiny("nemotron_h_moe", tmp_path / "hf")
    blocks, mtp = mtp_blocks("nemotron_h_moe", reference, tmp_path / "blocks", "backbone.",
                             layers_block_type=["attention", "moe"])
    width = FAMILIES["nemotron_h_moe"][2]["hidden_size"]
    mtp["mtp.layers.1.final_layernorm.weight"] = blocks.model.norm_f.weight.detach().clone()
    enorm, hnorm = (1 + 0.1 * torch.randn(width) for _ in range(2))
    eh_proj = 0.1 * torch.randn(width, 2 * width)
    mtp.update({"mtp.layers.0.enorm.weight": enorm, "mtp.layers.0.hnorm.weight": hnorm,
                "mtp.layers.0.eh_proj.weight": eh_proj})
    add_to_hf_folder(tmp_path / "hf", mtp, num_nextn_predict_layers=1,
                     mtp_layers_block_type=["full_attention", "moe"])
    args = mtp_matches_transformers(tmp_path, reference, blocks, reference.model.norm_f,
                                    reference.model.embeddings, (enorm, hnorm),
                                    reference.config.layer_norm_epsilon, eh_proj)
    assert args.pattern.endswith("/*E")

    exported = exported_with_mtp(tmp_path, mtp)
    assert (exported["num_nextn_predict_layers"], exported["mtp_layers_block_type"]) == (
        1, ["attention", "moe"])


@pytest.mark.parametrize("family, count_field", [
    ("qwen3_next", "num_nextn_predict_layers"), ("qwen3_5", "mtp_num_hidden_layers")])
def test_qwen_mtp_layers_import_predict_and_export(tmp_path, family, count_field):
    """Qwen3-Next's and Qwen3.5's MTP, in vLLM's names (transformers skips mtp.*): an HF
    folder with `mtp.fc`, its two pre-fc norms, one decoder layer and `mtp.norm` imports into
    our MTP depth, whose logits equal those computed from the same tensors with transformers'
    own decoder layer (fc on [pre_fc_norm_embedding(embedding of the next token) |
    pre_fc_norm_hidden(last hidden state after the final norm, as in vLLM)], the layer,
    mtp.norm, the shared head; every norm scales by 1 + weight), and the export writes every
    mtp.* tensor back bit for bit."""
    reference = save_tiny(family, tmp_path / "hf")
    # transformers' decoder layer of the MTP: a one-layer model
    blocks, mtp = mtp_blocks(family, reference, tmp_path / "blocks", "model.",
                             num_hidden_layers=1, layer_types=["full_attention"],
                             mlp_only_layers=[])
    width = FAMILIES[family][2]["hidden_size"]
    norm_weights = [0.1 * torch.randn(width) for _ in range(2)]
    fc = 0.1 * torch.randn(width, 2 * width)
    mtp.update({"mtp.norm.weight": blocks.model.norm.weight.detach().clone(), "mtp.fc.weight": fc,
                "mtp.pre_fc_norm_embedding.weight": norm_weights[0],
                "mtp.pre_fc_norm_hidden.weight": norm_weights[1]})
    add_to_hf_folder(tmp_path / "hf", mtp, **{count_field: 1})
    mtp_matches_transformers(tmp_path, reference, blocks, reference.model.norm,
                             reference.model.embed_tokens, norm_weights,
                             reference.config.rms_norm_eps, fc)

    assert exported_with_mtp(tmp_path, mtp)[count_field] == 1


def test_the_trainer_refuses_to_write_an_hf_tensor_held_in_several_pieces(tmp_path):
    """DCP's HF writer keeps one piece of a tensor per rank and drops the others (measured on
    torch 2.13: of a 2-piece tensor, only one piece's rows were written): pieces that would
    not be gathered for writing (GatheredRows) are an error naming the tensor."""
    from titan_hybrid.checkpoint.split import ComponentChunks, GatheredRows, check_writable

    source = torch.arange(12.0).reshape(6, 2)
    two = ComponentChunks(torch.Size([6, 2]), [(torch.Size([0, 0]), source[3:]),
                                               (torch.Size([3, 0]), source[:3])], source)
    one = ComponentChunks(torch.Size([6, 2]), [(torch.Size([0, 0]), source)], source)
    gathered = GatheredRows(two, source, ((3, 3), (0, 3)), gather=True)
    check_writable({"one": one, "plain": source, "gathered": gathered})
    with pytest.raises(ValueError, match="HF tensor 'two' is 2 pieces on this rank"):
        check_writable({"one": one, "two": two})
    # Gathered, the same pieces are written whole.
    import torch.distributed.checkpoint as dcp
    dcp.save({"gathered": gathered},
             storage_writer=dcp.HuggingFaceStorageWriter(str(tmp_path)))
    written = load_file(str(next(tmp_path.glob("*.safetensors"))))["gathered"]
    assert torch.equal(written, torch.cat([source[3:], source[:3]]))


@pytest.mark.extended
@pytest.mark.once_per_ci  # the README's text: the same under every torch
def test_the_readme_commands_run_as_written(tmp_path):
    """The two command lines of docs/checkpoints_and_hf.md (the README's tour repeats the first),
    with their placeholders filled in: a transformers folder in, the imported checkpoint out
    again, loaded by transformers."""
    import re
    import shlex

    readme = "\n".join(path.read_text() for path in
                       [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))])
    lines = list(dict.fromkeys(
        line.strip() for block in re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
        for line in block.splitlines() if "-m titan_hybrid.hf " in line
        and not line.strip().startswith("#")))
    assert [shlex.split(line)[3] for line in lines] == ["import", "export"]
    reference = save_tiny("nemotron_h", tmp_path / "hf")
    places = {"HF_DIR": tmp_path / "hf", "OUT": tmp_path / "out", "HF_OUT": tmp_path / "back",
              "CHECKPOINT": tmp_path / "out" / "checkpoint"}
    for line in lines:
        words = [sys.executable if word == ".venv/bin/python" else word
                 for word in shlex.split(line)]
        words = [re.sub(r"^(HF_DIR|OUT|HF_OUT|CHECKPOINT)\b",
                        lambda match: str(places[match.group(1)]), word) for word in words]
        done = subprocess.run(words, cwd=REPO_ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
    again = transformers.NemotronHForCausalLM.from_pretrained(
        str(tmp_path / "back"), dtype=torch.float32, attn_implementation="eager").eval()
    assert torch.equal(logits_of(again), logits_of(reference))


# DSA (deepseek_v32) runs with 8 indexer heads (V3.2 has 64): with the tiny config's 2, a key
# often scores exactly 0 (every head's ReLU at 0), and which of the keys tied at the k-th score
# a top-k keeps is the implementation's choice, which changes with the row's length in
# torch.topk as in transformers' and DeepSeek's code (measured: one query row per layer tied
# at the k-th score, doc 2 of the packed row 0.12 apart from that document alone; with 8
# heads no tie, and 2e-7). The packed layout's own top-k is layout-independent (dsa.top_keys).
PACKED_CHANGES = {"deepseek_v32": {"index_n_heads": 8}}


@pytest.mark.parametrize("family", FAMILY_MATRIX)
def test_packed_documents_give_the_logits_of_each_document_alone(tmp_path, family):
    """Two documents packed in one row (our document masking: positions and document ids, as
    --hybrid.document_masking makes them) give transformers' logits for each document run
    alone. transformers' own packed-sequence handling is no reference on CPU: its Mamba2 /
    gated DeltaNet torch paths ignore document boundaries, and its attention with reset
    position_ids measured 0.4 apart from the documents alone."""
    reference = save_tiny(family, tmp_path / "hf", **PACKED_CHANGES.get(family, {}))
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    args, _ = model_args_of_job(tmp_path / "ours" / "job.toml")
    model = build_model(args)
    load_checkpoint_into(model, tmp_path / "ours" / "checkpoint" / "step-0")
    row, first = tokens()[:1], 12
    positions = torch.cat((torch.arange(first), torch.arange(SEQ - first)))[None]
    documents = (torch.arange(SEQ) >= first).to(torch.int32)[None]
    with torch.no_grad():
        packed = model(row, positions=positions, seq_idx=documents)
        packed = packed[0] if isinstance(packed, tuple) else packed
        alone = torch.cat((reference(row[:, :first]).logits, reference(row[:, first:]).logits), 1)
    error = relative_error(packed, alone)
    assert error <= 1e-5, error


@pytest.mark.parametrize("family, count_field", [
    ("qwen3_next", "num_nextn_predict_layers"), ("nemotron_h", "num_nextn_predict_layers")])
def test_a_config_declaring_mtp_layers_its_weights_lack_imports_without_them(
        tmp_path, family, count_field):
    """transformers models no MTP layer: its save_pretrained keeps a config's MTP fields (a
    fine-tuned Qwen3-Next's num_nextn_predict_layers: 1) but writes no mtp.* tensor. Such a
    folder imports as the model without MTP, with transformers' logits."""
    reference = save_tiny(family, tmp_path / "hf")
    add_to_hf_folder(tmp_path / "hf", {}, **{count_field: 1})
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    args, _ = model_args_of_job(tmp_path / "ours" / "job.toml")
    assert "/" not in args.pattern
    model = build_model(args)
    load_checkpoint_into(model, tmp_path / "ours" / "checkpoint" / "step-0")
    assert relative_error(logits_of(model), logits_of(reference)) <= 1e-5


def test_deepseek_mtp_layer_imports_predicts_and_exports(tmp_path, capsys):
    """DeepSeek-V3's MTP layer, decoder layer L after the L main ones (vLLM's and SGLang's
    names; transformers skips it): enorm, hnorm, eh_proj, the decoder layer, shared_head.norm,
    and copies of the embedding and the head. It imports into our MTP depth, whose logits
    equal those computed from the same tensors with transformers' own decoder layer; the export
    writes every tensor of it back bit for bit; a copy that differs from the model's tensor is
    an error naming it."""
    reference = save_tiny("deepseek_v3_moe", tmp_path / "hf")
    main_layers = FAMILIES["deepseek_v3_moe"][2]["num_hidden_layers"]
    blocks, layer = mtp_blocks("deepseek_v3_moe", reference, tmp_path / "blocks", "model.",
                               num_hidden_layers=1, first_k_dense_replace=0)
    hf = f"model.layers.{main_layers}."
    mtp = {key.replace("mtp.layers.0.", hf): value for key, value in layer.items()}
    width = FAMILIES["deepseek_v3_moe"][2]["hidden_size"]
    enorm, hnorm = (1 + 0.1 * torch.randn(width) for _ in range(2))
    eh_proj = 0.1 * torch.randn(width, 2 * width)
    mtp.update({hf + "enorm.weight": enorm, hf + "hnorm.weight": hnorm,
                hf + "eh_proj.weight": eh_proj,
                hf + "shared_head.norm.weight": blocks.model.norm.weight.detach().clone(),
                hf + "embed_tokens.weight": reference.model.embed_tokens.weight.detach().clone(),
                hf + "shared_head.head.weight": reference.lm_head.weight.detach().clone()})
    add_to_hf_folder(tmp_path / "hf", mtp, num_nextn_predict_layers=1)
    args = mtp_matches_transformers(tmp_path, reference, blocks, reference.model.norm,
                                    reference.model.embed_tokens, (enorm, hnorm),
                                    reference.config.rms_norm_eps, eh_proj)
    assert args.pattern.endswith("/+E")
    exported_with_mtp(tmp_path, mtp, prefix=hf)

    add_to_hf_folder(tmp_path / "hf", {hf + "embed_tokens.weight": torch.zeros(96, width)})
    capsys.readouterr()
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "again")]) == 2
    assert (f"HF tensor '{hf}embed_tokens.weight' differs from 'model.embed_tokens.weight'"
            in capsys.readouterr().err)
    assert not (tmp_path / "again").exists()


def test_bailing_hybrid_mtp_layer_imports_predicts_and_exports(tmp_path):
    """Ling 3.0's MTP layer, decoder layer L after the L main ones as vLLM's Bailing MTP reads
    it (transformers skips it): enorm, hnorm, eh_proj, an MLA layer with its MoE, and
    final_layernorm before the shared head. It imports into our MTP depth `/+E`, whose logits
    equal those computed from the same tensors with transformers' own decoder layer; the
    export writes every tensor of it back bit for bit."""
    reference = save_tiny("bailing_hybrid", tmp_path / "hf")
    main_layers = FAMILIES["bailing_hybrid"][2]["num_hidden_layers"]
    blocks, layer = mtp_blocks("bailing_hybrid", reference, tmp_path / "blocks", "model.",
                               num_hidden_layers=1, layer_types=["full_attention"],
                               mlp_layer_types=["sparse"], first_k_dense_replace=0)
    hf = f"model.layers.{main_layers}."
    mtp = {key.replace("mtp.layers.0.", hf): value for key, value in layer.items()}
    width = FAMILIES["bailing_hybrid"][2]["hidden_size"]
    enorm, hnorm = (1 + 0.1 * torch.randn(width) for _ in range(2))
    eh_proj = 0.1 * torch.randn(width, 2 * width)
    mtp.update({hf + "enorm.weight": enorm, hf + "hnorm.weight": hnorm,
                hf + "eh_proj.weight": eh_proj,
                hf + "final_layernorm.weight": blocks.model.norm.weight.detach().clone()})
    add_to_hf_folder(tmp_path / "hf", mtp, num_nextn_predict_layers=1)
    args = mtp_matches_transformers(tmp_path, reference, blocks, reference.model.norm,
                                    reference.model.embed_tokens, (enorm, hnorm),
                                    reference.config.rms_norm_eps, eh_proj)
    assert args.pattern.endswith("/+E")
    exported_with_mtp(tmp_path, mtp, prefix=hf)


def test_a_copy_is_compared_bit_for_bit():
    """A copy is the same bits as its original: NaNs copied (uninitialized memory holds them)
    are equal, and a -0.0 for a 0.0 or another dtype is a difference."""
    from titan_hybrid.hf.key_map_parts import SharedCopy, check_copy

    copy = SharedCopy(key="tok_embeddings.weight", original="a")
    original = torch.tensor([[float("nan"), 0.0], [1.0, 2.0]])
    check_copy({"a": original, "b": original.clone()}, "b", copy)
    for differing in (torch.tensor([[float("nan"), -0.0], [1.0, 2.0]]), original.double()):
        with pytest.raises(ValueError, match="HF tensor 'b' differs from 'a'"):
            check_copy({"a": original, "b": differing}, "b", copy)


def test_a_released_lfm2_config_is_read_in_its_own_field_names():
    """LFM2-1.2B's config.json names fields as Liquid AI's code did (tie_embedding,
    block_ff_dim, full_attn_idxs, a top-level rope_theta); transformers' Lfm2Config reads
    them so, and so do we: its MLP is 8192 wide (2/3 of block_ff_dim, rounded to 256), six of
    its 16 layers are attention, and its head is tied to the embedding."""
    from titan_hybrid.hf.families import FAMILIES as HF_FAMILIES

    config = {"model_type": "lfm2", "architectures": ["Lfm2ForCausalLM"], "vocab_size": 65536,
              "hidden_size": 2048, "block_ff_dim": 12288, "block_auto_adjust_ff_dim": True,
              "block_ffn_dim_multiplier": 1.0, "block_multiple_of": 256,
              "num_hidden_layers": 16, "full_attn_idxs": [2, 5, 8, 10, 12, 14],
              "num_attention_heads": 32, "num_key_value_heads": 8, "norm_eps": 1e-5,
              "rope_theta": 1000000.0, "conv_L_cache": 3, "conv_bias": False,
              "tie_embedding": True, "max_position_embeddings": 128000}
    theirs = transformers.Lfm2Config(**{k: v for k, v in config.items() if k != "model_type"})
    args = HF_FAMILIES["lfm2"].model_args(config)
    assert args.mlp.hidden_dim == 8192 == transformers.models.lfm2.modeling_lfm2.Lfm2MLP(
        theirs).w1.out_features
    mixers = args.parsed_pattern.physical_layer_symbols()[0::2]
    assert ["full_attention" if s == "*" else "conv" for s in mixers] == theirs.layer_types
    assert args.enable_weight_tying and theirs.tie_word_embeddings
    assert (args.attention.rope_theta, args.attention.n_kv_heads, args.short_conv.conv_width,
            args.dim // args.attention.n_heads) == (1e6, 8, 3, 64)


def test_lfm2_moe_routing_renormalises_with_its_epsilon():
    """lfm2_moe's router adds 1e-6 to the chosen scores' sum (moe.norm_topk_eps): on tokens
    whose sigmoid scores are about 1e-6, where the epsilon is half the weight, our weights
    equal Lfm2MoeTopKRouter's in float64, and DeepSeek's 1e-20 would not."""
    import dataclasses

    from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeTopKRouter

    from titan_hybrid.hf.families import FAMILIES as HF_FAMILIES
    from titan_hybrid.model.moe import expert_weights, router_scores

    config = transformers.Lfm2MoeConfig(hidden_size=8, num_experts=8, num_experts_per_tok=2,
                                        routed_scaling_factor=2.5)
    router = Lfm2MoeTopKRouter(config).double()
    torch.manual_seed(0)
    with torch.no_grad():  # logits -14 + N(0, 1): sigmoid scores about 1e-6
        router.weight.normal_()
        router.weight[:, 0] = -14.0
    bias = 0.1 * torch.randn(8, dtype=torch.float64)
    x = torch.cat((torch.ones(16, 1), torch.randn(16, 7)), 1).double()
    _, theirs, chosen = router(x, bias)
    args = HF_FAMILIES["lfm2"].model_args({
        "model_type": "lfm2_moe", "vocab_size": 96, "hidden_size": 8, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_dense_layers": 0, "num_experts": 8,
        "num_experts_per_tok": 2, "routed_scaling_factor": 2.5}).moe
    scores = router_scores(x @ router.weight.T, args.score_func)
    ours = expert_weights(scores, chosen, args)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=0)
    deepseek = expert_weights(scores, chosen, dataclasses.replace(args, norm_topk_eps=1e-20))
    assert not torch.allclose(deepseek, theirs, rtol=1e-3)


@pytest.mark.parametrize("section, field, value", [
    ("attention", "key_multiplier", 0.5), ("mamba", "gated_norm", False),
    ("mamba", "in_proj_multipliers", (1.0, 2.0, 1.0, 1.0, 1.0)), ("mlp", "down_multiplier", 2.0),
    (None, "lm_head_multiplier", 0.25)])
def test_falcon_h1s_options_are_never_dropped_by_another_format(section, field, value):
    """A model with one of Falcon-H1's options (its µP multipliers, Mamba2 without the gated
    norm) in another HF format (the debug flavor's, Nemotron-H's) is refused, naming it."""
    import dataclasses

    from titan_hybrid.hf.families import check_hf_compatible
    from titan_hybrid.model.args import resolve_model_args

    args = resolve_model_args("debug_nemotron_h", seq_len=64)
    if section is None:
        args = dataclasses.replace(args, **{field: value})
    else:
        setattr(args, section, dataclasses.replace(getattr(args, section), **{field: value}))
    name = field if section is None else f"{section}.{field}"
    with pytest.raises(ValueError, match=rf"^{re.escape(name)}=.* is held only by the "
                                         "Falcon-H1 format, and this model's HF format is "
                                         "nemotron_h"):
        check_hf_compatible(args)


def test_jamba_places_attention_and_moe_layers_by_their_periods():
    """Jamba's attn_layer_period / offset and expert_layer_period / offset become the pattern
    and come back from it (transformers' own layers_block_type and layers_num_experts read
    them); a pattern whose attention layers do not recur with one period is refused by name."""
    import dataclasses

    from titan_hybrid.hf.jamba import jamba_config, model_args_from_jamba_config, period_of

    assert period_of([False, False, True, False, False, False, True, False]) == (4, 2)
    assert period_of([False, True] * 3) == (2, 1)
    assert period_of([True] * 3) == (1, 0)
    assert period_of([False] * 3) == (4, 3)
    assert period_of([True, False, False, True, True]) is None
    released = transformers.JambaConfig(num_hidden_layers=16, num_experts=16)  # Jamba v0.1's
    args = model_args_from_jamba_config(released.to_dict())
    assert args.pattern == "M-MEM-ME*-MEM-MEM-MEM-ME*-MEM-ME"
    written = transformers.JambaConfig(**jamba_config(args))
    assert written.layers_block_type == released.layers_block_type
    assert written.layers_num_experts == released.layers_num_experts
    with pytest.raises(ValueError, match=r"hybrid.pattern 'M-\*-\*-M-': its attention layers "
                                         "do not recur with one period"):
        jamba_config(dataclasses.replace(args, pattern="M-*-*-M-"))

"""Hugging Face DeepSeek-V3 / V3.2 interop for models whose layers pair up as DeepSeek's dense
decoder layers: patterns `+-+-...` (DeepseekV3ForCausalLM) or `D-D-...` (DeepseekV32ForCausalLM),
SwiGLU MLPs, no MTP. The state-dict adapter of `--checkpoint.initial_load_in_hf` /
`--checkpoint.last_save_in_hf` for such models (hf_formats.py picks it by the layer kinds),
offline conversion of full (unsharded) state dicts, and config.json.

HF decoder layer j is our layers 2j (`input_layernorm`, `self_attn.*`: the MLA / DSA layer,
whose parameter names are transformers' already) and 2j + 1 (`post_attention_layernorm`,
`mlp.gate_proj` / `up_proj` = the halves of our fused fc1, `mlp.down_proj` = fc2). DeepSeek's
MoE layers (group-limited sigmoid routing, routed scaling) are not our `E`, so patterns with
`E` are refused by name, as is everything else the format cannot hold.
"""

from __future__ import annotations

import dataclasses

import torch

from titan_hybrid.checkpoint.hf_adapter import (
    HFStateDictAdapter,
    check_all_used,
    check_present,
    held_layers,
    whole_fused,
)
from titan_hybrid.checkpoint.state import logical_keys, physical_keys
from titan_hybrid.model.args import HybridModelArgs
from titan_hybrid.model.dsa import KIND as DSA
from titan_hybrid.model.layer_kind import LayerKind
from titan_hybrid.model.layer_kinds import LAYER_KINDS
from titan_hybrid.model.mla import KIND as MLA
from titan_hybrid.model.mlp import KIND as MLP

# (architecture, model_type) of the decoder layer's attention kind: MLA or DSA, by kind name.
ARCHITECTURES = {MLA.name: ("DeepseekV3ForCausalLM", "deepseek_v3"),
                 DSA.name: ("DeepseekV32ForCausalLM", "deepseek_v32")}
ATTENTION_KINDS = [kind for kind in LAYER_KINDS.values() if kind.name in ARCHITECTURES]


def check_deepseek_compatible(args: HybridModelArgs) -> LayerKind:
    """The attention kind (MLA or DSA) of a model the format can hold; ValueError naming
    the first field it cannot."""
    pattern = args.parsed_pattern
    symbols = pattern.physical_layer_symbols()
    attention = LAYER_KINDS[symbols[0]] if symbols else None
    problems = []
    if (attention is None or attention.name not in ARCHITECTURES or len(symbols) % 2
            or symbols != [attention.symbol, MLP.symbol] * (len(symbols) // 2)):
        decoder_layers = " or ".join(f"'{kind.symbol}{MLP.symbol}'" for kind in ATTENTION_KINDS)
        problems.append(f"hybrid.pattern '{args.pattern}' must be {decoder_layers} repeated "
                        "(DeepSeek's dense decoder layers)")
    if any(isinstance(item, tuple) for item in pattern.main):
        problems.append(f"hybrid.pattern '{args.pattern}' has bracket groups")
    if pattern.mtp_depths:
        problems.append(f"hybrid.pattern '{args.pattern}' has MTP depths")
    if args.mlp.activation != "swiglu":
        problems.append(f"mlp.activation='{args.mlp.activation}' must be 'swiglu'")
    if problems:
        raise ValueError("model cannot use the HF DeepSeek-V3 / V3.2 format: " + "; ".join(problems))
    return attention


def _attention_parameter_names(args: HybridModelArgs, kind: LayerKind) -> list[str]:
    with torch.device("meta"):
        layer = kind.build(args.section(kind), args.dim, args.norm_eps)
    return list(layer.state_dict())


def _key_map(args: HybridModelArgs) -> dict[str, str]:
    """HF key -> our key; the MLP's gate / up halves map to our fc1 with a suffix _w / _v."""
    kind = check_deepseek_compatible(args)
    name = kind.name
    mapping = {"model.embed_tokens.weight": "tok_embeddings.weight",
               "model.norm.weight": "norm.weight", "lm_head.weight": "output.weight"}
    attention_names = _attention_parameter_names(args, kind)
    for j in range(args.parsed_pattern.num_physical_layers // 2):
        hf, mixer, mlp = f"model.layers.{j}.", f"layers.{2 * j}.", f"layers.{2 * j + 1}."
        mapping[hf + "input_layernorm.weight"] = f"{mixer}{name}_norm.weight"
        for parameter in attention_names:
            mapping[f"{hf}self_attn.{parameter}"] = f"{mixer}{name}.{parameter}"
        mapping[hf + "post_attention_layernorm.weight"] = f"{mlp}mlp_norm.weight"
        mapping[hf + "mlp.gate_proj.weight"] = f"{mlp}mlp.fc1.weight_w"
        mapping[hf + "mlp.up_proj.weight"] = f"{mlp}mlp.fc1.weight_v"
        mapping[hf + "mlp.down_proj.weight"] = f"{mlp}mlp.fc2.weight"
    return mapping


class DeepSeekStateDictAdapter(HFStateDictAdapter):
    """The adapter sees SplitModelWrapper's state dict, where the fused fc1 is already its
    components `fc1.weight_w` / `_v` in global coordinates: DeepSeek's gate_proj / up_proj as
    they are. No MLA / DSA parameter is fused, so every HF tensor is one entry of ours under
    another key: each rank writes or reads the pieces it holds under any TP / FSDP layout,
    nothing is gathered, and a load lands in the very entries `to_hf` handed out."""

    FORMAT_NAME = "DeepSeek-V3 / V3.2"

    def __init__(self, model_args: HybridModelArgs, hf_assets_path: str | None) -> None:
        super().__init__(model_args, hf_assets_path)
        # In a plain state dict (torchtitan's own checkpointer) fc1 is whole: the fused keys
        # whose gate / up halves to_hf handed out, for from_hf to join them again.
        self._halved: set[str] = set()

    def to_hf(self, state_dict: dict) -> dict:
        """Split state dicts (titan_hybrid's manager: fc1's halves `fc1.weight_w` / `_v`) and
        plain ones (fc1 whole, halved here; without TP its rows are gate then up); ValueError
        names an HF tensor of a held layer with no source."""
        hf_state_dict, self._halved = {}, set()
        state_dict, self._physical = logical_keys(state_dict)  # a plain one's grouped layers
        layers = held_layers(state_dict)
        used: set[str] = set()
        for hf_key, ours in _key_map(self.model_args).items():
            if ours in state_dict:
                hf_state_dict[hf_key] = state_dict[ours]
                used.add(ours)
                continue
            half = ours.endswith(("fc1.weight_w", "fc1.weight_v"))
            whole = whole_fused(state_dict, ours[:-2], hf_key) if half else None
            if whole is None:
                check_present(state_dict, ours, hf_key, layers)
                continue
            hf_state_dict[hf_key] = whole.chunk(2, dim=0)[0 if ours.endswith("_w") else 1]
            self._halved.add(ours[:-2])
            used.add(ours[:-2])
        check_all_used(state_dict, used, "model tensor(s)", "HF DeepSeek-V3 / V3.2 format")
        return hf_state_dict

    def from_hf(self, hf_state_dict: dict) -> dict:
        key_map = _key_map(self.model_args)
        check_all_used(hf_state_dict, set(key_map), "HF tensor(s)", "model")
        state_dict = {ours: hf_state_dict[hf_key] for hf_key, ours in key_map.items()
                      if hf_key in hf_state_dict}
        for fused_key in self._halved:
            state_dict[fused_key] = torch.cat((state_dict.pop(fused_key + "_w"),
                                               state_dict.pop(fused_key + "_v")))
        return physical_keys(state_dict, self._physical)


def to_deepseek(state_dict: dict[str, torch.Tensor], args: HybridModelArgs) -> dict:
    """Our model's state dict (fused fc1) -> DeepSeek's keys."""
    out = {}
    for hf_key, ours in _key_map(args).items():
        if ours.endswith(("fc1.weight_w", "fc1.weight_v")):
            gate, up = state_dict[ours[:-2]].chunk(2, dim=0)
            out[hf_key] = gate if ours.endswith("_w") else up
        else:
            out[hf_key] = state_dict[ours]
    return out


def from_deepseek(hf_state_dict: dict[str, torch.Tensor], args: HybridModelArgs) -> dict:
    """DeepSeek's keys -> our model's state dict; a missing key is a ValueError naming it."""
    mapping = _key_map(args)
    missing = [key for key in mapping if key not in hf_state_dict]
    if missing:
        raise ValueError(f"DeepSeek checkpoint lacks {len(missing)} tensors of this model, "
                         f"e.g. {missing[0]!r}")
    out = {ours: hf_state_dict[hf_key] for hf_key, ours in mapping.items()
           if not ours.endswith(("fc1.weight_w", "fc1.weight_v"))}
    for hf_key, ours in mapping.items():
        if ours.endswith("fc1.weight_w"):
            up_key = hf_key.replace("gate_proj", "up_proj")
            out[ours[:-2]] = torch.cat((hf_state_dict[hf_key], hf_state_dict[up_key]))
    return out


def deepseek_config(args: HybridModelArgs) -> dict:
    """The config.json transformers' DeepseekV3ForCausalLM / DeepseekV32ForCausalLM needs."""
    kind = check_deepseek_compatible(args)
    architecture, model_type = ARCHITECTURES[kind.name]
    mla = args.section(kind)
    rope = {"rope_type": "default", "rope_theta": mla.rope_theta}
    if mla.yarn_factor != 1.0:
        rope.update(rope_type="yarn", factor=mla.yarn_factor,
                    original_max_position_embeddings=mla.yarn_original_max_position_embeddings,
                    beta_fast=mla.yarn_beta_fast, beta_slow=mla.yarn_beta_slow,
                    mscale=mla.yarn_mscale, mscale_all_dim=mla.yarn_mscale_all_dim)
    num_layers = args.parsed_pattern.num_physical_layers // 2
    config = {
        "architectures": [architecture], "model_type": model_type,
        "vocab_size": args.vocab_size, "hidden_size": args.dim,
        "intermediate_size": args.mlp.hidden_dim, "num_hidden_layers": num_layers,
        "first_k_dense_replace": num_layers,  # every MLP dense
        "num_attention_heads": mla.n_heads, "num_key_value_heads": mla.n_heads,
        "q_lora_rank": mla.q_lora_rank, "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim, "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim, "rms_norm_eps": args.norm_eps, "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len, "rope_parameters": rope,
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
    }
    if kind is MLA:
        config["rope_interleave"] = mla.rope_interleave
    else:
        if not mla.rope_interleave:
            raise ValueError("dsa.rope_interleave=False: DeepSeek-V3.2 rotates interleaved pairs")
        config.update(index_n_heads=mla.index_n_heads, index_head_dim=mla.index_head_dim,
                      index_topk=mla.index_topk)
    return config


def model_args_from_deepseek_config(config: dict) -> HybridModelArgs:
    """HybridModelArgs for a DeepSeek-V3 / V3.2 config.json whose layers are all dense (MLA or
    DSA attention, SwiGLU MLP); ValueError naming the first setting the format cannot hold."""
    num_layers = config["num_hidden_layers"]
    dense = config.get("first_k_dense_replace", num_layers)
    if dense < num_layers and config.get("n_routed_experts"):
        raise ValueError(
            f"first_k_dense_replace={dense} < num_hidden_layers={num_layers}: DeepSeek's MoE "
            "layers (group-limited sigmoid routing with a bias, routed scaling) are not "
            "titan_hybrid's E yet; only dense DeepSeek models convert")
    for field, expected in (("hidden_act", "silu"), ("tie_word_embeddings", False),
                            ("attention_bias", False)):
        if config.get(field, expected) != expected:
            raise ValueError(f"{field}={config[field]!r} is not supported (expected "
                             f"{expected!r})")
    heads = config["num_attention_heads"]
    if config.get("num_key_value_heads", heads) != heads:
        raise ValueError(f"num_key_value_heads={config['num_key_value_heads']} must equal "
                         f"num_attention_heads={heads} (MLA shares one latent per head)")
    rope = config.get("rope_parameters") or {"rope_type": "default",
                                             "rope_theta": config.get("rope_theta", 10000.0)}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"rope_parameters.rope_type={rope_type!r} is not supported "
                         "(default or yarn)")
    kind = DSA if config["model_type"] == "deepseek_v32" else MLA
    section = dict(n_heads=heads, q_lora_rank=config.get("q_lora_rank"),
                   kv_lora_rank=config["kv_lora_rank"],
                   qk_nope_head_dim=config["qk_nope_head_dim"],
                   qk_rope_head_dim=config["qk_rope_head_dim"],
                   v_head_dim=config["v_head_dim"], rope_theta=rope.get("rope_theta", 10000.0),
                   rope_interleave=config.get("rope_interleave", True))
    if rope_type == "yarn":
        section.update(yarn_factor=rope["factor"],
                       yarn_original_max_position_embeddings=rope[
                           "original_max_position_embeddings"],
                       yarn_beta_fast=rope.get("beta_fast", 32.0),
                       yarn_beta_slow=rope.get("beta_slow", 1.0),
                       yarn_mscale=rope.get("mscale", 1.0),
                       yarn_mscale_all_dim=rope.get("mscale_all_dim", 0.0))
    if kind is DSA:
        section.update(index_n_heads=config["index_n_heads"],
                       index_head_dim=config["index_head_dim"], index_topk=config["index_topk"])
    base = HybridModelArgs()
    return dataclasses.replace(
        base, hf_format="deepseek", pattern=(kind.symbol + MLP.symbol) * num_layers,
        dim=config["hidden_size"],
        vocab_size=config["vocab_size"], norm_eps=config.get("rms_norm_eps", 1e-6),
        max_seq_len=config.get("max_position_embeddings", base.max_seq_len),
        mlp=dataclasses.replace(base.mlp, hidden_dim=config["intermediate_size"],
                                activation="swiglu"),
        **{kind.name: dataclasses.replace(base.section(kind), **section)})

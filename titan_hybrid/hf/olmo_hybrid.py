"""Hugging Face OLMo Hybrid interop (`transformers`' `olmo_hybrid`): gated DeltaNet decoder
layers (pre-norm) and attention decoder layers (post-norm: h + norm(attention(h)), then
h + norm(mlp(h))), each with a SwiGLU MLP. Patterns of `G-` / `*-` pairs with
`post_norm_mixers = "*"`.

HF decoder layer j is our layers 2j (the mixer) and 2j + 1 (the MLP). The attention has no
output gate; its q / k norms run across all heads (`attention.qk_norm_scope = "projection"`),
and its rotary embedding, when it has one, rotates whole heads by rotate-half pairs. The gated
DeltaNet's projections and its three convolutions are our in_proj's and conv1d's components;
its beta is 2 sigmoid(b) (`gdn.allow_neg_eigval`) and its output norm's epsilon is 1e-5.

The files come in two variants, and a read takes the one of its file
(`olmo_hybrid_file_key_map`); an export writes the published one, which transformers reads too:
- published: the attention layers' norms `post_attention_layernorm` /
  `post_feedforward_layernorm`, and the convolutions [key_dim | key_dim | value_dim] rows;
- transformers 5.24's `save_pretrained`: it renames every `post_attention_layernorm` to
  `feedforward_layer_norm`, and cuts the fused convolution into three equal parts.
Either way the three convolutions, end to end, are our conv1d's [query | key | value] rows.
"""

from __future__ import annotations

import dataclasses

from titan_hybrid.hf.engine import KeyMap, RowPieces, Shapes
from titan_hybrid.hf.family import Family
from titan_hybrid.hf.key_map_parts import attention_problems
from titan_hybrid.hf.vocabulary import llama_attention, swiglu_mlp
from titan_hybrid.model import attention, gdn, mlp
from titan_hybrid.model.args import AttentionArgs, GDNArgs, HybridModelArgs, MLPArgs

FORMAT = "olmo_hybrid"
NAME = "OLMo Hybrid"
DELTA_RULE_NORM_EPS = 1e-5  # OlmoHybridGatedDeltaNet's o_norm, whatever rms_norm_eps is
ATTENTION = dict(qk_norm=True, qk_norm_scope="projection", qk_norm_zero_centered=False,
                 output_gate=False, rope_interleave=False, rotary_fraction=1.0,
                 softmax_scale=None)
MIXERS = (gdn.KIND.symbol, attention.KIND.symbol)
CONVS = ("q_conv1d", "k_conv1d", "v_conv1d")


def check_olmo_hybrid_compatible(args: HybridModelArgs) -> None:
    """ValueError naming the first field the HF OLMo Hybrid format cannot represent."""
    pattern = args.parsed_pattern
    symbols = pattern.physical_layer_symbols()
    problems = []
    if (not symbols or len(symbols) % 2 or any(s not in MIXERS for s in symbols[0::2])
            or any(s != mlp.KIND.symbol for s in symbols[1::2])):
        problems.append(f"hybrid.pattern '{args.pattern}' must be 'G' / '*' layers each "
                        "followed by an MLP ('-')")
    if any(isinstance(item, tuple) for item in pattern.main) or pattern.mtp_depths:
        problems.append(f"hybrid.pattern '{args.pattern}' has bracket groups or MTP depths")
    if args.post_norm_mixers != attention.KIND.symbol:
        problems.append(f"post_norm_mixers='{args.post_norm_mixers}': OLMo Hybrid's attention "
                        "layers are post-norm, its gated DeltaNet layers pre-norm ('*')")
    if args.norm_zero_centered or args.mlp.activation != "swiglu":
        problems.append("norms must scale by their weight and the MLP must be SwiGLU")
    if attention.KIND.symbol in symbols:
        problems += attention_problems(args, ATTENTION, NAME)
    if gdn.KIND.symbol in symbols and args.gdn.norm_eps != DELTA_RULE_NORM_EPS:
        problems.append(f"gdn.norm_eps={args.gdn.norm_eps} must be {DELTA_RULE_NORM_EPS}")
    if problems:
        raise ValueError(f"model cannot use the HF {NAME} format: " + "; ".join(problems))


def published_conv_rows(args: HybridModelArgs) -> tuple[int, int, int]:
    """The rows of q_conv1d, k_conv1d and v_conv1d in the published files: [key_dim |
    key_dim | value_dim], our conv1d's components."""
    delta = args.gdn
    key_dim = delta.n_key_heads * delta.key_head_dim
    return key_dim, key_dim, delta.n_value_heads * delta.value_head_dim


def olmo_hybrid_key_map(args: HybridModelArgs, *, saved_by_transformers: bool = False,
                        conv_rows: tuple[int, ...] | None = None) -> KeyMap:
    """HF key -> ours, in the published variant (what an export writes) or, with
    `saved_by_transformers`, transformers' (the module docstring); `conv_rows`: the rows of
    the three convolutions in the file (the published ones when None)."""
    check_olmo_hybrid_compatible(args)
    conv_rows = conv_rows or published_conv_rows(args)
    mapping: KeyMap = {"model.embed_tokens.weight": "tok_embeddings.weight",
                       "model.norm.weight": "norm.weight", "lm_head.weight": "output.weight"}
    symbols = args.parsed_pattern.physical_layer_symbols()
    post_attention = ("feedforward_layer_norm" if saved_by_transformers
                      else "post_attention_layernorm")
    for j in range(len(symbols) // 2):
        hf, mixer, ffn = f"model.layers.{j}.", f"layers.{2 * j}.", f"layers.{2 * j + 1}."
        mapping.update(swiglu_mlp(f"{hf}mlp.", f"{ffn}mlp."))
        if symbols[2 * j] == attention.KIND.symbol:
            mapping[f"{hf}{post_attention}.weight"] = f"{mixer}attention_norm.weight"
            mapping[f"{hf}post_feedforward_layernorm.weight"] = f"{ffn}mlp_norm.weight"
            mapping.update(llama_attention(f"{hf}self_attn.", f"{mixer}attention.",
                                           qk_norm=True))
            continue
        mapping[f"{hf}attention_layer_norm.weight"] = f"{mixer}gdn_norm.weight"
        mapping[f"{hf}feedforward_layer_norm.weight"] = f"{ffn}mlp_norm.weight"
        module, ours = f"{hf}linear_attn.", f"{mixer}gdn."
        in_proj = f"{ours}in_proj.weight"
        for theirs, part in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value"),
                             ("g_proj", "z"), ("b_proj", "beta"), ("a_proj", "alpha")):
            mapping[f"{module}{theirs}.weight"] = f"{in_proj}.{part}"
        mapping.update(_convolutions(args, module, f"{ours}conv1d.weight", conv_rows))
        for theirs, name in (("A_log", "A_log"), ("dt_bias", "dt_bias"),
                             ("o_norm.weight", "norm.weight"),
                             ("o_proj.weight", "out_proj.weight")):
            mapping[module + theirs] = ours + name
    return mapping


def olmo_hybrid_file_key_map(args: HybridModelArgs, stored: Shapes) -> KeyMap:
    """The key map of the variant of a file whose tensors have these shapes."""
    saved_by_transformers = any(
        key.endswith(".feedforward_layer_norm.weight")
        and key.replace("feedforward_layer_norm", "post_feedforward_layernorm") in stored
        for key in stored)
    conv_rows = published_conv_rows(args)
    convs = next((key[:-len("q_conv1d.weight")] for key in stored
                  if key.endswith("linear_attn.q_conv1d.weight")), None)
    if convs is not None:
        rows = tuple(stored.get(f"{convs}{conv}.weight", (0,))[0] for conv in CONVS)
        if sum(rows) == sum(conv_rows):  # else the shape check names the tensors
            conv_rows = rows
    return olmo_hybrid_key_map(args, saved_by_transformers=saved_by_transformers,
                               conv_rows=conv_rows)


def _convolutions(args: HybridModelArgs, module: str, conv: str,
                  conv_rows: tuple[int, ...]) -> KeyMap:
    """q_conv1d / k_conv1d / v_conv1d as runs of our conv1d's [query | key | value] rows,
    cut where the file cuts them (`conv_rows`)."""
    components = tuple(zip((f"{conv}.query", f"{conv}.key", f"{conv}.value"),
                           published_conv_rows(args)))
    mapping, row = {}, 0
    for name, count in zip(CONVS, conv_rows):
        pieces, start = [], 0
        for key, size in components:  # each component's share of rows [row, row + count)
            lo, hi = max(row, start), min(row + count, start + size)
            if lo < hi:
                pieces.append((key, lo - start, hi - lo))
            start += size
        whole = len(pieces) == 1 and dict(components)[pieces[0][0]] == count
        mapping[f"{module}{name}.weight"] = pieces[0][0] if whole else RowPieces(
            tuple(pieces))
        row += count
    return mapping


def olmo_hybrid_config(args: HybridModelArgs) -> dict:
    """The config.json a `transformers` OlmoHybridForCausalLM needs."""
    check_olmo_hybrid_compatible(args)
    symbols = args.parsed_pattern.physical_layer_symbols()
    heads, delta = args.attention, args.gdn
    return {
        "architectures": ["OlmoHybridForCausalLM"], "model_type": FORMAT,
        "vocab_size": args.vocab_size, "hidden_size": args.dim,
        "intermediate_size": args.mlp.hidden_dim, "num_hidden_layers": len(symbols) // 2,
        "layer_types": ["full_attention" if s == attention.KIND.symbol else "linear_attention"
                        for s in symbols[0::2]],
        "num_attention_heads": heads.n_heads, "num_key_value_heads": heads.n_kv_heads,
        "hidden_act": "silu", "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "attention_bias": False,
        # rope_theta null: no rotary embedding (transformers reads NoPE only this way)
        "rope_parameters": {"rope_type": "default",
                            "rope_theta": heads.rope_theta if heads.use_rope else None},
        "linear_num_key_heads": delta.n_key_heads, "linear_num_value_heads": delta.n_value_heads,
        "linear_key_head_dim": delta.key_head_dim, "linear_value_head_dim": delta.value_head_dim,
        "linear_conv_kernel_dim": delta.conv_width,
        "linear_allow_neg_eigval": delta.allow_neg_eigval,
        # The class's defaults are the OLMo tokenizer's ids, outside a smaller vocabulary; the
        # exported tokenizer's files name its special tokens.
        "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
    }


def model_args_from_olmo_hybrid_config(config: dict) -> HybridModelArgs:
    """HybridModelArgs for an HF OLMo Hybrid config.json; ValueError naming the first setting
    the format cannot hold."""
    for field, expected in (("hidden_act", "silu"), ("attention_bias", False)):
        if config.get(field, expected) != expected:
            raise ValueError(f"{field}={config[field]!r} is not supported (expected "
                             f"{expected!r})")
    dim, heads = config["hidden_size"], config["num_attention_heads"]
    layers = config["num_hidden_layers"]
    types = config.get("layer_types") or ["full_attention" if i % 4 == 3 else "linear_attention"
                                          for i in range(layers)]
    unknown = sorted(set(types) - {"full_attention", "linear_attention"})
    if unknown:
        raise ValueError(f"layer_types has {unknown}: the supported layer types are "
                         "full_attention, linear_attention")
    rope = config.get("rope_parameters") or {"rope_theta": 10000.0}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters.rope_type={rope['rope_type']!r} is not supported "
                         "(default)")
    key_heads = config.get("linear_num_key_heads") or heads
    key_dim = config.get("linear_key_head_dim") or int(0.75 * dim / key_heads)
    base = HybridModelArgs()
    return dataclasses.replace(
        base, hf_format=FORMAT, post_norm_mixers=attention.KIND.symbol,
        pattern="".join((attention.KIND.symbol if kind == "full_attention" else gdn.KIND.symbol)
                        + mlp.KIND.symbol for kind in types),
        dim=dim, vocab_size=config["vocab_size"], norm_eps=config.get("rms_norm_eps", 1e-6),
        max_seq_len=config.get("max_position_embeddings", base.max_seq_len),
        attention=AttentionArgs(
            n_heads=heads, n_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or dim // heads,
            use_rope=rope.get("rope_theta") is not None,
            rope_theta=rope.get("rope_theta") or 10000.0, **ATTENTION),
        gdn=GDNArgs(key_head_dim=key_dim,
                    value_head_dim=config.get("linear_value_head_dim") or 2 * key_dim,
                    n_key_heads=key_heads,
                    n_value_heads=config.get("linear_num_value_heads") or heads,
                    conv_width=config.get("linear_conv_kernel_dim", 4),
                    allow_neg_eigval=config.get("linear_allow_neg_eigval", True),
                    norm_eps=DELTA_RULE_NORM_EPS),
        mlp=MLPArgs(hidden_dim=config["intermediate_size"], activation="swiglu"))


# The family, as titan_hybrid/hf/families.py lists it.
FAMILY = Family(
    name="olmo_hybrid", model_types=("olmo_hybrid",),
    format_name=NAME,
    key_map=olmo_hybrid_key_map,
    file_key_map=olmo_hybrid_file_key_map,
    check=check_olmo_hybrid_compatible,
    config=olmo_hybrid_config,
    to_args=model_args_from_olmo_hybrid_config)

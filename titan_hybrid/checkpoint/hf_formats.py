"""Which Hugging Face format a model's HF checkpoints take (`--checkpoint.initial_load_in_hf`,
`--checkpoint.last_save_in_hf`, `python -m titan_hybrid.hf export`): the model args' `hf_format`
when a conversion from one set it (a model imported from Bamba exports as Bamba), else the one
its layer kinds belong to.

    DeepSeek-V3 / V3.2   models with MLA (`+`) or DSA (`D`) layers: hf_deepseek.py
    Nemotron-H           all others: hf_nemotron_h.py
    Bamba                by hf_format only: hf_bamba.py
    Qwen3.5 (and MoE)    by hf_format only: hf_qwen3_5.py
    Qwen3-Next           by hf_format only: hf_qwen3_next.py
    OLMo Hybrid          by hf_format only: hf_olmo_hybrid.py
    Granite 4.0-H        by hf_format only: hf_granite.py
    Kimi Linear          by hf_format only: hf_kimi_linear.py

A model the chosen format cannot hold is refused when the job is checked, before anything is
built, with the format's first unmet condition and this rule.

Every format but DeepSeek's can tie the LM head to the embedding (`tie_word_embeddings`: the
model's `enable_weight_tying`). A tied model's state dict names the weight once, as the
embedding's, so its HF checkpoint has no `lm_head.weight`, as transformers writes it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from titan_hybrid.checkpoint.hf_adapter import HFStateDictAdapter
from titan_hybrid.checkpoint.hf_bamba import (
    BambaStateDictAdapter,
    bamba_config,
    check_bamba_compatible,
)
from titan_hybrid.checkpoint.hf_deepseek import (
    ARCHITECTURES,
    ATTENTION_KINDS,
    DeepSeekStateDictAdapter,
    check_deepseek_compatible,
    deepseek_config,
)
from titan_hybrid.checkpoint.hf_granite import (
    GraniteStateDictAdapter,
    check_granite_compatible,
    granite_config,
)
from titan_hybrid.checkpoint.hf_kimi_linear import (
    KimiLinearStateDictAdapter,
    check_kimi_linear_compatible,
    kimi_linear_config,
)
from titan_hybrid.checkpoint.hf_nemotron_h import (
    NemotronHStateDictAdapter,
    check_nemotron_h_compatible,
    nemotron_h_config,
)
from titan_hybrid.checkpoint.hf_olmo_hybrid import (
    OlmoHybridStateDictAdapter,
    check_olmo_hybrid_compatible,
    olmo_hybrid_config,
)
from titan_hybrid.checkpoint.hf_qwen3_5 import (
    Qwen35StateDictAdapter,
    check_qwen3_5_compatible,
    qwen3_5_config,
)
from titan_hybrid.checkpoint.hf_qwen3_next import (
    Qwen3NextStateDictAdapter,
    check_qwen3_next_compatible,
    qwen3_next_config,
)
from titan_hybrid.model.args import HybridModelArgs

RULE = ("HF checkpoints take the format of the model's layer kinds: DeepSeek-V3 / V3.2 for "
        f"models with MLA / DSA layers ({', '.join(kind.symbol for kind in ATTENTION_KINDS)}), "
        "Nemotron-H for the others")


@dataclass(frozen=True)
class HFFormat:
    adapter: type[HFStateDictAdapter]
    check: Callable[[HybridModelArgs], object]  # ValueError naming what the format cannot hold
    config: Callable[[HybridModelArgs], dict]  # the config.json of an export
    ties_embeddings: bool = True  # whether its models may share the embedding with the head


NEMOTRON_H = HFFormat(NemotronHStateDictAdapter, check_nemotron_h_compatible, nemotron_h_config)
DEEPSEEK = HFFormat(DeepSeekStateDictAdapter, check_deepseek_compatible, deepseek_config,
                    ties_embeddings=False)
BAMBA = HFFormat(BambaStateDictAdapter, check_bamba_compatible, bamba_config)
QWEN3_5 = HFFormat(Qwen35StateDictAdapter, check_qwen3_5_compatible, qwen3_5_config)
GRANITE = HFFormat(GraniteStateDictAdapter, check_granite_compatible, granite_config)
QWEN3_NEXT = HFFormat(Qwen3NextStateDictAdapter, check_qwen3_next_compatible, qwen3_next_config)
OLMO_HYBRID = HFFormat(OlmoHybridStateDictAdapter, check_olmo_hybrid_compatible,
                       olmo_hybrid_config)
KIMI_LINEAR = HFFormat(KimiLinearStateDictAdapter, check_kimi_linear_compatible,
                      kimi_linear_config, ties_embeddings=False)
FORMATS = {"nemotron_h": NEMOTRON_H, "deepseek": DEEPSEEK, "bamba": BAMBA, "qwen3_5": QWEN3_5,
           "granite": GRANITE, "qwen3_next": QWEN3_NEXT, "olmo_hybrid": OLMO_HYBRID,
           "kimi_linear": KIMI_LINEAR}


def hf_format_of(args: HybridModelArgs) -> HFFormat:
    """The model's format (its hf_format, else RULE), whether or not it can hold the model."""
    if args.hf_format:
        if args.hf_format not in FORMATS:
            raise ValueError(f"hf_format '{args.hf_format}' is not one of {sorted(FORMATS)}")
        return FORMATS[args.hf_format]
    kinds = {kind.name for kind in args.kinds()}
    return DEEPSEEK if kinds & set(ARCHITECTURES) else NEMOTRON_H


def check_hf_compatible(args: HybridModelArgs) -> HFFormat:
    """The model's HF format; ValueError naming its first unmet condition, and RULE."""
    hf_format = hf_format_of(args)
    try:
        hf_format.check(args)
        if args.enable_weight_tying and not hf_format.ties_embeddings:
            raise ValueError("enable_weight_tying=True: this format's LM head has its own weight")
    except ValueError as error:
        raise ValueError(f"{error} ({RULE})") from None
    return hf_format


def hf_config(args: HybridModelArgs) -> dict:
    """The config.json that `transformers` reads with the model's HF checkpoint."""
    return {**check_hf_compatible(args).config(args),
            "tie_word_embeddings": args.enable_weight_tying}


def hybrid_state_dict_adapter(model_args: HybridModelArgs,
                              hf_assets_path: str | None) -> HFStateDictAdapter:
    """The TrainSpec's `state_dict_adapter` (torchtitan calls it with these two arguments on
    every run): the adapter of the model's format. A model the format cannot hold fails only
    when the adapter is used, and the pre-flight check (training/preflight.py) refuses such a
    job before that."""
    return hf_format_of(model_args).adapter(model_args, hf_assets_path)

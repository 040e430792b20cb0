"""Model arguments, their validation, and the named flavors.

Each layer kind's args dataclass lives in the kind's module (see model/layer_kinds.py);
`HybridModelArgs` holds one section per kind, named like the kind, plus the pattern, which it
parses once (`parsed_pattern`). Flavors are derived from a few numbers with
`dataclasses.replace`, not copied tables.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

from torch import nn

from titan_hybrid.model.attention import AttentionArgs
from titan_hybrid.model.deepseek_v4 import DeepseekV4AttentionArgs
from titan_hybrid.model.deepseek_v4_csa import DeepseekV4SparseAttentionArgs
from titan_hybrid.model.deepseek_v4_hca import DeepseekV4CompressedAttentionArgs
from titan_hybrid.model.dsa import DSAArgs
from titan_hybrid.model.flops import nparams_and_flops_per_token
from titan_hybrid.model.gdn import GDNArgs
from titan_hybrid.model.gdp import GDPArgs
from titan_hybrid.model.kda import KDAArgs
from titan_hybrid.model.layer_kind import LayerKind
from titan_hybrid.model.layer_kinds import LAYER_KINDS, VARIANTS, default_variant, kind_of
from titan_hybrid.model.mamba import MambaArgs
from titan_hybrid.model.mamba1 import Mamba1Args
from titan_hybrid.model.mamba3 import Mamba3Args
from titan_hybrid.model.mla import MLAArgs
from titan_hybrid.model.mlp import MLPArgs
from titan_hybrid.model.moe import MoEArgs
from titan_hybrid.model.pattern import (
    HybridPattern,
    members,
    parse_hybrid_pattern,
    physical_symbols,
)
from titan_hybrid.model.short_conv import ShortConvArgs

__all__ = ["AttentionArgs", "DSAArgs", "DeepseekV4AttentionArgs",
           "DeepseekV4CompressedAttentionArgs", "GDNArgs", "HybridModelArgs", "KDAArgs", "MLAArgs", "MLPArgs",
           "MambaArgs", "MoEArgs", "ShortConvArgs", "hybrid_flavors",
           "resolve_model_args"]


@dataclass
class HybridModelArgs:
    pattern: str = "M*M-"
    dim: int = 256
    vocab_size: int = 2048
    norm_eps: float = 1e-5
    # The layers' input norms, the final norm and MTP's norms scale by 1 + weight (Qwen3-Next,
    # Qwen3.5): model.norms.RMSNorm's zero_centered.
    norm_zero_centered: bool = False
    # Granite 4.0's scalars: the embeddings times embedding_multiplier, every layer's output
    # times residual_multiplier before it joins the residual stream, the logits divided by
    # logits_scaling.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # Falcon-H1's: the logits times lm_head_multiplier (µP, kept as a scalar).
    lm_head_multiplier: float = 1.0
    # Symbols of sequence mixers whose decoder layer (the mixer, and the MLP / MoE layers up to
    # the next mixer) normalizes its outputs instead of its inputs: h + norm(f(h)) (OLMo
    # Hybrid's attention layers, "*"); every other layer is pre-norm, h + f(norm(h)).
    post_norm_mixers: str = ""
    # The LM head's weight is the embedding's (torchtitan's Qwen3 `enable_weight_tying`, HF's
    # `tie_word_embeddings`, Megatron's `share_embeddings_and_output_weights`): one tensor,
    # trained by both uses and saved once, as `tok_embeddings.weight`.
    enable_weight_tying: bool = False
    max_seq_len: int = 2048
    init_std: float = 0.02
    init_seed: int = 0  # each unit's weights derive from (init_seed, unit name) alone
    mtp_loss_coeff: float = 0.1
    # Manifold-constrained hyper-connections (model/hyper_connections.py: DeepSeek-V4,
    # Megatron's HybridModel): with hc_mult = N > 0 the residual stream is N streams, each
    # physical layer reads and writes them through a hyper-connection, and a hyper head
    # collapses them before the final norm. 0: the plain residual stream.
    hc_mult: int = 0
    hc_sinkhorn_iters: int = 20  # Sinkhorn steps of each layer's stream-mixing matrix
    hc_eps: float = 1e-6  # added to the pre / comb weights and to every Sinkhorn division
    # What `M` and `G` build: one of the symbol's variants in layer_kinds.VARIANTS (whose
    # first value, the symbol's own kind, is the default); a variant's sizes are in the
    # section of its name.
    m_layers: str = default_variant("m_layers")
    g_layers: str = default_variant("g_layers")
    # The Hugging Face format of this model's HF checkpoints ("nemotron_h", "deepseek",
    # "bamba": hf/families.py), set by a conversion from one; empty: chosen by the
    # layer kinds.
    hf_format: str = ""
    # One section per layer kind, named like the kind (LayerKind.name).
    attention: AttentionArgs = field(default_factory=AttentionArgs)
    mla: MLAArgs = field(default_factory=MLAArgs)
    dsa: DSAArgs = field(default_factory=DSAArgs)
    window_attention: DeepseekV4AttentionArgs = field(default_factory=DeepseekV4AttentionArgs)
    compressed_sparse_attention: DeepseekV4SparseAttentionArgs = field(
        default_factory=DeepseekV4SparseAttentionArgs)
    heavily_compressed_attention: DeepseekV4CompressedAttentionArgs = field(
        default_factory=DeepseekV4CompressedAttentionArgs)
    mlp: MLPArgs = field(default_factory=MLPArgs)
    mamba: MambaArgs = field(default_factory=MambaArgs)
    gdp: GDPArgs = field(default_factory=GDPArgs)
    mamba1: Mamba1Args = field(default_factory=Mamba1Args)
    mamba3: Mamba3Args = field(default_factory=Mamba3Args)
    gdn2: GDNArgs = field(default_factory=GDNArgs)
    gdn: GDNArgs = field(default_factory=GDNArgs)
    kda: KDAArgs = field(default_factory=KDAArgs)
    short_conv: ShortConvArgs = field(default_factory=ShortConvArgs)
    moe: MoEArgs = field(default_factory=MoEArgs)

    @property
    def parsed_pattern(self) -> HybridPattern:
        """The pattern, parsed once per pattern text (ValueError for a malformed one)."""
        cached = self.__dict__.get("_parsed_pattern")
        if cached is None or cached.text != self.pattern:
            cached = parse_hybrid_pattern(self.pattern)
            self.__dict__["_parsed_pattern"] = cached
        return cached

    def symbols(self) -> set[str]:
        """Every layer kind's symbol the pattern holds (parallel groups' members too)."""
        return self.parsed_pattern.member_symbols(include_mtp=True)

    def kinds(self) -> list[LayerKind]:
        """The layer kinds the pattern uses, in the table's order."""
        symbols = self.symbols()
        return [kind_of(symbol, self) for symbol in LAYER_KINDS if symbol in symbols]

    def section(self, kind: LayerKind):
        """The args section of one layer kind, e.g. `self.mamba` for the Mamba kind."""
        return getattr(self, kind.name)

    @property
    def routes_by_token(self) -> bool:
        """Whether MoE layers route by the token ids (moe.hash_layers), which every pipeline
        stage then needs."""
        return self.moe.hash_layers > 0

    @property
    def has_aux_loss(self) -> bool:
        return any(kind.has_aux_loss for kind in self.kinds())

    @property
    def mamba_d_inner(self) -> int:
        return self.mamba.d_inner(self.dim)

    @property
    def mamba_n_heads(self) -> int:
        return self.mamba.n_heads(self.dim)

    def validate(self) -> None:
        """Raise ValueError for shapes that cannot work; cheap, runs before any model is built."""
        for field_name, kinds in VARIANTS.values():
            if getattr(self, field_name) not in kinds:
                raise ValueError(f"{field_name}='{getattr(self, field_name)}' is not one of "
                                 f"{list(kinds)}")
        for kind in self.kinds():  # parsing the pattern also validates it
            kind.validate(self.section(kind), self.dim)
        moe_layers = sum(LAYER_KINDS[member].name == "moe"
                         for s in self.parsed_pattern.physical_layer_symbols()
                         for member in members(s))
        if not 0 <= self.moe.hash_layers <= moe_layers:
            raise ValueError(f"moe.hash_layers={self.moe.hash_layers} must be in [0, the "
                             f"pattern's {moe_layers} MoE layers]")
        if self.hc_mult < 0:
            raise ValueError(f"hc_mult={self.hc_mult} must be >= 0 (0: no hyper-connections)")
        if self.hc_mult and self.hc_sinkhorn_iters < 1:
            raise ValueError(f"hc_sinkhorn_iters={self.hc_sinkhorn_iters} must be >= 1")
        wrong = [s for s in self.post_norm_mixers
                 if s not in LAYER_KINDS or not LAYER_KINDS[s].mixes_sequence]
        if wrong:
            raise ValueError(f"post_norm_mixers '{self.post_norm_mixers}' has {wrong}: it names "
                             "sequence mixers' symbols")

    def hash_routed(self, items) -> list[bool]:
        """Whether each physical layer of `items` (the main pattern's, in order, groups
        flattened) routes by hash: the first `moe.hash_layers` MoE layers."""
        flags, left = [], self.moe.hash_layers
        for symbol in (symbol for item in items for symbol in physical_symbols(item)):
            flags.append(left > 0 and LAYER_KINDS[symbol[0]].name == "moe")  # never a member
            left -= flags[-1]
        return flags

    def post_norms(self, items) -> list[bool]:
        """Whether each physical layer of `items` (in order, groups flattened) is post-norm:
        a mixer named in post_norm_mixers, and the layers that follow it up to the next
        mixer."""
        flags, post = [], False
        for symbol in (symbol for item in items for symbol in physical_symbols(item)):
            mixers = [member for member in members(symbol) if LAYER_KINDS[member].mixes_sequence]
            if mixers:
                post = any(member in self.post_norm_mixers for member in mixers)
            flags.append(post)
        return flags

    def update_from_config(self, job_config, **kwargs) -> None:
        """Nothing: torchtitan 0.2's trainer calls this to apply its job, but the run's args
        were resolved from the job before (resolve_model_args, by the torchtitan adapter)."""

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        return nparams_and_flops_per_token(self, model, seq_len)


def _debug() -> HybridModelArgs:
    return HybridModelArgs(
        pattern="M-*-M-G-",
        dim=256,
        vocab_size=2048,
        attention=AttentionArgs(n_heads=4, n_kv_heads=2, head_dim=64),
        mla=MLAArgs(n_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32,
                    qk_rope_head_dim=16, v_head_dim=32),
        # The indexer picks 16 keys per query (tests run 64-token sequences) and trains.
        dsa=DSAArgs(n_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32,
                    qk_rope_head_dim=16, v_head_dim=32, index_n_heads=4, index_head_dim=32,
                    index_topk=16, indexer_loss_coeff=0.01),
        # A 16-token window: the tests' 64-token sequences cross it.
        window_attention=DeepseekV4AttentionArgs(n_heads=4, head_dim=32, rope_head_dim=16,
                                                 q_lora_rank=64, o_groups=2, o_lora_rank=32,
                                                 sliding_window=16),
        # Overlapping blocks of 4 tokens, an 8-token window, and an indexer that keeps 6 of a
        # 64-token row's 16 compressed rows and trains.
        compressed_sparse_attention=DeepseekV4SparseAttentionArgs(
            n_heads=4, head_dim=32, rope_head_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=32,
            sliding_window=8, compress_ratio=4, index_n_heads=4, index_head_dim=32,
            index_topk=6, indexer_loss_coeff=0.01),
        # Blocks of 4 tokens and an 8-token window: a 64-token row has 16 compressed rows, and
        # most of a query's rows lie beyond its window.
        heavily_compressed_attention=DeepseekV4CompressedAttentionArgs(
            n_heads=4, head_dim=32, rope_head_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=32,
            sliding_window=8, compress_ratio=4),
        mlp=MLPArgs(hidden_dim=512),
        mamba=MambaArgs(d_state=32, head_dim=32, n_groups=2, chunk_size=64),
        gdn=GDNArgs(key_head_dim=64, value_head_dim=64, n_key_heads=2, n_value_heads=4),
        kda=KDAArgs(head_dim=32, n_heads=4),
        moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=256, shared_expert_hidden_dim=256),
    )


def _debug_v4_model() -> HybridModelArgs:
    args = _debug()
    return dataclasses.replace(
        args, pattern="WECEHE/WE", hc_mult=4, norm_eps=1e-6,
        window_attention=dataclasses.replace(args.window_attention, sliding_window=8),
        moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=256, shared_expert_hidden_dim=256,
                    score_func="sqrtsoftplus", score_correction_bias=True,
                    routed_scaling_factor=1.5, swiglu_limit=10.0, hash_layers=1))


def _gpu_sized(pattern: str) -> HybridModelArgs:
    # Nemotron-H-like proportions: d_inner = 2*dim, 8 SSM groups, 128-dim states, GQA 8 kv heads.
    return HybridModelArgs(
        pattern=pattern,
        dim=2048,
        vocab_size=131072,
        max_seq_len=4096,
        attention=AttentionArgs(n_heads=16, n_kv_heads=8, head_dim=128, rope_theta=500000.0),
        # DeepSeek-V2-Lite's attention shapes (full-rank queries); DSA adds V3.2's indexer.
        mla=MLAArgs(n_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, v_head_dim=128, rope_theta=10000.0),
        dsa=DSAArgs(n_heads=16, q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, v_head_dim=128, rope_theta=10000.0, index_n_heads=32,
                    index_head_dim=128, index_topk=2048),
        # DeepSeek-V4-Flash's attention at a quarter of its heads and half their width.
        window_attention=DeepseekV4AttentionArgs(n_heads=16, head_dim=256, rope_head_dim=64,
                                                 q_lora_rank=1024, o_groups=4, o_lora_rank=512,
                                                 sliding_window=128),
        compressed_sparse_attention=DeepseekV4SparseAttentionArgs(
            n_heads=16, head_dim=256, rope_head_dim=64, q_lora_rank=1024, o_groups=4,
            o_lora_rank=512, sliding_window=128, compress_ratio=4, index_n_heads=32,
            index_head_dim=128, index_topk=512),
        heavily_compressed_attention=DeepseekV4CompressedAttentionArgs(
            n_heads=16, head_dim=256, rope_head_dim=64, q_lora_rank=1024, o_groups=4,
            o_lora_rank=512, sliding_window=128, compress_ratio=128),
        mlp=MLPArgs(hidden_dim=8192),
        mamba=MambaArgs(d_state=128, head_dim=64, n_groups=8, chunk_size=128),
        gdn=GDNArgs(key_head_dim=128, value_head_dim=128, n_key_heads=8, n_value_heads=16),
        kda=KDAArgs(head_dim=128, n_heads=16),
        moe=MoEArgs(num_experts=16, top_k=2, hidden_dim=1024, shared_expert_hidden_dim=2048),
    )


class FlavorRegistry(dict):
    """The flavors by name; an unknown name is a user error that lists the known ones."""

    def __missing__(self, name: str) -> HybridModelArgs:
        raise ValueError(f"model.flavor '{name}' is not a hybrid flavor; choose one of {sorted(self)}")


hybrid_flavors = FlavorRegistry({
    "debug": _debug(),
    "debug_moe": dataclasses.replace(_debug(), pattern="M*EME/*-"),
    # DeepSeek-V4's MoE: the first MoE layer routes by token id, sqrtsoftplus scores, SwiGLU
    # clamped at 10 (experts and shared expert), routed_scaling_factor 1.5.
    "debug_hash_moe": dataclasses.replace(
        _debug(), pattern="M*EME/*-",
        moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=256, shared_expert_hidden_dim=256,
                    score_func="sqrtsoftplus", routed_scaling_factor=1.5, swiglu_limit=10.0,
                    hash_layers=1)),
    "debug_grouped": dataclasses.replace(_debug(), pattern="[M*][M-][G-]"),
    # Multi-latent attention (DeepSeek-V3) and DeepSeek sparse attention (V3.2) hybrids.
    "debug_mla": dataclasses.replace(_debug(), pattern="M+-M+-"),
    "debug_kda": dataclasses.replace(_debug(), pattern="MK-*K-"),
    "debug_dsa": dataclasses.replace(_debug(), pattern="MD-MD-"),
    # DeepSeek-V4's sliding-window attention hybrid.
    "debug_v4": dataclasses.replace(_debug(), pattern="MW-MW-"),
    # ... with heavily compressed attention (blocks of 4 tokens) in the first attention layer.
    "debug_v4_hca": dataclasses.replace(_debug(), pattern="MH-MW-"),
    # All three DeepSeek-V4 kinds: compressed sparse, heavily compressed, sliding window.
    "debug_v4_all": dataclasses.replace(_debug(), pattern="MC-MH-MW-"),
    "debug_v4_all_moe": dataclasses.replace(_debug(), pattern="MC-MHEMWE"),
    # Gated DeltaProduct in the `M` layers (Megatron's gdp_stack_spec), 2 Householder steps a
    # token, with attention.
    "debug_gdp": dataclasses.replace(
        _debug(), pattern="M-*-M-", m_layers="gdp",
        gdp=GDPArgs(num_householder=2, d_state=32, head_dim=32, n_groups=2)),
    # Falcon-H1's layers: Mamba2 and attention in parallel on one normed input (a parallel
    # group), each followed by an MLP.
    "debug_parallel": dataclasses.replace(_debug(), pattern="(M*)-(M*)-"),
    # LFM2's layers: gated short convolutions (width 3) and attention, each with an MLP.
    "debug_short_conv": dataclasses.replace(_debug(), pattern="S-*-S-"),
    # Mamba1 (selective scan, a decay per channel and state entry) in the `M` layers, with
    # Jamba's weighted dt / B / C norms.
    "debug_mamba1": dataclasses.replace(
        _debug(), pattern="M-*-M-", m_layers="mamba1",
        mamba1=Mamba1Args(d_state=16, expand=2, dt_bc_norm="weighted")),
    # Mamba-3 (SISO: trapezoidal steps, rotated B / C, a decay rate per token) in the `M`
    # layers.
    "debug_mamba3": dataclasses.replace(
        _debug(), pattern="M-*-M-", m_layers="mamba3",
        mamba3=Mamba3Args(d_state=32, head_dim=32, chunk_size=32)),
    # ... MIMO (2 inputs and read-outs per head and token) with the output norm.
    "debug_mamba3_mimo": dataclasses.replace(
        _debug(), pattern="M-*-M-", m_layers="mamba3",
        mamba3=Mamba3Args(d_state=32, head_dim=32, chunk_size=16, mimo=True, mimo_rank=2,
                          outproj_norm=True)),
    # Gated DeltaNet-2 in the `G` layers (Megatron's experimental_attention_variant "gdn2").
    "debug_gdn2": dataclasses.replace(
        _debug(), pattern="G-*-G-", g_layers="gdn2",
        gdn2=GDNArgs(key_head_dim=32, value_head_dim=32, n_key_heads=2, n_value_heads=4)),
    # A whole DeepSeek-V4 model (hf/deepseek_v4.py's format): its three attention kinds, each
    # with a MoE layer (the first hash-routed), four hyper-connection streams, one MTP depth;
    # V4's router, clamp and norms, and one window (transformers has one value).
    "debug_v4_model": _debug_v4_model(),
    # 6 GDN value heads over 2 key heads: per TP rank (3 at TP 2) they do not split over CP 2
    # or 4 by heads (head_a2a), which chunkwise context parallelism does not need.
    "debug_odd_heads": dataclasses.replace(
        _debug(), pattern="M*-G-",
        gdn=GDNArgs(key_head_dim=64, value_head_dim=64, n_key_heads=2, n_value_heads=6)),
    # Nemotron-H's layer kinds (no RoPE, squared-ReLU MLP, dt clamped at 1e-3): the HF format.
    "debug_nemotron_h": dataclasses.replace(
        _debug(), pattern="M-M*-M-",
        attention=AttentionArgs(n_heads=4, n_kv_heads=2, head_dim=64, use_rope=False),
        mlp=MLPArgs(hidden_dim=512, activation="relu2"),
        mamba=MambaArgs(d_state=32, head_dim=32, n_groups=2, chunk_size=64,
                        dt_limit=(1e-3, float("inf")))),
    # ~0.9B non-embedding parameters, dense: 12 Mamba, 10 MLP, 3 attention layers.
    "nemotron_h_1b": _gpu_sized("M-M*-M-M-M*-M-M-M*-M-M-M-"),
    # MoE hybrid in the Nemotron-3 / Jamba spirit, with one MTP depth: ~2.1B parameters, <1B
    # active per token; fits one 80 GB GPU with fp32 Adam state.
    "hybrid_moe_2b": _gpu_sized("ME*EMEMEM*EMEMEMEM*EME/*E"),
    # nemotron_h_1b's layers with MLA (DSA) in place of attention: ~1.5B parameters.
    "mla_hybrid_1b": _gpu_sized("M-M+-M-M-M+-M-M-M+-M-M-M-"),
    "dsa_hybrid_1b": _gpu_sized("M-MD-M-M-MD-M-M-MD-M-M-M-"),
    # nemotron_h_1b's layers with KDA (16 heads of 128) in place of Mamba2.
    "kda_hybrid_1b": _gpu_sized("K-K*-K-K-K*-K-K-K*-K-K-K-"),
    # ... with gated DeltaNet (Qwen3-Next's shapes: 16 value heads over 8 key heads of 128).
    "gdn_hybrid_1b": _gpu_sized("G-G*-G-G-G*-G-G-G*-G-G-G-"),
    # ... with gated DeltaProduct in the `M` layers at Megatron's GDP defaults (3 Householder
    # steps, 64 value heads of 64 over 8 key groups of 128).
    "gdp_hybrid_1b": dataclasses.replace(
        _gpu_sized("M-M*-M-M-M*-M-M-M*-M-M-M-"), m_layers="gdp",
        gdp=GDPArgs(num_householder=3, d_state=128, head_dim=64, n_groups=8)),
    # ... with Mamba-3 (SISO, mamba_ssm's defaults: state 128, heads of 64) in the `M` layers.
    "mamba3_hybrid_1b": dataclasses.replace(
        _gpu_sized("M-M*-M-M-M*-M-M-M*-M-M-M-"), m_layers="mamba3"),
    # Jamba's block (hf/jamba.py) twice: Mamba1 layers (weighted dt / B / C norms) with one
    # attention layer without RoPE in 8, a MoE layer after every second.
    "jamba_hybrid_2b": dataclasses.replace(
        _gpu_sized("M-MEM-ME*-MEM-ME" * 2), m_layers="mamba1",
        attention=AttentionArgs(n_heads=16, n_kv_heads=8, head_dim=128, use_rope=False),
        mamba1=Mamba1Args(d_state=16, expand=2, dt_bc_norm="weighted")),
})


def resolve_model_args(flavor: str, *, pattern: str = "", seq_len: int,
                       seed: int | None = None, hc_mult: int | None = None,
                       m_layers: str | None = None, g_layers: str | None = None,
                       base: HybridModelArgs | None = None) -> HybridModelArgs:
    """The model args a run trains: a copy of the flavor's (or of `base`, the args of
    `hybrid.model_config`, which replace the flavor), with the run's pattern (if given),
    sequence length, init seed, hyper-connection streams and `M` / `G` mixers (if given),
    validated
    (ValueError for an unknown flavor or shapes that cannot work)."""
    flavor_args = base if base is not None else hybrid_flavors[flavor]
    # One new object whose sections are copies too: nothing is shared with the flavor table.
    fields = {f.name: copy.deepcopy(getattr(flavor_args, f.name))
              for f in dataclasses.fields(flavor_args) if f.init}
    fields.update(pattern=pattern or flavor_args.pattern, max_seq_len=seq_len,
                  init_seed=flavor_args.init_seed if seed is None else seed,
                  hc_mult=flavor_args.hc_mult if hc_mult is None else hc_mult,
                  m_layers=m_layers or flavor_args.m_layers,
                  g_layers=g_layers or flavor_args.g_layers)
    model_args = HybridModelArgs(**fields)
    model_args.validate()
    return model_args

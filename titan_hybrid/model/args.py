"""Model arguments, their validation, and the named flavors.

One dataclass per layer type keeps each constructor small; `HybridModelArgs` holds them plus the
pattern. Flavors are derived from a few numbers with `dataclasses.replace`, not copied tables.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from torch import nn

from torchtitan.config import JobConfig
from torchtitan.protocols.model import BaseModelArgs

from titan_hybrid.pattern import parse_hybrid_pattern


@dataclass
class AttentionArgs:
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 64
    rope_theta: float = 10000.0
    use_rope: bool = True  # Nemotron-H's attention layers have no position embedding


@dataclass
class MLPArgs:
    hidden_dim: int = 512
    activation: str = "swiglu"  # or "relu2": Nemotron-H's non-gated squared-ReLU MLP


@dataclass
class MambaArgs:
    d_state: int = 128
    head_dim: int = 64
    n_groups: int = 8
    expand: int = 2
    conv_width: int = 4
    chunk_size: int = 128
    dt_min: float = 1e-3
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    a_init_range: tuple[float, float] = (1.0, 16.0)
    dt_limit: tuple[float, float] = (0.0, float("inf"))  # clamp of softplus(dt + dt_bias)


@dataclass
class GDNArgs:
    key_head_dim: int = 128
    value_head_dim: int = 128
    n_key_heads: int = 16
    n_value_heads: int = 32
    conv_width: int = 4


@dataclass
class MoEArgs:
    num_experts: int = 8
    top_k: int = 2
    hidden_dim: int = 256
    score_func: str = "softmax"  # or "sigmoid"
    shared_expert_hidden_dim: int = 0  # 0: no shared expert
    aux_loss_coeff: float = 1e-2


@dataclass
class HybridModelArgs(BaseModelArgs):
    pattern: str = "M*M-"
    dim: int = 256
    vocab_size: int = 2048
    norm_eps: float = 1e-5
    max_seq_len: int = 2048
    init_std: float = 0.02
    init_seed: int = 0  # each unit's weights derive from (init_seed, unit name) alone
    mtp_loss_coeff: float = 0.1
    attention: AttentionArgs = field(default_factory=AttentionArgs)
    mlp: MLPArgs = field(default_factory=MLPArgs)
    mamba: MambaArgs = field(default_factory=MambaArgs)
    gdn: GDNArgs = field(default_factory=GDNArgs)
    moe: MoEArgs = field(default_factory=MoEArgs)

    @property
    def mamba_d_inner(self) -> int:
        return self.mamba.expand * self.dim

    @property
    def mamba_n_heads(self) -> int:
        return self.mamba_d_inner // self.mamba.head_dim

    def symbols(self) -> set[str]:
        return set(parse_hybrid_pattern(self.pattern).physical_layer_symbols(include_mtp=True))

    def validate(self) -> None:
        """Raise ValueError for shapes that cannot work; cheap, runs before any model is built."""
        symbols = self.symbols()  # also validates the pattern itself
        if "M" in symbols:
            if self.mamba_d_inner % self.mamba.head_dim:
                raise ValueError(
                    f"mamba: d_inner = expand*dim = {self.mamba_d_inner} is not divisible by "
                    f"mamba.head_dim={self.mamba.head_dim}")
            if self.mamba_n_heads % self.mamba.n_groups:
                raise ValueError(
                    f"mamba: nheads={self.mamba_n_heads} is not divisible by "
                    f"mamba.n_groups={self.mamba.n_groups} (each group must own whole heads)")
        if "-" in symbols and self.mlp.activation not in ("swiglu", "relu2"):
            raise ValueError(f"mlp: activation '{self.mlp.activation}' is not 'swiglu' or "
                             "'relu2'")
        if "*" in symbols and self.attention.use_rope and self.attention.head_dim % 2:
            raise ValueError(f"attention: head_dim={self.attention.head_dim} must be even "
                             "(rotary embeddings rotate channel pairs)")
        if "*" in symbols and self.attention.n_heads % self.attention.n_kv_heads:
            raise ValueError(
                f"attention: n_heads={self.attention.n_heads} is not divisible by "
                f"n_kv_heads={self.attention.n_kv_heads}")
        if "G" in symbols and self.gdn.n_value_heads % self.gdn.n_key_heads:
            raise ValueError(
                f"gdn: n_value_heads={self.gdn.n_value_heads} is not divisible by "
                f"n_key_heads={self.gdn.n_key_heads}")
        if "E" in symbols:
            if self.moe.num_experts < 1:
                raise ValueError(f"moe: num_experts={self.moe.num_experts} must be >= 1")
            if not 1 <= self.moe.top_k <= self.moe.num_experts:
                raise ValueError(f"moe: top_k={self.moe.top_k} must be in [1, num_experts="
                                 f"{self.moe.num_experts}]")
            if self.moe.score_func not in ("softmax", "sigmoid"):
                raise ValueError(f"moe: score_func '{self.moe.score_func}' is not 'softmax' or "
                                 "'sigmoid'")

    def update_from_config(self, job_config: JobConfig, **kwargs) -> None:
        hybrid = getattr(job_config, "hybrid", None)
        if hybrid is not None and hybrid.pattern:
            self.pattern = hybrid.pattern
        self.max_seq_len = job_config.training.seq_len
        if job_config.debug.seed is not None:
            self.init_seed = job_config.debug.seed
        self.validate()

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        from titan_hybrid.model.flops import nparams_and_flops_per_token

        return nparams_and_flops_per_token(self, model, seq_len)


def _debug() -> HybridModelArgs:
    return HybridModelArgs(
        pattern="M-*-M-G-",
        dim=256,
        vocab_size=2048,
        attention=AttentionArgs(n_heads=4, n_kv_heads=2, head_dim=64),
        mlp=MLPArgs(hidden_dim=512),
        mamba=MambaArgs(d_state=32, head_dim=32, n_groups=2, chunk_size=64),
        gdn=GDNArgs(key_head_dim=64, value_head_dim=64, n_key_heads=2, n_value_heads=4),
        moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=256, shared_expert_hidden_dim=256),
    )


def _gpu_sized(pattern: str) -> HybridModelArgs:
    # Nemotron-H-like proportions: d_inner = 2*dim, 8 SSM groups, 128-dim states, GQA 8 kv heads.
    return HybridModelArgs(
        pattern=pattern,
        dim=2048,
        vocab_size=131072,
        max_seq_len=4096,
        attention=AttentionArgs(n_heads=16, n_kv_heads=8, head_dim=128, rope_theta=500000.0),
        mlp=MLPArgs(hidden_dim=8192),
        mamba=MambaArgs(d_state=128, head_dim=64, n_groups=8, chunk_size=128),
        gdn=GDNArgs(key_head_dim=128, value_head_dim=128, n_key_heads=8, n_value_heads=16),
        moe=MoEArgs(num_experts=16, top_k=2, hidden_dim=1024, shared_expert_hidden_dim=2048),
    )


class FlavorRegistry(dict):
    """The flavors by name; an unknown name is a user error that lists the known ones."""

    def __missing__(self, name: str) -> HybridModelArgs:
        raise ValueError(f"model.flavor '{name}' is not a hybrid flavor; choose one of {sorted(self)}")


hybrid_flavors = FlavorRegistry({
    "debug": _debug(),
    "debug_moe": dataclasses.replace(_debug(), pattern="M*EME/*-"),
    "debug_grouped": dataclasses.replace(_debug(), pattern="[M*][M-][G-]"),
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
})

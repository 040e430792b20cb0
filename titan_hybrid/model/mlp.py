"""Feed-forward layers: SwiGLU with one fused fc1 holding [W ; V] (gate rows, then up rows), and
Nemotron-H's non-gated squared-ReLU MLP."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_hybrid.model.common import TPLayout, init_linear, sharded
from titan_hybrid.model.layer_kind import LayerKind

ACTIVATIONS = ("swiglu", "relu2")


@dataclass
class MLPArgs:
    hidden_dim: int = 512
    activation: str = "swiglu"  # or "relu2": Nemotron-H's non-gated squared-ReLU MLP
    # SwiGLU's clamp (DeepSeek-V4's swiglu_limit): silu(min(gate, L)) * clamp(up, -L, L).
    # 0: none.
    swiglu_limit: float = 0.0
    # Falcon-H1's mlp_multipliers (µP, kept as scalars: folded into the weights they would
    # change Adam's steps): silu(gate * gate_multiplier) * up, and the output times
    # down_multiplier (SwiGLU only).
    gate_multiplier: float = 1.0
    down_multiplier: float = 1.0


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float = 0.0) -> torch.Tensor:
    """silu(gate) * up; with a limit L > 0, silu(min(gate, L)) * clamp(up, -L, L)."""
    if limit:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


class SwiGLU(nn.Module):
    def __init__(self, *, dim: int, hidden_dim: int, limit: float = 0.0,
                 gate_multiplier: float = 1.0, down_multiplier: float = 1.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * hidden_dim, bias=False)
        self.fc2 = nn.Linear(hidden_dim, dim, bias=False)
        self.hidden_dim, self.limit = hidden_dim, limit
        self.gate_multiplier, self.down_multiplier = gate_multiplier, down_multiplier

    def tensor_parallel_layouts(self) -> dict[str, TPLayout]:
        # Column parallel, each rank holding [W_local ; V_local]; the plan splits both parts.
        return {"fc1.weight": sharded(0, {"_w": self.hidden_dim, "_v": self.hidden_dim}),
                "fc2.weight": sharded(1)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc1(x).chunk(2, dim=-1)
        if self.gate_multiplier != 1.0:
            gate = gate * self.gate_multiplier
        out = self.fc2(swiglu(gate, up, self.limit))
        return out if self.down_multiplier == 1.0 else out * self.down_multiplier

    def init_weights(self, *, init_std: float, out_std: float) -> None:
        init_linear(self.fc1, std=init_std)
        init_linear(self.fc2, std=out_std)


class SquaredReLUMLP(nn.Module):
    """fc2(relu(fc1(x))^2): SwiGLU's parameter names and init, with an unfused fc1."""

    def __init__(self, *, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim, bias=False)
        self.fc2 = nn.Linear(hidden_dim, dim, bias=False)

    def tensor_parallel_layouts(self) -> dict[str, TPLayout]:
        return {"fc1.weight": sharded(0), "fc2.weight": sharded(1)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)).square())

    def init_weights(self, *, init_std: float, out_std: float) -> None:
        init_linear(self.fc1, std=init_std)
        init_linear(self.fc2, std=out_std)


def build_mlp(args: MLPArgs, dim: int) -> nn.Module:
    if args.activation == "relu2":
        return SquaredReLUMLP(dim=dim, hidden_dim=args.hidden_dim)
    return SwiGLU(dim=dim, hidden_dim=args.hidden_dim, limit=args.swiglu_limit,
                  gate_multiplier=args.gate_multiplier, down_multiplier=args.down_multiplier)


def _validate(args: MLPArgs, dim: int) -> None:
    if args.activation not in ACTIVATIONS:
        raise ValueError(f"mlp: activation '{args.activation}' is not 'swiglu' or 'relu2'")
    if args.swiglu_limit < 0 or (args.swiglu_limit and args.activation != "swiglu"):
        raise ValueError(f"mlp: swiglu_limit={args.swiglu_limit} must be >= 0, and 0 unless "
                         "activation is 'swiglu' (0: no clamp)")
    if (args.gate_multiplier, args.down_multiplier) != (1.0, 1.0) and args.activation != "swiglu":
        raise ValueError(f"mlp: gate_multiplier={args.gate_multiplier} and down_multiplier="
                         f"{args.down_multiplier} apply to activation 'swiglu' only")


KIND = LayerKind(
    symbol="-", args_type=MLPArgs,
    build=lambda args, dim, norm_eps: build_mlp(args, dim), validate=_validate,
    tensor_parallel_sizes=lambda args, dim: [("mlp.hidden_dim", args.hidden_dim)],
)

"""Feed-forward layers: SwiGLU with one fused fc1 holding [W ; V] (gate rows, then up rows), and
Nemotron-H's non-gated squared-ReLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_hybrid.model.common import annotate_tensor_parallel, init_linear


class SwiGLU(nn.Module):
    def __init__(self, *, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * hidden_dim, bias=False)
        self.fc2 = nn.Linear(hidden_dim, dim, bias=False)
        # Column parallel, each rank holding [W_local ; V_local]; the plan splits both parts.
        annotate_tensor_parallel(self.fc1.weight, partition_dim=0,
                                 components={"_w": hidden_dim, "_v": hidden_dim})
        annotate_tensor_parallel(self.fc2.weight, partition_dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(F.silu(gate) * up)

    def init_weights(self, *, init_std: float, out_std: float) -> None:
        init_linear(self.fc1, std=init_std)
        init_linear(self.fc2, std=out_std)


class SquaredReLUMLP(SwiGLU):
    """fc2(relu(fc1(x))^2); same parameter names and init as SwiGLU, fc1 is not fused."""

    def __init__(self, *, dim: int, hidden_dim: int) -> None:
        nn.Module.__init__(self)
        self.fc1 = nn.Linear(dim, hidden_dim, bias=False)
        self.fc2 = nn.Linear(hidden_dim, dim, bias=False)
        annotate_tensor_parallel(self.fc1.weight, partition_dim=0)
        annotate_tensor_parallel(self.fc2.weight, partition_dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)).square())

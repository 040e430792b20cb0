"""The model and optimizer state that torchtitan's CheckpointManager saves, with every fused
tensor split into its logical components (see split.py), so checkpoints move between layouts."""

from __future__ import annotations

from torch import nn
from torchtitan.components.checkpoint import ModelWrapper

from titan_hybrid.checkpoint.split import merge_state_dict, split_state_dict
from titan_hybrid.parallel.tensor_parallel import TPLayout


def fused_parameters(model_parts: list[nn.Module]) -> dict[str, tuple[TPLayout, object]]:
    """fqn -> (layout, parameter) for every fused parameter (layouts recorded by parallelize)."""
    fused = {}
    for part in model_parts:
        for module_name, module in part.named_modules():
            for name, layout in getattr(module, "param_layouts", {}).items():
                if layout.partition_names:
                    fqn = f"{module_name}.{name}" if module_name else name
                    fused[fqn] = (layout, module._parameters[name])
    return fused


def optimizer_key(key: str) -> tuple[str, str, str]:
    """"state.<fqn>.<stat>" -> ("state.", fqn, ".<stat>"): components become
    state.<fqn><part>.<stat>, e.g. state.layers.1.mlp.fc1.weight_w.exp_avg."""
    if key.startswith("state."):
        fqn, _, stat = key[len("state."):].rpartition(".")
        return "state.", fqn, "." + stat
    return "", key, ""


class SplitModelWrapper(ModelWrapper):
    """torchtitan's ModelWrapper with fused tensors saved as components."""

    def _get_state_dict(self):
        return split_state_dict(super()._get_state_dict(), fused_parameters(self.model))

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(merge_state_dict(state_dict))


def split_optimizer_state(state_dict: dict, model_parts: list[nn.Module]) -> dict:
    return split_state_dict(state_dict, fused_parameters(model_parts), key_of=optimizer_key)

"""The model and optimizer state that torchtitan's CheckpointManager saves and loads.

Two transforms make checkpoints independent of the layout and of grouping:
- every fused tensor is split into its logical components (split.py);
- keys are LOGICAL: a bracket group's sub-layers take the group's index
  (`[*-]` -> `layers.0.attention.*` and `layers.0.mlp.*`), so a grouped pattern and the plain
  transformer-layer layout it mirrors share keys. The final norm also loads from
  `final_layernorm.weight`, and hyper-connection models also load Megatron's mHC key form
  (NVIDIA/Megatron-LM#6401: `megatron_mhc_form`).
Before a load, the checkpoint's keys and shapes are checked against the model so that a
mismatch fails with the keys named, before training starts.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_hybrid.checkpoint.split import merge_state_dict, split_state_dict
from titan_hybrid.compat.torchtitan_hooks import ModelWrapperHooks
from titan_hybrid.model.common import TPLayout
from titan_hybrid.model.layer_kinds import ALL_KINDS
from titan_hybrid.runtime.errors import JobError

NON_MODEL_PREFIXES = ("optimizer.", "dataloader.", "lr_scheduler.", "train_state.")
_GROUPED_KEY = re.compile(r"^((?:optimizer\.)?(?:state\.|param_groups\.)?)layers\.(\d+)\.layers\.\d+\.")
FINAL_NORM_ALIASES = {"norm.weight": "final_layernorm.weight"}

# Megatron's mHC layers (NVIDIA/Megatron-LM#6401, HyperConnectionHybridLayer) nest the layer
# under `inner_layer` and name its hyper-connection's tensors `mapping_proj.weight` (our `fn`:
# the same [pre | post | comb] rows), `bias` (our `base`) and `alpha_pre`, `alpha_post`,
# `alpha_res` ([1] each: the three entries of our `scale`); the hyper head's are `hc_head_fn`,
# `hc_head_base`, `hc_head_scale`.
_MHC_RENAMES = {"hyper_connection.fn": "hyper_connection.mapping_proj.weight",
                "hyper_connection.base": "hyper_connection.bias"}
MHC_ALPHAS = ("alpha_pre", "alpha_post", "alpha_res")
_MHC_SCALE = "hyper_connection.scale"
_MHC_HEAD = re.compile(r"hc_head\.hc_(fn|base|scale)$")
_MHC_INNER = re.compile(r"((?:^|\.)layers\.\d+\.)(?!hyper_connection\.)")


def fused_parameters(model_parts: list[nn.Module],
                     layouts: dict[str, TPLayout]) -> dict[str, tuple[TPLayout, object]]:
    """fqn -> (layout, parameter) for every fused parameter of `model_parts`, by the plan's
    `layouts` (ParallelPlan.layouts). FQNs are state-dict keys: `named_parameters()` of a layer
    wrapped for activation checkpointing (after the plan was made) names the wrapper's level
    too, and such a layer's fused tensors were saved whole."""
    fused = {}
    for part in model_parts:
        for fqn, param in part.state_dict(keep_vars=True).items():
            layout = layouts.get(fqn)
            if layout is not None and layout.partition_names:
                fused[fqn] = (layout, param)
    return fused


def optimizer_key(key: str) -> tuple[str, str, str]:
    """"state.<fqn>.<stat>" -> ("state.", fqn, ".<stat>"): components become
    state.<fqn><part>.<stat>, e.g. state.layers.1.mlp.fc1.weight_w.exp_avg."""
    if key.startswith("state."):
        fqn, _, stat = key[len("state."):].rpartition(".")
        return "state.", fqn, "." + stat
    return "", key, ""


def logical_keys(state_dict: dict) -> tuple[dict, dict[str, str]]:
    """Rename grouped sub-layer keys to the group's logical index. Returns the renamed dict and
    {logical key: original key}. Sub-layers of one kind twice in a group keep their keys."""
    renamed = {key: _GROUPED_KEY.sub(r"\1layers.\2.", key) for key in state_dict}
    counts: dict[str, int] = {}
    for new in renamed.values():
        counts[new] = counts.get(new, 0) + 1
    out, originals = {}, {}
    for key, value in state_dict.items():
        new = renamed[key] if counts[renamed[key]] == 1 else key
        out[new] = value
        if new != key:
            originals[new] = key
    return out, originals


def physical_keys(state_dict: dict, originals: dict[str, str]) -> dict:
    return {originals.get(key, key): value for key, value in state_dict.items()}


def holds_megatron_mhc_keys(stored_keys) -> bool:
    """Whether a checkpoint's keys are Megatron's mHC form."""
    return any(".inner_layer." in key or key.endswith("hyper_connection.mapping_proj.weight")
               for key in stored_keys)


def _megatron_mhc_key(key: str) -> str:
    for ours, theirs in _MHC_RENAMES.items():
        if key.endswith(ours):
            return key[:-len(ours)] + theirs
    if _MHC_HEAD.search(key):
        return _MHC_HEAD.sub(r"hc_head_\1", key)
    return _MHC_INNER.sub(r"\1inner_layer.", key, count=1)


def megatron_mhc_form(state_dict: dict) -> dict:
    """A load's model state dict (logical keys) under Megatron's mHC keys: the same tensors
    renamed, each `scale` replaced by three fresh [1] tensors for its alphas (`from_megatron_mhc
    _form` writes them into it after the load)."""
    out = {}
    for key, value in state_dict.items():
        if not hasattr(value, "dim") or key.startswith(NON_MODEL_PREFIXES):
            out[key] = value
        elif key.endswith(_MHC_SCALE):
            local = value.to_local() if hasattr(value, "to_local") else value
            for alpha in MHC_ALPHAS:
                out[f"{key[:-len('scale')]}{alpha}"] = torch.empty(1, dtype=local.dtype,
                                                                    device=local.device)
        else:
            out[_megatron_mhc_key(key)] = value
    return out


def from_megatron_mhc_form(state_dict: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """Undo megatron_mhc_form after the load: (the state dict under our keys, without the
    scales, {scale key: its loaded value [3]})."""
    out, alphas = {}, {}
    for key, value in state_dict.items():
        name = key.rpartition(".")[2]
        if name in MHC_ALPHAS and key.endswith(f"hyper_connection.{name}"):
            scale = key[:-len(name)] + "scale"
            alphas.setdefault(scale, {})[name] = value
        else:
            out[_our_key(key)] = value
    return out, {key: torch.cat([found[alpha] for alpha in MHC_ALPHAS])
                 for key, found in alphas.items()}


def _our_key(key: str) -> str:
    """Our key of a key in Megatron's mHC form (any other key: itself)."""
    key = key.replace(".inner_layer.", ".", 1)
    for ours, theirs in _MHC_RENAMES.items():
        if key.endswith(theirs):
            return key[:-len(theirs)] + ours
    return re.sub(r"hc_head_(fn|base|scale)$", r"hc_head.hc_\1", key)


class SplitModelWrapper(ModelWrapperHooks):
    """torchtitan's ModelWrapper with fused tensors as components and logical keys; `layouts`:
    the run's ParallelPlan.layouts."""

    def __init__(self, model, layouts: dict[str, TPLayout]) -> None:
        self.layouts = layouts  # before torchtitan's constructor builds the state dict
        super().__init__(model)

    def _logical_state_dict(self) -> tuple[dict, dict[str, str]]:
        """(the model's state dict split and logically keyed, {logical key: model key})."""
        split = split_state_dict(super().build_state_dict(),
                                 fused_parameters(self.model, self.layouts))
        return logical_keys(split)

    def build_state_dict(self) -> dict:
        return self._logical_state_dict()[0]

    # Set by the loader when it reads layers by order: {checkpoint key: model key}.
    pending_renames: dict[str, str] = {}

    def load_state_dict(self, state_dict) -> None:
        state_dict = {self.pending_renames.get(k, k): v for k, v in state_dict.items()}
        self.pending_renames = {}
        for key, alias in FINAL_NORM_ALIASES.items():
            if alias in state_dict and key not in state_dict:
                state_dict[key] = state_dict.pop(alias)
        state_dict, scales = from_megatron_mhc_form(state_dict)
        _, originals = self._logical_state_dict()  # the model's keys now, whatever ran before
        super().load_state_dict(merge_state_dict(physical_keys(state_dict, originals)))
        for key, value in scales.items():
            self._copy_into(originals.get(key, key), value)

    def _copy_into(self, key: str, full: torch.Tensor) -> None:
        """Write a whole tensor into the model's parameter `key`, a state-dict key (activation
        checkpointing and compile wrap modules under names the state dict leaves out); a
        DTensor takes its local part."""
        for part in self.model:
            param = part.state_dict(keep_vars=True).get(key)
            if param is None:
                continue
            with torch.no_grad():
                if isinstance(param, DTensor):
                    full = distribute_tensor(full.to(param.device), param.device_mesh,
                                             param.placements, src_data_rank=None)
                param.copy_(full)
            return
        raise KeyError(f"the loaded '{key}' is no parameter of this rank's model parts")


def split_optimizer_state(state_dict: dict, model_parts: list[nn.Module],
                          layouts: dict[str, TPLayout]) -> tuple[dict, dict]:
    split = split_state_dict(state_dict, fused_parameters(model_parts, layouts),
                             key_of=optimizer_key)
    return logical_keys(split)


# A layer's key: (optimizer prefix, logical index, kind name from the layer-kind table).
_LAYER_KEY = re.compile(r"^((?:optimizer\.)?(?:state\.|param_groups\.)?)layers\.(\d+)\."
                        rf"({'|'.join(re.escape(kind.name) for kind in ALL_KINDS)})"
                        r"(_norm)?\.")


def _layers_by_kind(keys) -> dict[str, list[int]]:
    """Logical layer indices of each kind, in order, that the keys mention."""
    found: dict[str, set[int]] = {}
    for key in keys:
        match = _LAYER_KEY.match(key)
        if match:
            found.setdefault(match.group(3), set()).add(int(match.group(2)))
    return {kind: sorted(indices) for kind, indices in found.items()}


def map_layers_by_order(state_dict: dict, stored_keys) -> tuple[dict, dict[str, str], list[str]]:
    """Rename the model's layer keys to the checkpoint's by order within each layer kind: the
    k-th attention layer of the model reads the k-th attention layer of the checkpoint, and so
    on (a plain transformer `*-*-` into `[*-][*-]`, or into a hybrid's attention / MLP layers).
    Kinds the checkpoint lacks keep their fresh init (returned by name). A kind with a different
    number of layers on the two sides has no unambiguous mapping: ValueError.
    Returns (renamed state dict, {checkpoint key: model key}, fresh kinds)."""
    model_layers = _layers_by_kind(flattened_tensors(state_dict))
    stored_layers = _layers_by_kind(stored_keys)
    renames: dict[tuple[str, int], int] = {}
    fresh = []
    for kind, indices in model_layers.items():
        if kind not in stored_layers:
            fresh.append(kind)
            continue
        if len(stored_layers[kind]) != len(indices):
            raise JobError(
                f"cannot map layers by order: the model has {len(indices)} {kind} layer(s) "
                f"{indices}, the checkpoint {len(stored_layers[kind])} {stored_layers[kind]}")
        renames.update({(kind, mine): theirs for mine, theirs in zip(indices, stored_layers[kind])})

    def rename(key: str) -> str | None:
        match = _LAYER_KEY.match(key)
        if not match:
            return key
        kind, index = match.group(3), int(match.group(2))
        if kind in fresh:
            return None
        theirs = renames[(kind, index)]
        return f"{match.group(1)}layers.{theirs}.{key[len(match.group(1)) + len(f'layers.{index}.'):]}"

    mapped, model_key_of = {}, {}
    for key, value in state_dict.items():
        if hasattr(value, "state_dict") and not hasattr(value, "dim"):
            mapped[key] = value  # Stateful (optimizer, ...): a cross-load is model-only
            continue
        new = rename(key)
        if new is not None:
            mapped[new] = value
            model_key_of[new] = key
    return mapped, model_key_of, fresh


def flattened_tensors(state_dict: dict) -> dict:
    """The tensor entries as DCP will key them: Stateful values are expanded under their name."""
    flat = {}
    for key, value in state_dict.items():
        if hasattr(value, "state_dict") and not hasattr(value, "dim"):
            for inner_key, inner in value.state_dict().items():
                flat[f"{key}.{inner_key}"] = inner
        else:
            flat[key] = value
    return flat


def check_against_checkpoint(state_dict: dict, metadata, checkpoint_id: str, *,
                             allow_unexpected: bool = False, group=None, hint: str = "") -> dict:
    """Raise JobError (a ValueError) naming every key the checkpoint lacks or holds with another
    shape, or holds although no rank of `group` (all ranks by default: a pipeline stage holds
    only its own layers) asks for it; `hint` ends a message about keys. Returns the state dict
    with the final norm renamed if the checkpoint uses the alias."""
    stored = metadata.state_dict_metadata
    state_dict = dict(state_dict)
    for key, alias in FINAL_NORM_ALIASES.items():
        if key in state_dict and key not in stored and alias in stored:
            state_dict[alias] = state_dict.pop(key)
    if holds_megatron_mhc_keys(stored):
        state_dict = megatron_mhc_form(state_dict)
    missing, mismatched = [], []
    requested = flattened_tensors(state_dict)
    for key, value in requested.items():
        shape = getattr(value, "shape", None)
        if shape is None or not hasattr(value, "dim"):
            continue  # non-tensor states (dataloader, train_state, ...) are flattened by DCP
        if key not in stored:
            missing.append(key)
        elif hasattr(stored[key], "size") and tuple(stored[key].size) != tuple(shape):
            mismatched.append(f"{key}: checkpoint {tuple(stored[key].size)}, model {tuple(shape)}")
    wanted = set(requested)
    if not allow_unexpected and dist.is_initialized() and dist.get_world_size(group) > 1:
        every_rank: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(every_rank, wanted, group=group)
        wanted = set().union(*every_rank)
    unexpected = [] if allow_unexpected else [
        key for key in stored if not key.startswith(NON_MODEL_PREFIXES) and key not in wanted]
    if missing or mismatched or unexpected:
        def listing(keys):
            return ", ".join(sorted(keys)[:12]) + (" ..." if len(keys) > 12 else "")

        lines = [f"checkpoint '{checkpoint_id}' does not match the model:"]
        if missing:
            lines.append(f"  {len(missing)} key(s) missing from the checkpoint: {listing(missing)}")
        if unexpected:
            lines.append(f"  {len(unexpected)} checkpoint key(s) the model does not have: "
                         f"{listing(unexpected)}")
        if mismatched:
            lines.append(f"  {len(mismatched)} shape mismatch(es): " + "; ".join(mismatched[:12]))
        if (missing or unexpected) and hint:
            lines[-1] += hint
        raise JobError("\n".join(lines))
    return state_dict

"""The parts of a key map beyond a plain rename (an expert's slice, a copy of a shared tensor, a
reshaped tensor), the checks of the state dicts the key-map adapter (engine.py) converts, and
the config.json helpers several families share."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor, Shard

from titan_hybrid.checkpoint.split import ComponentChunks, local_placement

# ------------------------------------------------------------------ the state dicts adapters see
# titan_hybrid's checkpoint manager hands an adapter its split state dict: a fused parameter
# (Mamba2's in_proj, the SwiGLU fc1, ...) as its components `<key>.<part>` in global
# coordinates. torchtitan's own checkpointer (a user's torchtitan job) hands it the model's
# plain state dict: the fused parameter itself.


def layer_prefix(key: str) -> str | None:
    """"layers.3." of "layers.3.mamba.in_proj.weight" (None for the embedding, final norm and
    head, which a pipeline stage may lack)."""
    parts = key.split(".")
    return f"{parts[0]}.{parts[1]}." if parts[0] in ("layers", "mtp") and len(parts) > 2 else None


def check_present(state_dict: dict, ours: str, hf_key: str, layers: set[str]) -> None:
    """An HF tensor of a layer the state dict holds must have its source there: a tensor is
    never dropped silently (a pipeline stage holds only its own layers)."""
    if layer_prefix(ours) in layers:
        raise ValueError(f"the state dict has no '{ours}' (or its components) for the HF "
                         f"tensor '{hf_key}'")


def held_layers(state_dict: dict) -> set[str]:
    return {prefix for key in state_dict if (prefix := layer_prefix(key))}


def whole_fused(state_dict: dict, fused_key: str, hf_key: str):
    """The fused parameter of a plain state dict, whose rows are the HF tensor's in order
    (None if the state dict lacks it). Tensor parallelism interleaves the components' rows per
    rank, so a TP-sharded one is refused: titan_hybrid's trainer splits it when it saves."""
    value = state_dict.get(fused_key)
    if isinstance(value, DTensor):
        names = value.device_mesh.mesh_dim_names or ()
        if any(name in ("tp", "etp") and isinstance(placement, Shard)
               for name, placement in zip(names, value.placements)):
            raise ValueError(
                f"HF tensor '{hf_key}': '{fused_key}' is split by tensor parallelism, which "
                "interleaves its components per rank; read or write HF checkpoints of this "
                "model without TP, or through titan_hybrid's trainer (its checkpoint manager "
                "splits the components)")
    return value


def check_all_used(keys, used: set[str], what: str, rule: str) -> None:
    """A tensor on one side with no place on the other is an error naming it (never dropped):
    `keys` not in `used` -> ValueError listing them, `what` naming their side."""
    unused = sorted(key for key in keys if key not in used)
    if unused:
        listing = ", ".join(unused[:8]) + (f" ... ({len(unused)} in all)" if len(unused) > 8
                                           else "")
        raise ValueError(f"{len(unused)} {what} with no place in the {rule}: {listing}")


# transformers writes a float JSON has no literal for (inf, nan) as {"__float__": "Infinity"}.
FLOAT_TAG = "__float__"


def json_float(value) -> float:
    """A config.json number, tagged (transformers' {"__float__": "Infinity"}) or not."""
    return float(value[FLOAT_TAG] if isinstance(value, dict) else value)


def tagged_float(value: float):
    """A float as transformers writes it into a config.json."""
    return value if math.isfinite(value) else {FLOAT_TAG: str(value).replace("inf", "Infinity")}


class SharedCopy(NamedTuple):
    """An HF tensor that copies one our model shares (DeepSeek's MTP layer keeps its own copy
    of the embedding and of the head): written from ours (`key`), and when read, checked equal
    to `original`, the HF tensor it copies, so that a copy that differs is never dropped
    silently."""
    key: str
    original: str


def check_copy(hf_state_dict: dict, hf_key: str, copy: SharedCopy) -> None:
    """ValueError when a copy read differs from its original (each rank checks its own
    piece)."""
    original = hf_state_dict.get(copy.original)
    if original is None:  # a pipeline stage without the original checks nothing
        return

    def bits(tensor):  # bitwise, so that a NaN copied is equal to itself
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return local.contiguous().view(torch.uint8)

    copied = hf_state_dict[hf_key]
    if copied.dtype != original.dtype or not torch.equal(bits(copied), bits(original)):
        raise ValueError(f"HF tensor '{hf_key}' differs from '{copy.original}', which it "
                         "copies: titan_hybrid's MTP depth shares the model's tensor")


class Reshaped(NamedTuple):
    """An HF tensor that is our flat parameter `key` in another shape (Kimi Linear's A_log,
    [1, 1, heads, 1] for our [heads])."""
    key: str
    hf_shape: tuple[int, ...]


class ExpertSlice(NamedTuple):
    """An HF tensor that is one expert's slice of our [experts, ...] parameter (or of one of
    its components: the split state dict's `experts.fc1_w` / `_v`)."""
    key: str
    expert: int


def expert_slice(value: torch.Tensor, expert: int) -> torch.Tensor | None:
    """What this rank holds of `expert` in `value` (a plain tensor, a DTensor sharded over
    whole experts by FSDP / EP, or the split state dict's component of one): a view when it
    holds the whole expert, ComponentChunks of its rows when tensor parallelism splits the
    expert (a load lands in place), None when it holds none of it."""
    if isinstance(value, ComponentChunks):
        held, shape = value.chunks, value.shape
        source, fused_key, layout = value.source, value.fused_key, value.tp_layout
    else:
        local, shape, offsets = local_placement(value, None)
        held, source, fused_key, layout = [(offsets, local)], value, "", None
    pieces = [(torch.Size(offsets[1:]), view[expert - offsets[0]]) for offsets, view in held
              if offsets[0] <= expert < offsets[0] + view.shape[0]]
    if not pieces:
        return None
    if len(pieces) == 1 and tuple(pieces[0][1].shape) == tuple(shape[1:]):
        return pieces[0][1]
    return ComponentChunks(torch.Size(shape[1:]), pieces, source, fused_key, layout)


def softmax_routed(experts, *, shared_expert_gate: bool) -> bool:
    """Whether MoE args (MoEArgs) route as Qwen's and Granite's MoE layers do: SwiGLU experts, a
    softmax renormalised over the chosen experts (no bias, groups or scaling), and a shared
    expert, behind a sigmoid gate or not."""
    return ((experts.activation, experts.score_func, experts.normalizes_top_k,
             experts.score_correction_bias, experts.n_group, experts.routed_scaling_factor,
             experts.shared_expert_gate)
            == ("swiglu", "softmax", True, False, 1, 1.0, shared_expert_gate)
            and experts.shared_expert_hidden_dim > 0)


def time_step_limit(config: dict) -> tuple[float, float]:
    """A Mamba2 config's `time_step_limit` (transformers' default: no limit)."""
    low, high = config.get("time_step_limit") or (0.0, float("inf"))
    return json_float(low), json_float(high)


def attention_problems(args, expected: dict, family: str, *,
                       whole_heads: bool = False) -> list[str]:
    """What a format whose attention layers have `expected` (AttentionArgs field -> value;
    `whole_heads`: head_dim = dim / n_heads) finds wrong in the model's attention args: one
    part of its refusal, or none."""
    wrong = {k: getattr(args.attention, k) for k, v in expected.items()
             if getattr(args.attention, k) != v}
    if whole_heads and args.attention.head_dim * args.attention.n_heads != args.dim:
        wrong["head_dim"] = args.attention.head_dim
    if not wrong:
        return []
    return [f"attention: {wrong}; {family}'s attention has {expected}"
            + (" and head_dim = dim / n_heads" if whole_heads else "")]

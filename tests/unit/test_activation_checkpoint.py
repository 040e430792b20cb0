"""Activation checkpointing of HybridModel (titan_hybrid.parallel.activation_checkpoint): every
mode gives the gradients of no checkpointing bit for bit (the recompute repeats the same
arithmetic), and per-op selective AC keeps what it says it keeps: half the matmuls, and the
SSD scan's and gated delta rule's kernel outputs (counted with the profiler: a kept op does not
run again in the backward). `layer_kinds` wraps only the layers of the listed kinds, and the
backward reruns only their matmuls."""

from __future__ import annotations

import collections
import copy
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.triton_kernels import DEVICE, kernels_on, mamba3_kernels_on
from tests.unit.test_compile import loss_and_grads, tiny_model
from titan_hybrid.config.sections import ActivationCheckpointSection as ActivationCheckpoint
from titan_hybrid.model.args import hybrid_flavors
from titan_hybrid.model.model import HybridModel
from titan_hybrid.parallel.activation_checkpoint import apply_activation_checkpointing

MODES = {
    "full": ActivationCheckpoint(mode="full"),
    "selective op": ActivationCheckpoint(mode="selective", selective_ac_option="op"),
    "selective 2": ActivationCheckpoint(mode="selective", selective_ac_option="2"),
}


class OpRuns(TorchDispatchMode):
    """Counts the ops that really run. Entered before checkpointing's own mode, it sees an op
    only when that mode lets it through: an output kept from the forward is not counted again
    (a profiler would record the call either way)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _run(model, tokens) -> tuple[torch.Tensor, dict, collections.Counter]:
    with OpRuns() as runs:
        loss, grads = loss_and_grads(model, tokens)
    # parameter names without the checkpoint wrapper's own level
    grads = {name.replace("._checkpoint_wrapped_module", ""): grad for name, grad in grads.items()}
    return loss, grads, runs.counts


def _checkpointed(model, mode: str):
    model = copy.deepcopy(model)
    apply_activation_checkpointing(model, MODES[mode], model_compile_enabled=False,
                                   base_folder="")
    return model


def test_modes_give_the_same_gradients_and_selective_keeps_half_the_matmuls():
    model = tiny_model("M*G-")
    tokens = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(1))
    loss, grads, plain = _run(model, tokens)
    mm = {"none": plain["aten.mm"]}
    for mode in MODES:
        ac_loss, ac_grads, counts = _run(_checkpointed(model, mode), tokens)
        assert torch.equal(ac_loss, loss), mode
        for name, grad in grads.items():
            assert torch.equal(ac_grads[name], grad), (mode, name)
        mm[mode] = counts["aten.mm"]
    # full AC runs every forward matmul again; selective keeps every other one of them
    recomputed_full, recomputed_selective = mm["full"] - mm["none"], mm["selective op"] - mm["none"]
    assert recomputed_full > 0, mm
    assert recomputed_selective == recomputed_full // 2, mm
    # every second layer by its index in the model: layers 1 and 3 of 0-3
    assert _wrapped(_checkpointed(model, "selective 2")) == ["1", "3"]
    assert 0 < mm["selective 2"] - mm["none"] < recomputed_full, mm


def _wrapped(model) -> list[str]:
    return [name for name, layer in model.layers.named_children()
            if hasattr(layer, "_checkpoint_wrapped_module")]


@pytest.mark.parametrize("pattern, kinds, mode, wrapped", [
    ("M*G-", "*-", "full", ["1", "3"]),
    ("M*G-", "MG", "selective op", ["0", "2"]),
    # a bracket group is one checkpoint unit: it is checkpointed when it holds a listed kind
    ("[M*]G-", "*", "full", ["0"]),
    ("[M*]G-", "-", "selective 2", []),  # selective 2 picks layer 1, which holds no MLP
    ("[M*]G-M-", "-M", "selective 2", ["3"]),
])
def test_layer_kinds_checkpoint_only_the_layers_of_those_kinds(pattern, kinds, mode, wrapped):
    model = tiny_model(pattern)
    tokens = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(1))
    loss, grads, plain = _run(model, tokens)
    config = dataclasses.replace(MODES[mode], layer_kinds=kinds)
    checkpointed = copy.deepcopy(model)
    summary = apply_activation_checkpointing(checkpointed, config, model_compile_enabled=False,
                                             base_folder="")
    assert _wrapped(checkpointed) == wrapped
    assert summary.endswith(f"layer kinds {kinds}) of {len(wrapped)} of {len(model.layers)} "
                            "layers / groups"), summary
    ac_loss, ac_grads, counts = _run(checkpointed, tokens)
    assert torch.equal(ac_loss, loss)
    for name, grad in grads.items():
        assert torch.equal(ac_grads[name], grad), name
    # the recompute reruns the checkpointed layers' matmuls and no other layer's
    layer_matmuls = _forward_matmuls(model, tokens)
    # (per-op selective keeps a region's first, third, ... matmul and recomputes the others)
    share = (lambda count: count // 2) if mode == "selective op" else (lambda count: count)
    recomputed = sum(share(layer_matmuls[name]) for name in wrapped)
    assert counts["aten.mm"] - plain["aten.mm"] == recomputed, (layer_matmuls, counts["aten.mm"])


def _forward_matmuls(model, tokens) -> dict[str, int]:
    """The matmuls each top-level layer runs in the model's forward."""
    runs, before, matmuls = OpRuns(), {}, {}
    handles = []
    for name, layer in model.layers.named_children():
        handles.append(layer.register_forward_pre_hook(
            lambda module, args, name=name: before.__setitem__(name, runs.counts["aten.mm"])))
        handles.append(layer.register_forward_hook(
            lambda module, args, out, name=name: matmuls.__setitem__(
                name, runs.counts["aten.mm"] - before[name])))
    with torch.no_grad(), runs:
        model(tokens)
    for handle in handles:
        handle.remove()
    return matmuls


@pytest.mark.parametrize("config, message", [
    (ActivationCheckpoint(mode="partial"), "activation_checkpoint.mode 'partial' is not one of"),
    (ActivationCheckpoint(mode="selective", selective_ac_option="x"),
     "selective_ac_option 'x' must be 'op' or a positive integer"),
    (ActivationCheckpoint(mode="memory_budget"), "'memory_budget' needs compile.enable"),
    (ActivationCheckpoint(mode="none", layer_kinds="*"),
     "layer_kinds '\\*' chooses the layers of mode full or selective, not of mode 'none'"),
    (ActivationCheckpoint(mode="full", layer_kinds="*x"),
     "layer_kinds '\\*x': 'x' is not a layer symbol"),
])
def test_bad_modes_are_named(config, message):
    with pytest.raises(ValueError, match=message):
        apply_activation_checkpointing(tiny_model("M-"), config, model_compile_enabled=False,
                                       base_folder="")


@pytest.mark.triton_interpreter
@pytest.mark.filterwarnings("ignore::UserWarning")  # fla: "Triton is not supported on ... CPU"
def test_selective_ac_keeps_the_scan_kernels_outputs():
    model = tiny_model("M-G-K-").to(DEVICE)
    tokens = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(2))
    scans = ("titan_hybrid.mamba2_core_fwd", "titan_hybrid.fla_gated_delta_fwd",
             "titan_hybrid.fla_kda_fwd")
    with kernels_on():
        loss, grads, plain = _run(model, tokens.to(DEVICE))
        runs = {"none": [plain[name] for name in scans]}
        # "selective 2" wraps whole layers (here the MLPs, which run no scan): the test above
        # checks which.
        for mode in ("full", "selective op"):
            ac_loss, ac_grads, counts = _run(_checkpointed(model, mode), tokens.to(DEVICE))
            runs[mode] = [counts[name] for name in scans]
            torch.testing.assert_close(ac_loss, loss, rtol=0, atol=0)
            for name, grad in grads.items():
                torch.testing.assert_close(ac_grads[name], grad, rtol=0, atol=0)
    assert runs == {"none": [1, 1, 1], "full": [2, 2, 2], "selective op": [1, 1, 1]}


def _forward_kernel_runs(args, op: str, kernels) -> dict[str, int]:
    """How often the `M-` model of ARGS runs the forward kernel OP under no AC, full AC and
    per-op selective AC (inside KERNELS), asserting that every mode's loss and gradients are
    no AC's bit for bit."""
    torch.manual_seed(0)
    model = HybridModel(args)
    model.init_weights()
    model = model.to(DEVICE)
    tokens = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(2))
    with kernels():
        loss, grads, plain = _run(model, tokens.to(DEVICE))
        runs = {"none": plain[op]}
        for mode in ("full", "selective op"):
            ac_loss, ac_grads, counts = _run(_checkpointed(model, mode), tokens.to(DEVICE))
            runs[mode] = counts[op]
            assert torch.equal(ac_loss, loss), mode
            for name, grad in grads.items():
                assert torch.equal(ac_grads[name], grad), (mode, name)
    return runs


@pytest.mark.triton_interpreter
def test_selective_ac_keeps_mamba1s_scan_kernel_output():
    """Mamba1 (m_layers "mamba1") on our Triton selective scan: full AC runs the scan's forward
    again in the backward, per-op selective AC keeps its output; gradients bit for bit."""
    args = dataclasses.replace(copy.deepcopy(hybrid_flavors["debug"]), pattern="M-", dim=64,
                               vocab_size=128, max_seq_len=64, m_layers="mamba1")
    assert _forward_kernel_runs(args, "titan_hybrid.triton_selective_scan_fwd", kernels_on) == {
        "none": 1, "full": 2, "selective op": 1}


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("mimo", [False, True], ids=["siso", "mimo"])
def test_selective_ac_keeps_mamba3s_kernel_output(mimo):
    """Mamba-3 (m_layers "mamba3") on mamba_ssm's kernels, SISO (Triton) and MIMO (TileLang;
    on CPU their stand-in, tests/triton_kernels.py): the same."""
    args = dataclasses.replace(copy.deepcopy(hybrid_flavors["debug_mamba3"]), pattern="M-",
                               dim=64, vocab_size=128, max_seq_len=64)
    size = 32 if mimo else 16  # MIMO's kernels take the sizes mamba_ssm tested them on
    args.mamba3 = dataclasses.replace(args.mamba3, d_state=size, head_dim=size, chunk_size=16,
                                      mimo=mimo)
    op = f"titan_hybrid.mamba3_{'mimo' if mimo else 'siso'}_fwd"
    assert _forward_kernel_runs(args, op, mamba3_kernels_on) == {
        "none": 1, "full": 2, "selective op": 1}


def test_the_scan_kernels_declare_themselves_kept_by_selective_ac():
    """Every sequence-mixing kind's kernel forward is in the save set because its op module
    says so (ops/custom_ops.py), not because a list here names it; the set is read when AC is
    applied, so an op declared after the AC module was imported is in it too."""
    import titan_hybrid.model.layer_kinds  # noqa: F401  (every kind, and so every op module)
    from titan_hybrid.ops.custom_ops import kernel_op
    from titan_hybrid.parallel.activation_checkpoint import selective_ac_saved_ops

    scans = {torch.ops.titan_hybrid.mamba_ssd_fwd.default,
             torch.ops.titan_hybrid.mamba2_core_fwd.default,
             torch.ops.titan_hybrid.fla_gated_delta_fwd.default,
             torch.ops.titan_hybrid.fla_kda_fwd.default,
             torch.ops.titan_hybrid.fla_gdn2_fwd.default,
             torch.ops.titan_hybrid.triton_selective_scan_fwd.default,
             torch.ops.titan_hybrid.mamba3_siso_fwd.default,
             torch.ops.titan_hybrid.mamba3_mimo_fwd.default}
    assert scans <= selective_ac_saved_ops()
    assert torch.ops.titan_hybrid.causal_conv1d_fwd.default not in selective_ac_saved_ops()

    @kernel_op("test_only_late_scan_fwd", saved_by_selective_ac=True)
    def late_scan(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    assert torch.ops.titan_hybrid.test_only_late_scan_fwd.default in selective_ac_saved_ops()

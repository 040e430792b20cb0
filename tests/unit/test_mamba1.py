"""Mamba1 (`m_layers = "mamba1"`, model/mamba1.py) against transformers' own Mamba1 mixers in
float64, their weights loaded as they are: MambaMixer (no dt / B / C norms), FalconMambaMixer
(weightless RMS norms) and JambaMambaMixer (weighted ones), outputs and every gradient; packed
documents against each document alone; its FLOPs against torch's FLOP counter; and how tensor
and context parallelism cut its channels. The scan itself: tests/unit/test_selective_scan.py."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

from titan_hybrid.config.sections import ParallelismSection, TrainingSection
from titan_hybrid.model.args import resolve_model_args
from titan_hybrid.model.layout import TokenLayout
from titan_hybrid.model.mamba1 import KIND, Mamba1Args, Mamba1Mixer
from titan_hybrid.parallel.validate import validate_context_parallel, validate_tensor_parallel

DIM, STATE, LENGTH = 16, 4, 21
FAMILIES = {  # name: (transformers mixer, its config, our dt_bc_norm)
    "mamba": ("transformers.models.mamba.modeling_mamba.MambaMixer", transformers.MambaConfig,
              dict(), "none"),
    "falcon_mamba": ("transformers.models.falcon_mamba.modeling_falcon_mamba.FalconMambaMixer",
                     transformers.FalconMambaConfig, dict(mixer_rms_eps=1e-6), "weightless"),
    "jamba": ("transformers.models.jamba.modeling_jamba.JambaMambaMixer", transformers.JambaConfig,
              dict(mamba_d_state=STATE, mamba_expand=2, mamba_d_conv=4, mamba_dt_rank=3,
                   rms_norm_eps=1e-6, use_mamba_kernels=False), "weighted"),
}


def close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal within 1e-5 of the tensor's scale."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * scale)


def theirs_and_ours(family: str):
    path, config_type, fields, norm = FAMILIES[family]
    module, name = path.rsplit(".", 1)
    mixer_type = getattr(__import__(module, fromlist=[name]), name)
    if family == "jamba":
        config = config_type(hidden_size=DIM, num_hidden_layers=1, **fields)
        rank = 3
    else:
        config = config_type(hidden_size=DIM, state_size=STATE, expand=2, conv_kernel=4,
                             time_step_rank=3, num_hidden_layers=1, **fields)
        rank = 3
    torch.manual_seed(0)
    # transformers 5.24's FalconMambaMixer cannot initialize its own weights (its init reads
    # its norms before it builds them): every weight is drawn here instead.
    theirs = mixer_type(config, layer_idx=0, **({"initialize_mixer_weights": False}
                                                if family == "falcon_mamba" else {})).double()
    with torch.no_grad():
        for name, parameter in theirs.named_parameters():
            parameter.copy_(0.3 * torch.randn_like(parameter)
                            + (1.0 if name.endswith("layernorm.weight") else 0.0))
    eps = fields.get("mixer_rms_eps", fields.get("rms_norm_eps", 0.0))
    ours = Mamba1Mixer(dim=DIM, args=Mamba1Args(d_state=STATE, expand=2, conv_width=4,
                                                dt_rank=rank, dt_bc_norm=norm,
                                                norm_eps=eps)).double()
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_mixer_is_transformers_mamba1_mixer(family):
    theirs, ours = theirs_and_ours(family)
    x = torch.randn(2, LENGTH, DIM, dtype=torch.float64)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ours, y_theirs = ours(x_ours), theirs(x_theirs)
    # transformers computes A, D and dt's bias in fp32 whatever the model's dtype: 1e-5.
    close(y_ours, y_theirs)
    cotangent = torch.randn_like(y_ours)
    (y_ours * cotangent).sum().backward()
    (y_theirs * cotangent).sum().backward()
    close(x_ours.grad, x_theirs.grad)
    for name, parameter in theirs.named_parameters():
        close(ours.get_parameter(name).grad, parameter.grad)


def test_packed_documents_are_each_document_alone():
    _, ours = theirs_and_ours("jamba")
    lengths = (5, 12, 4)
    x = torch.randn(1, sum(lengths), DIM, dtype=torch.float64)
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    packed = ours(x, TokenLayout(positions=None, seq_idx=seq_idx))
    alone = torch.cat([ours(part) for part in x.split(lengths, 1)], 1)
    torch.testing.assert_close(packed, alone, rtol=1e-10, atol=1e-10)


def test_mfu_counts_the_scans_update_and_read_out():
    """The kind's core FLOPs are what torch's FLOP counter sees the scan do per token (the
    read-out C . h, a product), plus the state's update, a multiply-add per channel and state
    entry that the counter does not count (elementwise)."""
    args = Mamba1Args(d_state=STATE, expand=2)
    mixer = Mamba1Mixer(dim=DIM, args=args).double()
    x = torch.randn(2, 64, DIM, dtype=torch.float64)
    with FlopCounterMode(display=False) as counter:
        mixer(x)
    weights = sum(p.numel() for name, p in mixer.named_parameters()
                  if name.endswith("weight") and p.dim() > 1)
    core = counter.get_total_flops() / (2 * 64) - 2 * weights
    update = 2 * args.d_inner(DIM) * STATE
    assert core + update == KIND.core_flops(args, DIM, 64)


def test_tensor_and_context_parallelism_split_the_channels():
    """TP2 is accepted: in_proj's x and z parts, the conv, dt_proj, A_log, D by channel, x_proj
    and out_proj by their input channels, the dt / B / C norms replicated. CP2 in both modes:
    the head exchange takes every channel-wise argument by channel, and a channel count that
    CP does not divide is refused by name (the TP2 and CP2 curves:
    tests/distributed/test_mamba1.py)."""
    args = resolve_model_args("debug_mamba1", seq_len=64)
    validate_tensor_parallel(args, 2, seq_len=64, sequence_parallel=True)
    mixer = Mamba1Mixer(dim=32, args=args.mamba1)
    layouts = mixer.tensor_parallel_layouts()
    assert layouts["in_proj.weight"].partition_names == (".x", ".z")
    assert layouts["x_proj.weight"].shard_dim == layouts["out_proj.weight"].shard_dim == 1
    assert all(layouts[name].shard_dim == 0 for name in ("conv1d.weight", "dt_proj.bias",
                                                          "A_log", "D"))
    assert not any("layernorm" in name for name in layouts)
    rule = KIND.context_parallel
    plan = rule.head_channels(args.mamba1, {"conv_weight_CW": torch.empty(64, 4)})
    assert (plan.heads, plan.groups) == (64, 64)
    assert sorted(plan.exchanged) == ["x_BTC", "z_BTC"]
    # every other channel-wise argument is cut; the norms' weights (over dt / B / C) are whole
    core_arguments = inspect.signature(mixer.core.forward).parameters
    assert sorted(plan.whole) == sorted(name for name in core_arguments if "norm" in name)
    assert sorted(plan.sliced) == sorted(
        set(core_arguments) - {"x_BTC", "z_BTC", "layout", *plan.whole})
    for mode in ("head_a2a", "chunkwise"):
        validate_context_parallel(args, ParallelismSection(
            context_parallel_degree=2, context_parallel_linear_mode=mode),
            TrainingSection(seq_len=64))
    channels = args.mamba1.d_inner(args.dim)
    with pytest.raises(ValueError, match=rf"^mamba1 d_inner \(channels\)={channels} \(per "
                                         r"tensor-parallel rank\) is not divisible by "
                                         r"context_parallel_degree=3"):
        validate_context_parallel(args, ParallelismSection(context_parallel_degree=3),
                                  TrainingSection(seq_len=96))
    assert dataclasses.replace(args).m_layers == "mamba1"

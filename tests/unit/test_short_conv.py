"""The gated short convolution (`S`, model/short_conv.py) against transformers' Lfm2ShortConv
in float64 (with and without LFM2's biases), packed documents against each document run
alone, and its FLOPs against torch's FLOP counter. Its layouts in the real trainer:
tests/distributed/test_short_conv_and_parallel_groups.py."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers.models.lfm2 import Lfm2Config
from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv

from titan_hybrid.model.args import resolve_model_args
from titan_hybrid.model.flops import nparams_and_flops_per_token
from titan_hybrid.model.layout import TokenLayout
from titan_hybrid.model.model import HybridModel
from titan_hybrid.model.short_conv import KIND, ShortConv, ShortConvArgs

DIM = 24


def assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to float64 rounding of sums over the weights (unit-normal ones here):
    1e-10 of the tensor's scale."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10 * scale)


def ours_and_theirs(bias: bool) -> tuple[ShortConv, Lfm2ShortConv]:
    torch.manual_seed(0)
    theirs = Lfm2ShortConv(Lfm2Config(hidden_size=DIM, conv_bias=bias, conv_L_cache=3,
                                      num_hidden_layers=1), layer_idx=0).double()
    with torch.no_grad():
        for parameter in theirs.parameters():
            parameter.normal_()
    ours = ShortConv(dim=DIM, args=ShortConvArgs(conv_width=3, bias=bias)).double()
    ours.load_state_dict({name.replace("conv.weight", "conv1d.weight")
                          .replace("conv.bias", "conv1d.bias"): value
                          for name, value in theirs.state_dict().items()})
    return ours, theirs


@pytest.mark.parametrize("bias", [False, True])
def test_the_layer_is_transformers_lfm2_short_conv(bias):
    ours, theirs = ours_and_theirs(bias)
    x = torch.randn(2, 17, DIM, dtype=torch.float64)
    expected = theirs(x)
    assert_close(ours(x), expected)
    # The gradients too: of the input and of every weight.
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours(x_ours).square().sum().backward()
    theirs(x_theirs).square().sum().backward()
    assert_close(x_ours.grad, x_theirs.grad)
    for name, parameter in theirs.named_parameters():
        mine = ours.get_parameter(name.replace("conv.", "conv1d.")
                                  if name.startswith("conv.") else name)
        assert_close(mine.grad, parameter.grad)


def test_packed_documents_are_each_document_alone():
    ours, _ = ours_and_theirs(bias=True)
    lengths = (5, 1, 9, 2)
    x = torch.randn(1, sum(lengths), DIM, dtype=torch.float64)
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = ours(x, TokenLayout(positions=positions, seq_idx=seq_idx))
    alone = torch.cat([ours(part) for part in x.split(lengths, 1)], 1)
    assert_close(packed, alone)
    # Without the layout the conv reads across the documents: a different output.
    assert not torch.allclose(ours(x), alone)


def test_flops_are_the_weights_multiply_adds():
    """The kind declares no core FLOPs: torch's FLOP counter sees the mixer's forward do 2
    FLOPs per weight and token (in_proj, the depthwise conv, out_proj), which MFU's 6 *
    parameters counts; the model's MFU count is then exactly 6 * its parameters (plus
    attention's core) for a model of `S` and `-` layers."""
    ours, _ = ours_and_theirs(bias=False)
    x = torch.randn(2, 32, DIM, dtype=torch.float64)
    with FlopCounterMode(display=False) as counter:
        ours(x)
    weights = sum(p.numel() for p in ours.parameters())
    assert counter.get_total_flops() == 2 * weights * x.shape[0] * x.shape[1]
    assert KIND.core_flops(ShortConvArgs(), DIM, 32) == 0
    args = resolve_model_args("debug_short_conv", pattern="S-S-", seq_len=64)
    model = HybridModel(args)
    params, flops = nparams_and_flops_per_token(args, model, 64)
    embedding = model.tok_embeddings.weight.numel()
    assert flops == 6 * (params - embedding)


def test_biases_are_refused_under_tensor_parallelism_by_name():
    from titan_hybrid.parallel.validate import validate_tensor_parallel

    args = resolve_model_args("debug_short_conv", seq_len=64)
    validate_tensor_parallel(args, 2, seq_len=64, sequence_parallel=True)
    args.short_conv.bias = True
    validate_tensor_parallel(args, 1, seq_len=64, sequence_parallel=False)
    with pytest.raises(ValueError, match=r"short_conv.bias=True under tensor parallelism"):
        validate_tensor_parallel(args, 2, seq_len=64, sequence_parallel=True)

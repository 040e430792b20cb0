"""Parallel groups `(...)` (model/pattern.py): the grammar and its refusals, the layer's
arithmetic (members on one normed input, summed into the residual), a bracket group around one
computing bit for bit what the same layers compute flat, MFU's FLOPs, and the refusal of the HF
formats that cannot hold one. Their layouts in the real trainer:
tests/distributed/test_short_conv_and_parallel_groups.py."""

from __future__ import annotations

import pytest
import torch

from titan_hybrid.hf.families import check_hf_compatible
from titan_hybrid.model.args import resolve_model_args
from titan_hybrid.model.flops import nparams_and_flops_per_token
from titan_hybrid.model.layout import TokenLayout
from titan_hybrid.model.model import HybridLayer, HybridModel
from titan_hybrid.model.pattern import parse_hybrid_pattern


def test_a_parallel_group_is_one_physical_layer_of_its_members():
    pattern = parse_hybrid_pattern("M[(M*)-]E(*-)")
    assert pattern.main == ["M", ("M*", "-"), "E", "*-"]
    assert pattern.physical_layer_symbols() == ["M", "M*", "-", "E", "*-"]
    assert pattern.num_physical_layers == 5 and pattern.num_logical_layers == 4
    assert pattern.member_symbols() == {"M", "*", "-", "E"}


@pytest.mark.parametrize("text, message", [
    ("(M)-", "'(' at position 0 opens a parallel group of 1 layer(s); a parallel group needs "
             "at least two"),
    ("(MM)-", "'M' at position 2 joins 'M' at position 1 in checkpoint namespace 'mixer'"),
    ("(G*)", "'*' at position 2 joins 'G' at position 1 in checkpoint namespace "
             "'self_attention': a parallel group's members hold distinct namespaces"),
    ("(ME)", "'E' at position 2 may not be a member of a parallel group"),
    ("(M*-", "'(' at position 0 opens an unmatched parallel group: it is never closed"),
    ("M*)", "')' at position 2 is a stray ')' with no open parallel group"),
    ("((M*))", "'(' at position 1 opens a parallel group inside the parallel group at "
               "position 0"),
    ("(M[*])", "'[' at position 2 is not allowed inside a parallel group (opened at position "
               "0), which holds layer symbols only"),
    ("(M|*)", "'|' at position 2 is not allowed inside a parallel group"),
    ("M-/(M*)", "'(' at position 3 opens a parallel group in an MTP depth"),
    ("[(M*)*]", "'*' at position 5 joins '*' at position 3 in checkpoint namespace"),
    ("[E(M*)]", "'E' at position 1 must be the last symbol of a group"),
])
def test_malformed_parallel_groups_are_named_by_position(text, message):
    with pytest.raises(ValueError) as error:
        parse_hybrid_pattern(text)
    assert message in str(error.value), str(error.value)


def model(pattern: str, seed: int = 0) -> HybridModel:
    torch.manual_seed(seed)
    built = HybridModel(resolve_model_args("debug", pattern=pattern, seq_len=32)).double()
    built.init_weights()
    return built


def test_the_members_read_one_normed_input_and_their_outputs_add_up():
    layer = model("(M*)-").layers["0"]
    assert isinstance(layer, HybridLayer) and layer.symbol == "M*"
    assert [name for name, _ in layer.named_children()] == ["mamba_attention_norm", "mamba",
                                                            "attention"]
    h = torch.randn(2, 32, 256, dtype=torch.float64)
    layout = TokenLayout(positions=None, seq_idx=None,
                         rope_table=model("(M*)-").rope.double())
    out, _ = layer(h, torch.zeros((), dtype=torch.float64), layout)
    x = layer.mamba_attention_norm(h)
    expected = h + (layer.mamba(x, layout) + layer.attention(x, layout))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_a_bracket_group_around_a_parallel_group_computes_what_it_computes_flat():
    flat, grouped = model("(M*)-M-"), model("[(M*)-]M-")
    grouped.load_state_dict({_grouped_key(key): value
                             for key, value in flat.state_dict().items()})
    tokens = torch.randint(0, 2048, (2, 32))
    assert torch.equal(flat(tokens), grouped(tokens))


def _grouped_key(key: str) -> str:
    """The key of `(M*)-M-`'s layer in `[(M*)-]M-`: layers 0 and 1 in group 0, 2 and 3 as
    logical layers 1 and 2."""
    parts = key.split(".")
    if parts[0] != "layers":
        return key
    index = int(parts[1])
    if index < 2:
        return ".".join(["layers", "0", "layers", str(index), *parts[2:]])
    return ".".join(["layers", str(index - 1), *parts[2:]])


def test_mfu_counts_every_member():
    """A parallel group's FLOPs are its members' (core and weights): (M*)- counts what M*-
    counts, less the one input norm it shares."""
    args_parallel = resolve_model_args("debug", pattern="(M*)-", seq_len=64)
    args_sequence = resolve_model_args("debug", pattern="M*-", seq_len=64)
    params_p, flops_p = nparams_and_flops_per_token(args_parallel, HybridModel(args_parallel), 64)
    params_s, flops_s = nparams_and_flops_per_token(args_sequence, HybridModel(args_sequence), 64)
    assert params_s - params_p == 256  # one norm of the model's width
    assert flops_s - flops_p == 6 * 256


def test_an_hf_format_that_cannot_hold_a_parallel_group_names_it():
    with pytest.raises(ValueError, match=r"hybrid.pattern '\(M\*\)-\(M\*\)-' has layer types "
                                         r"\['M\*'\]"):
        check_hf_compatible(resolve_model_args("debug_parallel", seq_len=64))


def test_activation_checkpointing_chooses_a_group_by_any_of_its_members():
    """`activation_checkpoint.layer_kinds` names kinds: a parallel group holding one is
    checkpointed, and the pre-flight check counts the members as the pattern's kinds."""
    from titan_hybrid.config.sections import ActivationCheckpointSection
    from titan_hybrid.parallel.activation_checkpoint import (
        apply_activation_checkpointing,
        check_activation_checkpoint,
    )

    pattern = parse_hybrid_pattern("(M*)-S-")
    for kinds, count in (("*", 1), ("M", 1), ("S-", 3)):
        config = ActivationCheckpointSection(mode="full", layer_kinds=kinds)
        check_activation_checkpoint(config, model_compile_enabled=False,
                                    pattern_symbols=pattern.member_symbols())
        built = HybridModel(resolve_model_args("debug", pattern=pattern.text, seq_len=32))
        done = apply_activation_checkpointing(built, config, model_compile_enabled=False,
                                              base_folder="")
        assert f"of {count} of 4 layers" in done, (kinds, done)

"""Tests for the hybrid layer pattern grammar (titan_hybrid.model.pattern)."""

import re

import pytest

from titan_hybrid.model.pattern import HybridPattern, parse_hybrid_pattern, physical_symbols
from titan_hybrid.model.symbols import SYMBOLS


def _raises(pattern, *fragments):
    """Parse `pattern`, expect a ValueError whose message holds every fragment."""
    with pytest.raises(ValueError) as info:
        parse_hybrid_pattern(pattern)
    message = str(info.value)
    assert f"hybrid pattern {pattern!r}" in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


# --- parse results ------------------------------------------------------------

def test_symbol_names():
    assert {symbol: spec.name for symbol, spec in SYMBOLS.items()} == {
        "M": "mamba", "G": "gdn", "K": "kda", "S": "short_conv", "*": "attention", "+": "mla", "D": "dsa",
        "W": "window_attention", "C": "compressed_sparse_attention",
        "H": "heavily_compressed_attention", "-": "mlp", "E": "moe"}


def test_physical_symbols():
    assert physical_symbols("M") == ("M",)
    assert physical_symbols(("M", "*")) == ("M", "*")


def test_flat_pattern():
    p = parse_hybrid_pattern("M*M-E")
    assert isinstance(p, HybridPattern)
    assert p.text == "M*M-E"
    assert p.main == ["M", "*", "M", "-", "E"]
    assert p.mtp == [] and p.mtp_depths == 0
    assert p.segments == [p.main]
    assert p.num_logical_layers == 5 and p.num_physical_layers == 5


def test_all_symbols_accepted():
    assert parse_hybrid_pattern("MG*-E").main == ["M", "G", "*", "-", "E"]


def test_lists_are_lists():
    p = parse_hybrid_pattern("M[M*]-|E/*-")
    assert type(p.main) is list and type(p.mtp) is list and type(p.segments) is list
    assert all(type(segment) is list for segment in p.segments)


def test_group_is_one_logical_layer():
    p = parse_hybrid_pattern("M[M*]-")
    assert p.main == ["M", ("M", "*"), "-"]
    assert p.num_logical_layers == 3
    assert p.num_physical_layers == 4


def test_whole_pattern_group_with_moe_last():
    p = parse_hybrid_pattern("[M*E]")
    assert p.main == [("M", "*", "E")]
    assert p.num_logical_layers == 1 and p.num_physical_layers == 3


def test_single_symbol_group_is_a_tuple():
    p = parse_hybrid_pattern("[M]*")
    assert p.main == [("M",), "*"]
    assert p.num_logical_layers == 2 and p.num_physical_layers == 2


def test_moe_last_in_group_is_fine():
    assert parse_hybrid_pattern("[*E]").main == [("*", "E")]
    assert parse_hybrid_pattern("[E]").main == [("E",)]


def test_mtp_two_depths():
    p = parse_hybrid_pattern("M*-/*-/*-")
    assert p.main == ["M", "*", "-"]
    assert p.mtp == ["*", "-"]
    assert p.mtp_depths == 2
    assert p.num_physical_layers == 3  # MTP layers are not main layers


def test_mtp_one_depth():
    p = parse_hybrid_pattern("M*/E")
    assert p.mtp == ["E"] and p.mtp_depths == 1


def test_trailing_slash_means_zero_depths():
    p = parse_hybrid_pattern("M*-/")
    assert p.main == ["M", "*", "-"]
    assert p.mtp == [] and p.mtp_depths == 0


def test_segments_split_at_pipes():
    p = parse_hybrid_pattern("M*|M[M*]E")
    assert p.main == ["M", "*", "M", ("M", "*"), "E"]
    assert p.segments == [["M", "*"], ["M", ("M", "*"), "E"]]


def test_empty_segments_allowed():
    assert parse_hybrid_pattern("M||*").segments == [["M"], [], ["*"]]
    assert parse_hybrid_pattern("|M").segments == [[], ["M"]]
    assert parse_hybrid_pattern("M|").segments == [["M"], []]


def test_segments_with_mtp():
    p = parse_hybrid_pattern("M|*/-/-")
    assert p.segments == [["M"], ["*"]]
    assert p.mtp == ["-"] and p.mtp_depths == 2


def test_equal_and_hashable():
    a, b = parse_hybrid_pattern("M[M*]"), parse_hybrid_pattern("M[M*]")
    assert a == b and hash(a) == hash(b)
    assert a != parse_hybrid_pattern("M[*M]")
    assert len({a, b}) == 1


# --- parse errors -------------------------------------------------------------

@pytest.mark.parametrize("pattern, main, mtp, depths", [
    ("M+-MD-", ["M", "+", "-", "M", "D", "-"], [], 0),
    ("M[M+]E|D-/+E/+E", ["M", ("M", "+"), "E", "D", "-"], ["+", "E"], 2),
    ("[D-]+", [("D", "-"), "+"], [], 0),
    ("MD-/D-", ["M", "D", "-"], ["D", "-"], 1),
    ("MW-", ["M", "W", "-"], [], 0),
    ("[MW-]", [("M", "W", "-")], [], 0),
    ("MW-MD-/W-", ["M", "W", "-", "M", "D", "-"], ["W", "-"], 1),
    ("MH-MW-", ["M", "H", "-", "M", "W", "-"], [], 0),
    ("[MH-]W", [("M", "H", "-"), "W"], [], 0),
    ("MH-/H-", ["M", "H", "-"], ["H", "-"], 1),
    ("MC-MH-MW-", ["M", "C", "-", "M", "H", "-", "M", "W", "-"], [], 0),
    ("[MC-]|[MHE]W/C-", [("M", "C", "-"), ("M", "H", "E"), "W"], ["C", "-"], 1),
])
def test_mla_and_dsa_symbols_parse_everywhere_a_layer_may_be(pattern, main, mtp, depths):
    parsed = parse_hybrid_pattern(pattern)
    assert (parsed.main, parsed.mtp, parsed.mtp_depths) == (main, mtp, depths)


@pytest.mark.parametrize("pattern, char, pos, other_pos", [
    ("M*-+", "+", 3, 1),
    ("MD-M*", "D", 1, 4),
    ("M*|D-", "D", 3, 1),  # segments of one main part
    ("[M*][+-]", "+", 5, 2),
    ("M-/*+/*+", "+", 4, 3),
    # Megatron's head checks main + MTP as one string (issue 27's examples).
    ("M*-/+-", "+", 4, 1),
    ("MD-/*-/*-", "D", 1, 4),
    ("+/*", "+", 0, 2),
    ("W*", "W", 0, 1),
    ("W-/*-", "W", 0, 3),
    ("MH*", "H", 1, 2),
    ("*-/H-", "H", 3, 0),
    ("MC*", "C", 1, 2),
    ("*-/C-", "C", 3, 0),
    ("[M*]|C-", "C", 5, 2),
])
def test_self_attention_cannot_share_a_model_with_the_mla_family(pattern, char, pos,
                                                                 other_pos):
    _raises(pattern, f"'{char}' at position {pos} cannot share a model with '*' at position "
            f"{other_pos}: self-attention and the MLA family (+ D C H W) may not be mixed",
            "Not supported to have both Attention and MLA/DSA/CSA/HCA/Window in one model")


@pytest.mark.parametrize("pattern, char, pos, first, first_pos, namespace, group", [
    # issue 27's examples
    ("[MM]", "M", 2, "M", 1, "mixer", "[MM]"),
    ("[*G]", "G", 2, "*", 1, "self_attention", "[*G]"),
    ("[G+]", "+", 2, "G", 1, "self_attention", "[G+]"),
    ("[-E]", "E", 2, "-", 1, "mlp", "[-E]"),
    ("[M-DME]", "M", 4, "M", 1, "mixer", "[M-DME]"),
    # later groups, positions in the full pattern
    ("M-[M*][D-+]", "+", 9, "D", 7, "self_attention", "[D-+]"),
    ("[--", "-", 2, "-", 1, "mlp", "[--"),  # reported before the unclosed group
    # the DeepSeek-V4 kinds share the self_attention namespace
    ("[CH]", "H", 2, "C", 1, "self_attention", "[CH]"),
    ("M[MW-C]", "C", 5, "W", 3, "self_attention", "[MW-C]"),
    # KDA is built like GDN: a self_attention layer
    ("[KG]", "G", 2, "K", 1, "self_attention", "[KG]"),
    ("[M*K]", "K", 3, "*", 2, "self_attention", "[M*K]"),
])
def test_a_group_holds_one_layer_per_checkpoint_namespace(pattern, char, pos, first,
                                                          first_pos, namespace, group):
    _raises(pattern, f"'{char}' at position {pos} joins '{first}' at position {first_pos} in "
            f"checkpoint namespace '{namespace}'",
            f"Layer group '{group}' contains multiple layers in checkpoint namespace "
            f"'{namespace}'")


# KDA (outside the MLA family) mixes with * and with + / D (Kimi Linear, GLM-5.3-Flash), and
# takes an MTP depth
@pytest.mark.parametrize("pattern", ["[M*-]", "[MGE]", "[M+E]", "M[M*]-", "G[M*]E-/*E",
                                     "[MD-]|[G-]/+-", "MK-*K-", "KKK+E/+E", "[KE]D-/K-",
                                     "MK*G-"])
def test_groups_of_one_layer_per_namespace_pass(pattern):
    parse_hybrid_pattern(pattern)


@pytest.mark.parametrize("pattern, char, pos", [("M*x", "x", 2), ("Ma", "a", 1),
                                                 ("m", "m", 0), ("M/*?", "?", 3)])
def test_unknown_characters(pattern, char, pos):
    _raises(pattern, f"'{char}' at position {pos}", "not a known symbol")


@pytest.mark.parametrize("pattern, pos", [("M *", 1), ("M*\t", 2), (" M", 0), ("M\n", 1)])
def test_whitespace_rejected(pattern, pos):
    _raises(pattern, f"at position {pos}", "whitespace")


@pytest.mark.parametrize("pattern", ["", "|", "||", "/", "/M", "|/*"])
def test_main_must_have_a_layer(pattern):
    _raises(pattern, "main part", "at least one layer")


def test_empty_main_names_the_slash():
    _raises("|/*", "before '/' at position 1")


def test_unmatched_open_bracket():
    _raises("M[M*", "'[' at position 1", "unmatched")
    _raises("[M*/*", "'[' at position 0", "unmatched", "'/' at position 3")


def test_empty_group():
    _raises("M[]*", "']' at position 2", "empty group")


def test_nested_group():
    _raises("[M[*]]", "'[' at position 2", "nested", "position 0")


@pytest.mark.parametrize("pattern, pos", [("M]", 1), ("]M", 0), ("[M]]", 3), ("M/*]", 3)])
def test_stray_close_bracket(pattern, pos):
    _raises(pattern, f"']' at position {pos}", "stray")


@pytest.mark.parametrize("pattern, pos", [("[E*]", 1), ("M[*E-]", 3), ("[EE]", 1)])
def test_moe_must_close_group(pattern, pos):
    _raises(pattern, f"'E' at position {pos} must be the last symbol of a group")


def test_moe_error_message_exact():
    # 0-based: M=0 [=1 *=2 E=3 -=4.
    with pytest.raises(ValueError, match=re.escape(
            "hybrid pattern 'M[*E-]': 'E' at position 3 must be the last symbol of a group")):
        parse_hybrid_pattern("M[*E-]")


def test_pipe_inside_group():
    _raises("M[M|*]", "'|' at position 3", "inside a group")


def test_pipe_in_mtp():
    _raises("M*/*|-", "'|' at position 4", "MTP")


@pytest.mark.parametrize("pattern, pos", [("M*/[*-]", 3), ("M/*/[*]", 4)])
def test_group_in_mtp(pattern, pos):
    _raises(pattern, f"'[' at position {pos}", "not allowed in MTP")


def test_mismatched_mtp_depths():
    _raises("M*-/*-/*", "'/' at position 6", "'*'", "'*-'", "identical")
    _raises("M/*-/-*", "'/' at position 4", "identical")


@pytest.mark.parametrize("pattern, pos", [("M//-", 1), ("M/-//", 3), ("M/-/", 3),
                                          ("M//", 1)])
def test_empty_mtp_depth(pattern, pos):
    _raises(pattern, f"'/' at position {pos}", "empty MTP depth")


def test_non_string_rejected():
    with pytest.raises(TypeError):
        parse_hybrid_pattern(None)

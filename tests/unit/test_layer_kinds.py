"""The layer-kind table is complete and consistent: every place that differs by kind reads it."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from titan_hybrid.checkpoint.state import _layers_by_kind
from titan_hybrid.model.args import HybridModelArgs, hybrid_flavors
from titan_hybrid.model.layer_kind import GROUPS, HEADS
from titan_hybrid.model.layer_kinds import ALL_KINDS, LAYER_KINDS, VARIANTS
from titan_hybrid.model.model import HybridLayer
from titan_hybrid.model.recurrent import RecurrentCore, is_per_token
from titan_hybrid.model.symbols import SYMBOLS
from titan_hybrid.parallel.context_parallel import splits
from titan_hybrid.parallel.context_parallel_chunkwise import STATE_PASSING


def test_symbols_and_names_are_unique_and_the_grammar_reads_them():
    assert len({kind.name for kind in LAYER_KINDS.values()}) == len(LAYER_KINDS)
    assert all(symbol == kind.symbol for symbol, kind in LAYER_KINDS.items())
    # The grammar's table (model/symbols.py) and the kinds agree: the same symbols in the same
    # order, and each kind's name, title and pattern rules are its symbol's entry.
    assert list(LAYER_KINDS) == list(SYMBOLS)
    for symbol, kind in LAYER_KINDS.items():
        spec = SYMBOLS[symbol]
        assert kind.spec is spec
        assert (kind.name, kind.title, kind.closes_group) == (
            spec.name, spec.title, spec.closes_group)


def _args_building(kind) -> HybridModelArgs:
    """The debug flavor's args, with the option that makes `kind`'s symbol build it."""
    args = hybrid_flavors["debug"]
    flag, kinds = VARIANTS.get(kind.symbol, (None, {}))
    if flag is None:
        return args
    return dataclasses.replace(args, **{flag: next(v for v, k in kinds.items() if k is kind)})


class _CoreReached(Exception):
    """Raised by the hook below once it has the core's arguments: the forward goes no further."""


def _core_arguments(layer: HybridLayer, core, names: list[str]) -> dict:
    """The core's arguments, by name, as the (meta-device) mixer's forward calls it (stopped
    there)."""
    seen = {}

    def capture(module, args):
        seen.update(zip(names, args, strict=True))
        raise _CoreReached

    handle = core.register_forward_pre_hook(capture)
    try:
        layer.mixer(torch.zeros(1, 8, layer.mixer.out_proj.out_features, device="meta"))
    except _CoreReached:  # the arguments are in `seen`
        return seen
    finally:
        handle.remove()
    raise AssertionError(f"the mixer's forward never called its core {type(core).__name__}")


@pytest.mark.parametrize("kind", ALL_KINDS, ids=lambda kind: kind.name)
def test_every_kind_has_its_args_section_and_builds_a_layer_named_by_it(kind):
    sections = {f.name: f for f in dataclasses.fields(HybridModelArgs)}
    assert kind.name in sections
    args = _args_building(kind)
    assert isinstance(args.section(kind), kind.args_type)
    with torch.device("meta"):
        layer = HybridLayer(kind.symbol, args)
    assert layer.kind is kind and {name for name, _ in layer.named_children()} == {
        kind.name, f"{kind.name}_norm"}
    if kind.context_parallel is not None:
        rule = kind.context_parallel
        core = getattr(layer.mixer, rule.core)
        # Either CP gathers named arguments of the core (and its key layout), or reads a key
        # halo, or (a recurrent kind) exchanges heads by the channel layout the kind declares
        # and passes states by the algorithm its core declares (model/recurrent.py's
        # contract); parallel/ names no kind.
        names = list(inspect.signature(core.forward).parameters)
        assert splits(rule)
        if rule.gather:
            assert set(rule.gather) | {"query", "key"} <= set(names)
        elif not rule.window_halo:
            assert isinstance(core, RecurrentCore) and core.state_passing in STATE_PASSING
            assert names[-1] == "layout"
            if core.conv_input is None:  # no conv (Mamba-3): the arguments of a real forward
                tensors = _core_arguments(layer, core, names)
                conv = None
            else:
                assert core.conv_input in names and is_per_token(core.conv_input)
                assert "conv_weight_CW" in names
                # Every argument but the layout is laid out by head. The layout reads the heads
                # from A_log (a decay core) or the conv's weight (a conv core), the groups from
                # the conv's width ([B, T, conv channels] inputs).
                conv = sum(p.shape[0] for n, p in layer.mixer.named_parameters()
                           if "conv" in n and n.endswith("weight"))
                tensors = {name: torch.zeros(1, 8, conv, device="meta") for name in names}
                tensors["conv_weight_CW"] = torch.zeros(conv, 4, device="meta")
                if "A_log" in names:
                    tensors["A_log"] = layer.mixer.A_log
            plan = rule.head_channels(core.args, tensors)
            assert (set(plan.exchanged) | set(plan.sliced) | set(plan.whole)
                    == set(names) - {"layout"})
            if "A_log" in names:
                # one per head (or, GDN2's, one per key group) of those the plan counts
                (_, per), = plan.sliced["A_log"]
                assert ({HEADS: plan.heads, GROUPS: plan.groups}[per]
                        == layer.mixer.A_log.shape[0])
            elif conv is not None:  # a conv alone: each channel a head
                assert plan.heads == conv
            assert plan.heads >= plan.groups >= 1
    if kind.context_parallel is not None:
        assert kind.mixes_sequence  # a token-wise kind has nothing for CP to do
    # A sequence-mixing kind without a rule (DeepSeek-V4 attention, so far) is refused under CP
    # by name: parallel/validate.py, tests/unit/test_deepseek_v4.py.


def test_kinds_follow_the_pattern_and_checkpoint_keys_know_every_kind():
    args = dataclasses.replace(hybrid_flavors["debug_moe"], pattern="G[M*]E-/*E")
    assert [kind.symbol for kind in args.kinds()] == ["M", "G", "*", "-", "E"]
    assert args.has_aux_loss
    args.pattern = "M+-D-"
    assert [kind.symbol for kind in args.kinds()] == ["M", "+", "D", "-"]
    assert args.has_aux_loss  # DSA's indexer loss
    keys = [f"layers.{index}.{kind.name}.weight" for index, kind in enumerate(LAYER_KINDS.values())]
    assert _layers_by_kind(keys) == {kind.name: [index]
                                     for index, kind in enumerate(LAYER_KINDS.values())}


def test_the_pattern_is_parsed_once_per_text():
    args = dataclasses.replace(hybrid_flavors["debug"])
    first = args.parsed_pattern
    assert args.parsed_pattern is first
    args.pattern = "M-"
    assert args.parsed_pattern is not first and args.parsed_pattern.main == ["M", "-"]


def test_context_parallel_wraps_every_recurrent_kind_without_naming_one():
    """One head exchange for Mamba2, GDN and KDA, driven by the layouts their table entries
    declare: parallel/context_parallel.py imports no layer kind's module."""
    import ast
    from pathlib import Path

    import titan_hybrid.parallel.context_parallel as context_parallel

    tree = ast.parse(Path(context_parallel.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            imported |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
    kind_files = {path.stem for path in Path(context_parallel.__file__).parents[1].joinpath(
        "model").glob("*.py")}
    named = {module for module in imported if module and module.startswith("titan_hybrid.model.")
             and module.split(".")[2] in kind_files - {"layer_kind", "layout", "model", "args",
                                                        "common", "symbols", "pattern"}}
    assert named == set(), named
    recurrent = [kind for kind in LAYER_KINDS.values()
                 if kind.context_parallel and kind.context_parallel.head_channels]
    assert sorted(kind.symbol for kind in recurrent) == ["G", "K", "M", "S"]


def test_a_variant_is_one_table_entry(monkeypatch):
    """A new variant of `M` (here the tests' throwaway recurrent kind, tests/throwaway_kind.py)
    is its module, its args section and one VARIANTS entry: `m_layers` then takes its name,
    the model builds it under its own name, and its checkpoint keys say so."""
    from tests import throwaway_kind
    from titan_hybrid.model.model import HybridModel
    from titan_hybrid.model.symbols import MIXER, LayerSymbol

    variant = dataclasses.replace(throwaway_kind.KIND, symbol="M", variant=LayerSymbol(
        symbol="M", name="throwaway", title="throwaway recurrent", namespace=MIXER))
    flag, kinds = VARIANTS["M"]
    monkeypatch.setitem(VARIANTS, "M", (flag, {**kinds, "throwaway": variant}))
    debug = hybrid_flavors["debug"]
    args = throwaway_kind.ArgsWithThrowaway(
        **{f.name: getattr(debug, f.name) for f in dataclasses.fields(debug)})
    args = dataclasses.replace(args, pattern="M-*M-", m_layers="throwaway", dim=32,
                               vocab_size=64, max_seq_len=16)
    args.validate()
    assert [kind.name for kind in args.kinds()] == ["throwaway", "attention", "mlp"]
    torch.manual_seed(0)
    model = HybridModel(args)
    model.init_weights()
    logits = model(torch.randint(0, 64, (2, 16)))
    assert logits.shape == (2, 16, 64) and torch.isfinite(logits).all()
    assert "layers.0.throwaway.in_proj.weight" in model.state_dict()
    with pytest.raises(ValueError, match=r"^m_layers='gdn' is not one of \['mamba2', 'gdp', "
                                         r"'mamba1', 'mamba3', 'throwaway'\]"):
        dataclasses.replace(args, m_layers="gdn").validate()

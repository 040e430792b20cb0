"""Kind knowledge lives in the layer-kind table: outside a kind's own module no code asks
whether a module is of that kind's classes, and no code spells a pattern symbol.

Both rules are checked on the syntax trees of every module of the package.

1. `isinstance(x, C)` / `issubclass(x, C)`, where C (or one class of a tuple C) is a class
   defined in a layer kind's module (model/mamba.py, gdn.py, attention.py, mla.py, dsa.py,
   deepseek_v4.py, deepseek_v4_hca.py, mlp.py, moe.py), occurs only in the module that defines C. Code elsewhere reads
   `HybridLayer.kind` (isinstance of the generic HybridLayer is fine).

2. A string constant equal to a pattern symbol (a key of SYMBOLS) is a symbol literal when it
   stands where a symbol is used:
   - an operand of a comparison (`==`, `!=`, `in`, `not in`, `is`);
   - a key or a value of a dict display;
   - the index of a subscript (`LAYER_KINDS["E"]`);
   - a positional argument or keyword value of a call, except the `symbol=` keyword of a
     `LayerKind(...)` or `LayerSymbol(...)` call (a kind's or a variant's declaration) and the
     argument of the string / path methods in NOT_SYMBOL_METHODS
     (separators and globs: `version.split("+")`, `folder.rglob("*")`);
   - the value of an assignment, a return or a parameter default;
   - an element of a set display;
   - an element of a list or tuple display (also inside `+` / `*` arithmetic or starred) that
     stands in one of the places above, when all the display's string elements are symbols: a
     tuple of parameter names such as `("A_log", "D", "dt_bias")` (Mamba's skip parameter D)
     is not a set of symbols.
   Symbol literals may appear only in model/symbols.py (the table), pattern.py (the grammar)
   and the `symbol=` keyword of the kinds' `KIND = LayerKind(symbol=...)`. Text inside
   f-strings and docstrings is prose, not code, and is not checked.
"""

from __future__ import annotations

import ast
from pathlib import Path

from titan_hybrid.model.symbols import SYMBOLS

PACKAGE = Path(__file__).resolve().parents[2] / "titan_hybrid"
KIND_MODULES = ("mamba", "gdn", "attention", "mla", "dsa", "deepseek_v4", "deepseek_v4_hca",
                "mlp", "moe")
SYMBOL_TABLE_FILES = {PACKAGE / "model" / "symbols.py", PACKAGE / "pattern.py"}
NOT_SYMBOL_METHODS = {"split", "rsplit", "join", "strip", "lstrip", "rstrip", "glob", "rglob",
                      "replace"}


def kind_classes() -> dict[str, Path]:
    """{class name: the kind module that defines it}."""
    classes = {}
    for name in KIND_MODULES:
        path = PACKAGE / "model" / f"{name}.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = path
    return classes


def _class_names(node: ast.expr) -> list[str]:
    if isinstance(node, ast.Tuple):
        return [name for element in node.elts for name in _class_names(element)]
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    return []


def kind_isinstance_calls(source: str, path: Path, classes: dict[str, Path]) -> list[str]:
    """`line: class` of every isinstance / issubclass of a kind's class outside its module."""
    tree = ast.parse(source)
    own = {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2):
            for name in _class_names(node.args[1]):
                if name in classes and classes[name] != path and name not in own:
                    found.append((node.lineno, node.col_offset, name))
    return [f"{line}: {name}" for line, _, name in sorted(found)]


def _is_symbol_display(node: ast.AST) -> bool:
    strings = [element.value for element in node.elts
               if isinstance(element, ast.Constant) and isinstance(element.value, str)]
    return all(value in SYMBOLS for value in strings)


def _symbol_use(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Whether the constant `node` (a symbol's character) stands where a symbol is used."""
    child, parent = node, parents.get(node)
    # Through list / tuple displays of symbols, their arithmetic and starred elements.
    while True:
        if isinstance(parent, (ast.List, ast.Tuple)) and _is_symbol_display(parent):
            child, parent = parent, parents.get(parent)
        elif isinstance(parent, (ast.BinOp, ast.Starred)) and child is not node:
            child, parent = parent, parents.get(parent)
        else:
            break
    if isinstance(parent, (ast.Compare, ast.Dict)):
        return True
    if isinstance(parent, ast.Set):
        return child is node
    if isinstance(parent, ast.Subscript):
        return child is parent.slice
    if isinstance(parent, (ast.Assign, ast.AnnAssign, ast.Return, ast.arguments)):
        return True  # a value, a returned value or a parameter default
    if isinstance(parent, ast.keyword):
        call = parents.get(parent)
        if not isinstance(call, ast.Call):
            return False  # a class statement's keyword
        callee = getattr(call.func, "id", getattr(call.func, "attr", None))
        # a kind's, or a variant's, declaration of its symbol
        return not (parent.arg == "symbol" and callee in ("LayerKind", "LayerSymbol"))
    if isinstance(parent, ast.Call) and child in parent.args:
        method = parent.func.attr if isinstance(parent.func, ast.Attribute) else None
        return method not in NOT_SYMBOL_METHODS
    return False


def symbol_literals(source: str) -> list[str]:
    """`line: 'symbol'` of every symbol literal in `source` (rule 2 of the module docstring)."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = sorted((node.lineno, node.col_offset, node.value) for node in ast.walk(tree)
                   if isinstance(node, ast.Constant) and isinstance(node.value, str)
                   and node.value in SYMBOLS and _symbol_use(node, parents))
    return [f"{line}: {value!r}" for line, _, value in found]


def package_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_isinstance_of_a_kind_class_outside_its_module():
    classes = kind_classes()
    assert {"MoE", "DeepSeekSparseAttention", "Mamba2Mixer", "GroupedExperts"} <= set(classes)
    found = {str(path.relative_to(PACKAGE.parent)): calls for path in package_files()
             if (calls := kind_isinstance_calls(path.read_text(), path, classes))}
    assert found == {}


def test_no_symbol_literal_outside_the_table_and_the_grammar():
    found = {str(path.relative_to(PACKAGE.parent)): literals for path in package_files()
             if path not in SYMBOL_TABLE_FILES and (literals := symbol_literals(path.read_text()))}
    assert found == {}


def test_the_rules_find_what_the_old_code_did_and_nothing_else():
    """The checks catch the special cases this package used to have, and pass what is not a
    symbol or not a kind test."""
    classes = kind_classes()
    elsewhere = PACKAGE / "metrics.py"
    old_isinstance = (
        "from titan_hybrid.model.moe import MoE\n"
        "from titan_hybrid.model import dsa\n"
        "moes = [m for m in part.modules() if isinstance(m, MoE)]\n"
        "if isinstance(m, (nn.Linear, dsa.DeepSeekSparseAttention)):\n    pass\n")
    assert kind_isinstance_calls(old_isinstance, elsewhere, classes) == [
        "3: MoE", "4: DeepSeekSparseAttention"]
    assert kind_isinstance_calls(old_isinstance, PACKAGE / "model" / "moe.py", classes) == [
        "4: DeepSeekSparseAttention"]  # a module may test its own classes
    assert kind_isinstance_calls("isinstance(layer, HybridLayer)\n", elsewhere, classes) == []

    old_symbols = '\n'.join([
        'if model_args is not None and "D" in model_args.symbols():',  # metrics.py
        '    pass',
        'if "E" not in model_args.symbols():',  # parallel/validate.py
        '    pass',
        'ARCHITECTURES = {"+": ("DeepseekV3ForCausalLM", "deepseek_v3")}',  # hf_deepseek.py
        'ok = symbols != [attention, "-"] * (len(symbols) // 2)',
        'HF_LAYER_TYPES = {"linear_attention": "M", "mlp": "-"}',  # hf_nemotron_h.py
        'kind = LAYER_KINDS["G"]',
        'layer = HybridLayer("E", args)',
        'wanted = {"M", "*"}',
        'def build(symbol="M"):',
        '    return "*"',
    ])
    assert symbol_literals(old_symbols) == [
        "1: 'D'", "3: 'E'", "5: '+'", "6: '-'", "7: 'M'", "7: '-'", "8: 'G'", "9: 'E'",
        "10: 'M'", "10: '*'", "11: 'M'", "12: '*'"]
    not_symbols = '\n'.join([
        'KIND = LayerKind(symbol="M", full_precision_params=("A_log", "D", "dt_bias"))',
        'renames = {name: name for name in ("A_log", "D", "dt_bias")}',
        'if name in ("A_log", "D"):',
        '    pass',
        'base = version.split("+")[0]',
        'files = folder.rglob("*")',
        'line = "-".join(parts) + f"{x}-{y}" + "-" * 80',
    ])
    assert symbol_literals(not_symbols) == []

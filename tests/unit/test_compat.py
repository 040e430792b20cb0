"""Private torch / torchtitan names appear only in titan_hybrid/compat/, which refuses versions it
was not checked on; the CPU runtime applies no patch that nothing needs.

The rule (a private name is an identifier with ONE leading underscore; dunders are public
protocol). Outside titan_hybrid/compat/, a titan_hybrid module must not:
1. import a module under torch / torchtitan whose dotted path has a private component;
2. import a private name from torch / torchtitan (`from torch.x import _y`);
3. read or write a private attribute of anything but `self` / `cls` (`x._y`, `super()._y`,
   `getattr(x, "_y")`), unless `x` is a module imported from outside torch / torchtitan
   (`os._exit` is the standard library's). The object's type is not known statically, so this
   holds for titan_hybrid's own objects too: their private attributes stay inside their class;
4. in a class derived from a torch / torchtitan class, define or use through `self` / `cls` a
   private name that one of those base classes' source mentions (that is the base's private
   member: an override of a private hook, or a call into one).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import titan_hybrid
from titan_hybrid import compat

PACKAGE = Path(titan_hybrid.__file__).parent
FOREIGN = ("torch", "torchtitan")
ATTRIBUTE_FUNCTIONS = ("getattr", "hasattr", "setattr", "delattr")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _foreign(module: str) -> bool:
    return module.split(".")[0] in FOREIGN


def _root(node: ast.expr) -> str | None:
    """The name an attribute chain starts from (`a` in a.b().c[0].d), or None."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _imported_modules(tree: ast.Module) -> dict[str, str]:
    """Local name -> module it is bound to, for `import x` / `import x as y`."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0])
    return bound


def _private_accesses(tree: ast.Module):
    """(line, private name, root name) of every `x._y` and getattr(x, "_y")-like use."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            yield node.lineno, node.attr, _root(node.value)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ATTRIBUTE_FUNCTIONS and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value)):
            yield node.lineno, node.args[1].value, _root(node.args[0])


def _import_violations(path: Path, tree: ast.Module) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _foreign(alias.name) and any(map(_private, alias.name.split("."))):
                    found.append(f"{path}:{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and _foreign(node.module):
            names = [alias.name for alias in node.names]
            if any(map(_private, node.module.split("."))) or any(map(_private, names)):
                found.append(f"{path}:{node.lineno}: from {node.module} import {names}")
    return found


def _attribute_violations(path: Path, tree: ast.Module) -> list[str]:
    modules = _imported_modules(tree)
    found = []
    for line, name, root in _private_accesses(tree):
        if root in ("self", "cls"):
            continue  # rule 4
        if root in modules and not _foreign(modules[root]):
            continue
        found.append(f"{path}:{line}: {root}...{name}")
    return found


def _foreign_base_sources(cls: type) -> list[str]:
    sources = []
    for base in cls.__mro__[1:]:
        if _foreign(base.__module__):
            try:
                sources.append(inspect.getsource(base))
            except (OSError, TypeError):  # compiled: its own attributes are all there is
                sources.append(" ".join(vars(base)))
    return sources


def _subclass_violations(path: Path, tree: ast.Module, module_name: str) -> list[str]:
    classes = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.bases]
    if not classes:
        return []
    module = importlib.import_module(module_name)
    found = []
    for class_node in classes:
        sources = _foreign_base_sources(getattr(module, class_node.name))
        if not sources:
            continue
        names = set()
        for node in ast.walk(class_node):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in ("self", "cls") and _private(node.attr)):
                names.add((node.lineno, node.attr))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(node.name):
                names.add((node.lineno, node.name))
        for line, name in sorted(names):
            if any(re.search(rf"\b{re.escape(name)}\b", source) for source in sources):
                found.append(f"{path}:{line}: {class_node.name} uses its torch / torchtitan "
                             f"base's {name}")
    return found


def test_private_torch_and_torchtitan_names_only_in_compat():
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent)
        if relative.parts[1] == "compat":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        module_name = ".".join(relative.with_suffix("").parts).removesuffix(".__init__")
        violations += _import_violations(relative, tree)
        violations += _attribute_violations(relative, tree)
        violations += _subclass_violations(relative, tree, module_name)
    assert not violations, "private torch / torchtitan names outside titan_hybrid/compat/ " \
        "(route them through compat, with a reason):\n" + "\n".join(violations)


def test_the_rule_sees_each_kind_of_private_use():
    source = '''
import os
import torch.distributed._composable as composable
from torch._utils import _flatten_dense_tensors
from torch.distributed.pipelining.schedules import _Action
def f(stage, module):
    stage._post_metadata_inference_cleanup()
    getattr(module, "_parameters")
    os._exit(0)
class C:
    def g(self):
        super()._save_last_step(1)
        self._mine = 1
'''
    tree = ast.parse(source)
    imports = _import_violations(Path("x.py"), tree)
    attributes = _attribute_violations(Path("x.py"), tree)
    assert len(imports) == 3
    assert sorted(v.rsplit(".", 1)[-1] for v in attributes) == [
        "_parameters", "_post_metadata_inference_cleanup", "_save_last_step"], attributes


@pytest.mark.parametrize("torch_version, torchtitan_version", [
    ("2.10.0", "0.2.2"), ("2.15.0+cpu", "0.2.2"), ("2.13.0+cpu", "0.3.0"),
    ("2.11.0+cu130", "0.2.1"), ("2.13.0", "(not installed)")])
def test_unchecked_versions_are_refused_by_name(torch_version, torchtitan_version):
    with pytest.raises(ImportError) as raised:
        compat.check_versions(torch_version, torchtitan_version)
    message = str(raised.value)
    for text in (f"torch {torch_version}", f"torchtitan {torchtitan_version}",
                 "2.11.x", "2.12.x", "2.13.x", "2.14.x", "0.2.2"):
        assert text in message, message


@pytest.mark.parametrize("torch_version", [
    "2.11.0+cu130", "2.12.1", "2.13.0+cpu", "2.13.1", "2.14.1+cu130"])
def test_checked_versions_pass(torch_version):
    compat.check_versions(torch_version, "0.2.2")


def test_torch_release_is_the_installed_one():
    assert compat.TORCH_RELEASE == tuple(int(p) for p in torch.__version__.split(".")[:2])
    assert ".".join(map(str, compat.TORCH_RELEASE)) in compat.CHECKED_TORCH


@pytest.mark.parametrize("shape_inference_hook", [False, True])
def test_callback_after_metadata_inference(monkeypatch, shape_inference_hook):
    """Both paths of compat.pipelining.after_metadata_inference on a stand-in stage: torch
    2.12+ calls the stage's `_post_metadata_inference_cleanup`, torch 2.11 (the hook path) its
    `_shape_inference`, whose result the wrapper must hand back."""
    from titan_hybrid.compat import pipelining

    calls = []

    class Stage:
        def _post_metadata_inference_cleanup(self):
            calls.append("cleanup")

        def _shape_inference(self, args, kwargs=None):
            calls.append(("infer", args, kwargs))
            return ("meta",)

    monkeypatch.setattr(pipelining, "_SHAPE_INFERENCE_HOOK", shape_inference_hook)
    stage, other = Stage(), Stage()
    pipelining.after_metadata_inference(stage, lambda: calls.append("callback"))
    if shape_inference_hook:
        assert stage._shape_inference((1,), {"k": 2}) == ("meta",)
        stage._post_metadata_inference_cleanup()
        assert calls == [("infer", (1,), {"k": 2}), "callback", "cleanup"]
    else:
        assert stage._post_metadata_inference_cleanup() is None
        stage._shape_inference(())
        assert calls == ["cleanup", "callback", ("infer", (), None)]
    calls.clear()
    other._post_metadata_inference_cleanup()  # wrapped on that stage object only
    other._shape_inference(())
    assert calls == ["cleanup", ("infer", (), None)]


def test_compat_import_changes_nothing_global():
    """In a fresh interpreter: what the patches would change is unchanged after importing
    every compat module (the patches run only when runtime.cpu.apply() calls them)."""
    script = """
import torch
import torch.distributed.fsdp._fully_shard._fsdp_collectives as collectives
import torchtitan.tools.utils as tt_utils
def state():
    return (collectives._get_gradient_divide_factors, tt_utils.device_type,
            tt_utils.device_module, tt_utils.get_peak_flops, torch.histc)
before = state()
import titan_hybrid.compat.dcp, titan_hybrid.compat.fsdp, titan_hybrid.compat.nn
import titan_hybrid.compat.pipelining, titan_hybrid.compat.torchtitan
assert state() == before, "importing titan_hybrid.compat patched something"
"""
    subprocess.run([sys.executable, "-c", script], check=True, cwd=PACKAGE.parent)


def test_cpu_runtime_leaves_unneeded_functions_alone():
    import torchtitan.models.moe.utils as moe_utils

    from titan_hybrid.runtime import cpu

    cpu.apply()
    # torch's own builtin, not a wrapper: titan_hybrid's MoE never calls histc on integers.
    assert torch.histc is torch._C._VariableFunctions.histc
    # torchtitan's MoE token permute, unwrapped: titan_hybrid does not run torchtitan's MoE.
    assert not hasattr(moe_utils.generate_permute_indices, "__wrapped__")


def test_final_sleep_is_skipped_only_inside_the_context():
    import time

    import torchtitan.train as tt_train

    from titan_hybrid.compat.torchtitan import without_final_sleep

    # the wait this stands in for is still where it was checked
    assert "time.sleep(2)" in inspect.getsource(tt_train.Trainer.train)
    with without_final_sleep():
        start = time.perf_counter()
        tt_train.time.sleep(2)
        assert time.perf_counter() - start < 0.5
        assert tt_train.time.perf_counter() > start  # the rest of `time` is untouched
    assert tt_train.time is time

"""Private names of torch, torchtitan and the GPU kernel packages (mamba_ssm, fla, causal_conv1d)
appear only in titan_hybrid/compat/, which refuses versions it was not checked on; the CPU
runtime applies no patch that nothing needs.

The rule (a private name is an identifier with ONE leading underscore; dunders are public
protocol; "foreign" is torch, torchtitan or a kernel package). Outside titan_hybrid/compat/, a
titan_hybrid module must not:
1. import a foreign module whose dotted path has a private component, by an import statement
   or by name (`importlib.import_module("torch._dynamo")`, `__import__(...)`);
2. import a private name from a foreign module (`from torch.x import _y`);
3. read or write a private attribute of anything but `self` / `cls` (`x._y`, `super()._y`,
   `getattr(x, "_y")`), unless `x` is a module imported from outside the foreign packages,
   named directly (`os._exit` is the standard library's; `importlib.import_module(...)._y` is
   not exempt). The object's type is not known statically, so this holds for titan_hybrid's
   own objects too: their private attributes stay inside their class;
4. in a class derived from a foreign class, define or use through `self` / `cls` a private name
   that one of those base classes' source mentions (that is the base's private member: an
   override of a private hook, or a call into one);
5. import a kernel package at all: their launchers, public-named or not, are internals whose
   versions titan_hybrid.compat.kernel_packages checks, and the ops reach them through it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import titan_hybrid
from tests.torchtitan_generation import of_another_generation
from titan_hybrid import compat

PACKAGE = Path(titan_hybrid.__file__).parent
KERNEL_PACKAGES = ("mamba_ssm", "fla", "causal_conv1d")
FOREIGN = ("torch", "torchtitan", *KERNEL_PACKAGES)
IMPORT_FUNCTIONS = ("import_module", "__import__")
ATTRIBUTE_FUNCTIONS = ("getattr", "hasattr", "setattr", "delattr")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _foreign(module: str) -> bool:
    return module.split(".")[0] in FOREIGN


def _kernel_package(module: str) -> bool:
    return module.split(".")[0] in KERNEL_PACKAGES


def _root(node: ast.expr) -> str | None:
    """The name an attribute chain starts from (`a` in a.b().c[0].d), or None."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _dotted_root(node: ast.expr) -> str | None:
    """The name a plain dotted name starts from (`os` in os.path), or None for anything else
    (a call, a subscript: its value is not the module the name is bound to)."""
    while isinstance(node, ast.Attribute):
        node = node.value
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
    """(line, private name, root name, dotted root name) of every `x._y` and
    getattr(x, "_y")-like use."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            yield node.lineno, node.attr, _root(node.value), _dotted_root(node.value)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ATTRIBUTE_FUNCTIONS and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value)):
            yield (node.lineno, node.args[1].value, _root(node.args[0]),
                   _dotted_root(node.args[0]))


def _imported_by_name(node: ast.AST) -> str | None:
    """The module a call `importlib.import_module("a.b")` / `__import__("a.b")` imports."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)):
        return None
    func = node.func
    name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
    return node.args[0].value if name in IMPORT_FUNCTIONS else None


def _import_violations(path: Path, tree: ast.Module) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _foreign(alias.name) and (any(map(_private, alias.name.split(".")))
                                             or _kernel_package(alias.name)):
                    found.append(f"{path}:{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and _foreign(node.module):
            names = [alias.name for alias in node.names]
            if (any(map(_private, node.module.split("."))) or any(map(_private, names))
                    or _kernel_package(node.module)):
                found.append(f"{path}:{node.lineno}: from {node.module} import {names}")
        elif (module := _imported_by_name(node)) and _foreign(module) and (
                any(map(_private, module.split("."))) or _kernel_package(module)):
            found.append(f"{path}:{node.lineno}: imports {module!r} by name")
    return found


def _attribute_violations(path: Path, tree: ast.Module) -> list[str]:
    modules = _imported_modules(tree)
    found = []
    for line, name, root, dotted_root in _private_accesses(tree):
        if root in ("self", "cls"):
            continue  # rule 4
        if dotted_root in modules and not _foreign(modules[dotted_root]):
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
    if not classes or of_another_generation(module_name):
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
                found.append(f"{path}:{line}: {class_node.name} uses its foreign base's {name}")
    return found


def test_private_foreign_names_only_in_compat():
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
    assert not violations, "private torch / torchtitan / kernel-package names (or kernel " \
        "packages) outside titan_hybrid/compat/ (route them through compat, with a reason):\n" \
        + "\n".join(violations)


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


def test_the_rule_covers_kernel_packages_and_imports_by_name():
    source = '''
import importlib
import os.path
import fla.ops.gated_delta_rule.chunk as chunk
from mamba_ssm.ops.triton.ssd_combined import _mamba_chunk_scan_combined_fwd
from causal_conv1d.cpp_functions import causal_conv1d_fwd_function
def f():
    importlib.import_module("torch._dynamo")
    importlib.import_module("mamba_ssm.ops.triton.layernorm_gated")._layer_norm_fwd
    getattr(__import__("torch"), "_C")
    chunk._private_helper
    importlib.import_module("json")._default_encoder
    os.path._joinrealpath
'''
    tree = ast.parse(source)
    imports = [v.split(": ", 1)[1] for v in _import_violations(Path("x.py"), tree)]
    assert imports == [
        "import fla.ops.gated_delta_rule.chunk",
        "from mamba_ssm.ops.triton.ssd_combined import ['_mamba_chunk_scan_combined_fwd']",
        "from causal_conv1d.cpp_functions import ['causal_conv1d_fwd_function']",
        "imports 'torch._dynamo' by name",
        "imports 'mamba_ssm.ops.triton.layernorm_gated' by name"], imports
    attributes = _attribute_violations(Path("x.py"), tree)
    # A module imported by a call is not exempt, whatever it is; os.path (named) is.
    assert sorted(v.rsplit(".", 1)[-1] for v in attributes) == [
        "_C", "_default_encoder", "_layer_norm_fwd", "_private_helper"], attributes


@pytest.mark.parametrize("torch_version, torchtitan_version", [
    ("2.10.0", "0.2.2"), ("2.12.1", "0.2.2"), ("2.16.0", "0.2.2"), ("2.13.0+cpu", "0.3.0"),
    ("2.11.0+cu130", "0.3.0"), ("2.11.0+cu130", "0.2.1"), ("2.14.1", "0.4.0"),
    ("2.13.0", "(not installed)")])
def test_unchecked_versions_are_refused_by_name(torch_version, torchtitan_version):
    with pytest.raises(ImportError) as raised:
        compat.check_versions(torch_version, torchtitan_version)
    message = str(raised.value)
    for text in (f"torch {torch_version}", f"torchtitan {torchtitan_version}",
                 "torchtitan 0.2.2 with torch 2.11.x / 2.13.x / 2.14.x / 2.15.x",
                 "torchtitan 0.3.0 with torch 2.14.x / 2.15.x"):
        assert text in message, message


@pytest.mark.parametrize("torch_version, torchtitan_version", [
    ("2.11.0+cu130", "0.2.2"), ("2.13.0+cpu", "0.2.2"), ("2.13.1", "0.2.2"),
    ("2.14.1+cu130", "0.2.2"), ("2.15.0+cu130", "0.2.2"), ("2.15.0", "0.2.2"),
    ("2.14.1+cu130", "0.3.0"), ("2.15.0", "0.3.0")])
def test_checked_versions_pass(torch_version, torchtitan_version):
    compat.check_versions(torch_version, torchtitan_version)


def test_the_readmes_pip_lines_name_a_checked_pair_for_every_torch():
    """README, "Installing with pip": one line per supported torch, each naming the newest
    torchtitan checked with it (a plain install would take 0.3.0, which 2.11 / 2.13 refuse)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    pairs = re.findall(r'^pip install -e \. "torch==(\d+\.\d+)\.\*" "torchtitan==([\d.]+)"',
                       readme, flags=re.MULTILINE)
    newest = {line: max((titan for titan, lines in compat.CHECKED_TORCHTITAN.items()
                         if line in lines), key=lambda v: tuple(map(int, v.split("."))))
              for line in compat.CHECKED_TORCH}
    assert dict(pairs) == newest and len(pairs) == len(compat.CHECKED_TORCH), pairs
    for torch_line, torchtitan in pairs:
        compat.check_versions(f"{torch_line}.0", torchtitan)


def test_torch_and_torchtitan_releases_are_the_installed_ones():
    assert compat.TORCH_RELEASE == tuple(int(p) for p in torch.__version__.split(".")[:2])
    assert ".".join(map(str, compat.TORCH_RELEASE)) in compat.CHECKED_TORCH
    torchtitan = importlib.metadata.version("torchtitan")
    assert compat.TORCHTITAN_RELEASE == tuple(int(p) for p in torchtitan.split(".")[:2])


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


# That importing compat patches nothing is tests/unit/test_import_graph.py's check: it imports
# every library module, compat's among them, and compares every attribute of torch's and
# torchtitan's modules before and after.


def test_kernel_packages_are_imported_only_when_a_launcher_runs():
    """In a fresh interpreter with the kernel packages importable (as inside kernels_on()):
    importing compat.kernel_packages and the ops imports none of them; calling a launcher
    imports its module. mamba-ssm is installed there without its CUDA build (as on torch >=
    2.14, where it does not build), so its package __init__ fails to import, and its Triton
    kernels still import through compat, which enters the package bare."""
    from tests.triton_kernels import KERNEL_SITE, STAND_INS

    script = f"""
import sys
sys.path[:0] = {[str(KERNEL_SITE), str(STAND_INS)]!r}
import torch
from titan_hybrid.compat import kernel_packages
import titan_hybrid.ops.conv, titan_hybrid.ops.gated_delta, titan_hybrid.ops.gated_norm
import titan_hybrid.ops.ssd
def loaded():
    return sorted(name for name in sys.modules
                  if name.split(".")[0] in ("mamba_ssm", "fla", "causal_conv1d"))
assert loaded() == [], loaded()
x, weight = torch.randn(1, 8, 5).transpose(1, 2).contiguous().transpose(1, 2), torch.randn(8, 4)
kernel_packages.causal_conv1d_fwd(x, weight, None, None, None, None, True)
assert loaded() == ["causal_conv1d", "causal_conv1d.cpp_functions"], loaded()
import importlib.util
assert importlib.util.find_spec("selective_scan_cuda") is None
try:
    import mamba_ssm
    raise AssertionError("mamba_ssm imported without its CUDA extension")
except ModuleNotFoundError as error:
    assert error.name == "selective_scan_cuda", error
assert "mamba_ssm" not in sys.modules
steps = (kernel_packages.ssd_scan_fwd, *kernel_packages.SSD_BACKWARD_STEPS)
assert kernel_packages.launcher_refusal("mamba_ssm", steps) is None
assert callable(sys.modules["mamba_ssm.ops.triton.ssd_combined"]._mamba_chunk_scan_combined_fwd)
assert not hasattr(sys.modules["mamba_ssm"], "Mamba2")  # bare: its __init__ did not run
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

    from titan_hybrid.compat.torchtitan_0_2 import without_final_sleep

    # the wait this stands in for is still where it was checked
    assert "time.sleep(2)" in inspect.getsource(tt_train.Trainer.train)
    with without_final_sleep():
        start = time.perf_counter()
        tt_train.time.sleep(2)
        assert time.perf_counter() - start < 0.5
        assert tt_train.time.perf_counter() > start  # the rest of `time` is untouched
    assert tt_train.time is time

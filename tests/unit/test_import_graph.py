"""The package's import structure: no circles, and importing a library module changes nothing
in torch or torchtitan (only the entry points do: train, launch, torchtitan_plugin,
config_registry)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from tests.torchtitan_generation import MODULES_OF, of_another_generation

PACKAGE = Path(__file__).resolve().parents[2] / "titan_hybrid"
ENTRY_POINTS = {"titan_hybrid.train", "titan_hybrid.launch", "titan_hybrid.torchtitan_plugin",
                "titan_hybrid.config_registry"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(path: Path) -> dict[str, int]:
    """{imported titan_hybrid module: line} for every import in the file, including those
    inside functions (an import hidden in a function still closes a circle at run time)."""
    found = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from a.b import c` imports a.b, and a.b.c when c is a submodule.
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name.startswith("titan_hybrid"):
                found.setdefault(name, node.lineno)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        graph[name] = {target for target in project_imports(path) if target in files
                       and target != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_cycle_finder_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_package_imports_have_no_circles():
    # Package __init__ files import nothing, so a module's parents add no edges.
    assert find_cycle(import_graph()) is None


# The layers of the package, lowest first (issue 48): an import may go down or sideways, never
# up. The entry points (train, launch, torchtitan_plugin, config_registry) sit on top.
LAYERS = ("compat", "runtime", "config", "data", "ops", "model", "quantize", "mimo", "parallel",
          "checkpoint", "hf", "training", "adapters")


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 2 and parts[1] in LAYERS else None


def upward_imports() -> set[tuple[str, str]]:
    found = set()
    for module, targets in import_graph().items():
        for target in targets:
            if target.startswith(module + "."):  # a package importing its own submodule
                continue
            low, high = layer_of(module), layer_of(target)
            if low is not None and high is not None and high > low:
                found.add((module, target))
    return found


def test_no_import_runs_up_the_layers():
    assert not upward_imports(), sorted(upward_imports())


def test_no_circle_runs_between_subpackages():
    subpackage = {module: ".".join(module.split(".")[:2]) for module in import_graph()}
    graph: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        graph.setdefault(subpackage[module], set()).update(
            subpackage[target] for target in targets if subpackage[target] != subpackage[module])
    assert find_cycle(graph) is None, find_cycle(graph)


def test_the_layer_rule_sees_an_upward_import():
    assert layer_of("titan_hybrid.runtime.errors") < layer_of("titan_hybrid.training.loss")
    assert layer_of("titan_hybrid.train") is None  # entry points: on top


def test_the_pattern_grammar_reads_the_symbol_table_and_no_layer_code():
    # model/args.py imports the grammar; the grammar must not import the layer modules (and
    # through them ops/ and torch) back: it reads only the symbol table, which imports nothing.
    graph = import_graph()
    assert graph["titan_hybrid.model.pattern"] == {"titan_hybrid.model.symbols"}
    assert graph["titan_hybrid.model.symbols"] == set()
    # And at run time: importing the grammar loads neither torch nor any other of our modules.
    proc = subprocess.run(
        [sys.executable, "-c", "import sys, titan_hybrid.model.pattern; print(*sorted(name for "
         "name in sys.modules if name.split('.')[0] in ('torch', 'titan_hybrid')))"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["titan_hybrid", "titan_hybrid.model",
                                   "titan_hybrid.model.pattern", "titan_hybrid.model.symbols"]

def test_no_project_import_is_hidden_inside_a_function():
    hidden = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        # Module level, or in a module-level try (config_registry re-raises import errors) or
        # if (compat/torchtitan_hooks picks the installed torchtitan's fence).
        top_level = {id(node) for node in tree.body}
        top_level |= {id(node) for block in tree.body if isinstance(block, (ast.Try, ast.If))
                      for node in block.body + block.orelse}
        for node in ast.walk(tree):
            if (isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top_level
                    and any(name.startswith("titan_hybrid") for name in
                            [getattr(node, "module", None) or ""]
                            + [alias.name for alias in node.names])):
                hidden.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert hidden == []


SNAPSHOT_SCRIPT = r"""
import importlib, json, sys, types
library, third_party = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for name in third_party:
    try:
        importlib.import_module(name)
    except ImportError:
        pass  # a name imported from a module, not a module itself

def snapshot():
    state = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.split(".")[0] in ("torch", "torchtitan"):
            continue
        for attr, value in list(vars(module).items()):
            if not isinstance(value, types.ModuleType):
                state[f"{name}.{attr}"] = id(value)
    return state

import torch
from torchtitan.hf_datasets import text_datasets
from torchtitan.protocols import train_spec
before, datasets = snapshot(), sorted(text_datasets.DATASETS)
threads = torch.get_num_threads()
for name in library:
    importlib.import_module(name)
after = snapshot()
changed = sorted(key for key, value in before.items() if after.get(key) != value)
try:
    train_spec.get_train_spec("hybrid")
    registered = True
except Exception:
    registered = False
print("RESULT " + json.dumps({"changed": changed, "registered": registered,
                              "datasets_changed": sorted(text_datasets.DATASETS) != datasets,
                              "threads_changed": torch.get_num_threads() != threads}))
"""


def third_party_modules() -> list[str]:
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return sorted(name for name in names if name.split(".")[0] in ("torch", "torchtitan"))


def test_importing_library_modules_leaves_torch_and_torchtitan_untouched():
    library = sorted(name for name in (module_name(p) for p in PACKAGE.rglob("*.py"))
                     if name not in ENTRY_POINTS and not of_another_generation(name))
    assert "titan_hybrid.model.pattern" in library
    assert "titan_hybrid.parallel.parallelize" in library
    proc = subprocess.run(
        [sys.executable, "-c", SNAPSHOT_SCRIPT, json.dumps(library),
         json.dumps(third_party_modules())],
        capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result == {"changed": [], "registered": False, "datasets_changed": False,
                      "threads_changed": False}


def test_the_entry_point_registers_and_patches_and_the_check_sees_it():
    # The same check must notice what the plugin does, or it proves nothing.
    proc = subprocess.run(
        [sys.executable, "-c", SNAPSHOT_SCRIPT, json.dumps(["titan_hybrid.torchtitan_plugin"]),
         json.dumps(third_party_modules())],
        capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["registered"] and result["datasets_changed"]
    assert any(key.startswith("torchtitan.") for key in result["changed"])  # CPU runtime


# torchtitan names that mean the same in 0.2.2 and 0.3.0, and so may be imported outside the
# adapters (titan_hybrid/adapters/torchtitan_0_X, compat/torchtitan_0_X and each generation's
# entry points). ParallelDims keeps its name and the meshes titan_hybrid reads under the
# partial_dtensor backend that the 0.3 adapter selects.
STABLE_TORCHTITAN_NAMES = {
    "torchtitan.tools.logging": {"logger", "init_logger"},
    "torchtitan.tools": {"utils"},
    "torchtitan.tools.utils": {"*"},
    "torchtitan.distributed": {"ParallelDims"},
    "torchtitan.config": {"TORCH_DTYPE_MAP"},
    "torchtitan.components.loss": {"IGNORE_INDEX"},
    "torchtitan.components.optimizer": {"OptimizersContainer"},
    "torchtitan.components.tokenizer": {"HuggingFaceTokenizer", "BaseTokenizer"},
    "torchtitan.components.dataloader": {"BaseDataLoader"},
    "torchtitan.hf_datasets": {"DatasetConfig", "text_datasets"},
    "torchtitan.protocols.state_dict_adapter": {"BaseStateDictAdapter"},
    "torchtitan.components.checkpoint": {"DATALOADER", "LR_SCHEDULER", "MODEL", "TRAIN_STATE",
                                         "AsyncMode"},
}
# The one module outside the adapters that imports a generation's fence: it picks the installed
# one (both give the same names).
GENERATION_PICKERS = {"titan_hybrid.compat.torchtitan_hooks", "titan_hybrid.adapters.installed"}


def _generation_module(name: str) -> bool:
    return any(name == prefix or name.startswith(prefix + ".")
               for prefixes in MODULES_OF.values() for prefix in prefixes)


def test_only_the_adapters_import_a_torchtitan_generations_names():
    found = []
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        if _generation_module(name):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                module, names = node.module, [alias.name for alias in node.names]
            elif isinstance(node, ast.Import):
                module, names = None, [alias.name for alias in node.names]
            else:
                continue
            targets = [f"{module}.{n}" for n in names] if module else names
            for target in [module] if module else targets:
                if target and _generation_module(target) and name not in GENERATION_PICKERS:
                    found.append(f"{name} imports {target}")
            if module and module.split(".")[0] == "torchtitan":
                allowed = STABLE_TORCHTITAN_NAMES.get(module, set())
                found += [f"{name} imports {module}.{n}" for n in names
                          if n not in allowed and "*" not in allowed]
            elif not module:
                found += [f"{name} imports {n}" for n in names if n.split(".")[0] == "torchtitan"
                          and n not in STABLE_TORCHTITAN_NAMES]
    assert found == []


def test_the_stable_torchtitan_names_exist_in_the_installed_torchtitan():
    # Run in both CI legs (0.2.2 and 0.3.0), this is what makes them stable.
    import importlib

    for module, names in STABLE_TORCHTITAN_NAMES.items():
        imported = importlib.import_module(module)
        for name in names - {"*"}:
            if not hasattr(imported, name):  # a submodule
                importlib.import_module(f"{module}.{name}")


def test_the_readmes_layout_names_every_module():
    """The package layout (docs/architecture.md, the block under `titan_hybrid/`; the README's
    until issue 48 moved it) names every module of the package, so the list cannot drift from
    the code (issue 48: it had lost model/kda.py and hf/kimi_linear.py)."""
    readme = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    block = readme[readme.index("titan_hybrid/\n  launch.py"):]
    block = block[:block.index("```")]
    unnamed = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                     if path.name != "__init__.py" and path.name not in block)
    assert unnamed == [], unnamed

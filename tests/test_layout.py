"""The package's import structure (docs/architecture.md): the layers, top to bottom; no module imports one in a
layer above its own; no import cycle, counting imports inside functions; no stage imports another; our own
modules are imported at the top of the file everywhere but the CLI; loading a recipe imports only the
torch-free config layer."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

PACKAGE = REPO / "alignment"
# Where importing inside a function is the design: the CLI (each command loads only what it needs).
LAZY_LAYER = ("alignment.cli",)
# The layers, top to bottom (docs/architecture.md): a module may import its own layer and those below it.
LAYERS = [
    ("alignment.__main__", "alignment.cli"),
    ("alignment.run",),  # what runs a recipe
    ("alignment.evaluation",),  # what evaluates and reports
    ("alignment.stages",),  # one module per stage kind
    ("alignment.training",),  # what the stages share for training
    ("alignment.tools",),  # tools, environments and the multi-turn rollout
    ("alignment.sampling",),  # the one sampling path
    ("alignment.models",),  # model loading
    ("alignment.data",),  # data loading and the one rendering
    ("alignment.verifiers", "alignment.tasks"),
    ("alignment.rl",),  # pure tensor math
    ("alignment.runtime",),  # process state, logging, progress, files
    ("alignment.config",),  # torch-free specs and the recipe
    ("alignment.errors", "alignment"),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imported_modules(name: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """Our modules an import statement of module `name` loads (`from . import x` counts x when a module)."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        package = name.split(".") if MODULES[name].name == "__init__.py" else name.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
        module = ".".join(p for p in (base, node.module or "") if p)
        targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in MODULES else module for alias in node.names]
    found = []
    for target in targets:
        while target and target not in MODULES:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.append(target)
    return found


def import_graph() -> dict[str, dict[str, list[tuple[int, bool]]]]:
    """{module: {imported module: [(line, inside a function?)]}}."""
    graph = {}
    for name, path in MODULES.items():
        tree, edges = ast.parse(path.read_text()), {}
        inner = {
            id(n)
            for f in ast.walk(tree)
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in ast.walk(f)
            if isinstance(n, (ast.Import, ast.ImportFrom))
        }
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in imported_modules(name, node):
                    edges.setdefault(target, []).append((node.lineno, id(node) in inner))
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, dict]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search with colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return stack[stack.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_no_import_cycle_among_our_modules_counting_imports_inside_functions():
    graph = import_graph()
    assert len(graph) > 40 and "alignment.run.runner" in graph["alignment.cli"]  # the graph sees function-level imports
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_find_cycle_reports_a_cycle_through_a_function_level_import():
    graph = {"a": {"b": [(1, False)]}, "b": {"c": [(3, True)]}, "c": {"a": [(9, True)]}, "d": {}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": []}, "b": {}}) is None


def layer_of(name: str) -> int:
    for index, prefixes in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes if p != "alignment") or name == prefixes[-1]:
            return index
    raise AssertionError(f"{name} is in no layer of LAYERS: add it (and to docs/architecture.md)")


def test_every_module_is_in_a_layer_and_imports_none_above_its_own():
    graph = import_graph()
    climbs = [
        f"{name} (layer {layer_of(name)}) imports {target} (layer {layer_of(target)}) at line {line}"
        for name, edges in graph.items()
        for target, places in edges.items()
        for line, _ in places
        if layer_of(target) < layer_of(name)
    ]
    assert not climbs, "imports up the layering: " + "; ".join(climbs)


def test_layer_of_sorts_modules_and_refuses_an_unknown_package():
    assert [layer_of(n) for n in ("alignment.cli", "alignment.run.runner", "alignment.config.recipe", "alignment")] == [
        0,
        1,
        len(LAYERS) - 2,
        len(LAYERS) - 1,
    ]
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("alignment.somewhere_new")


def test_no_stage_imports_another_stage():
    siblings = [
        f"{name} imports {target}"
        for name, edges in import_graph().items()
        if name.startswith("alignment.stages.")
        for target in edges
        if target.startswith("alignment.stages.")
    ]
    assert not siblings, "; ".join(siblings) + ": shared stage machinery belongs in alignment/training/"


def test_our_modules_are_imported_at_the_top_everywhere_but_the_cli():
    late = [
        f"{name}:{line} imports {target}"
        for name, edges in import_graph().items()
        if not name.startswith(LAZY_LAYER)
        for target, places in edges.items()
        for line, inside in places
        if inside
    ]
    assert not late, "imports inside functions: " + "; ".join(late)


LOAD_EVERY_RECIPE = """
import json, sys
from pathlib import Path
from alignment.config.recipe import load_recipe
for path in sorted(Path("recipes").rglob("*.yaml")):
    load_recipe(path)
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("alignment", "torch", "transformers", "trl",
                                                                     "datasets", "accelerate", "peft"))))
"""


def test_loading_any_shipped_recipe_imports_no_torch_and_only_the_config_layer():
    done = subprocess.run(
        [sys.executable, "-c", LOAD_EVERY_RECIPE], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = json.loads(done.stdout)
    heavy = sorted({m.split(".")[0] for m in loaded} - {"alignment"})
    assert heavy == [], f"loading a recipe imported {heavy}"
    ours = {m for m in loaded if m.startswith("alignment")}
    assert {"alignment.config.recipe", "alignment.config.base", "alignment.config.stages.ppo"} <= ours
    extra = sorted(
        m for m in ours if not m.startswith("alignment.config") and m not in ("alignment", "alignment.errors")
    )
    assert extra == [], f"loading a recipe imported {extra}"


def test_every_module_imports():
    """In this process, where the other tests have imported most of them already (an import error fails either
    way; the isolated imports are those of the tests above and of test_stage_table.py)."""
    names = [n for n in sorted(MODULES) if not n.endswith(("sandbox.harness", "__main__"))]  # scripts, not modules
    for name in names:
        importlib.import_module(name)

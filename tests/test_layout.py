"""The package's import structure (DESIGN.md "Layout"): no import cycle among our modules, counting imports
inside functions; loading a recipe imports only the torch-free config layer and the stage configs; below
the stage layer our own modules are imported at the top of the file."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "alignment"
# Where importing inside a function is the design: the CLI (each command loads only what it needs) and the
# stage modules (the recipe loads every stage's Config, which must not pull in torch or TRL).
LAZY_LAYER = ("alignment.cli", "alignment.stages.")


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
        inner = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
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
                return stack[stack.index(target):] + [target]
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
    assert len(graph) > 40 and "alignment.runner" in graph["alignment.cli"]  # the graph sees function-level imports
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_find_cycle_reports_a_cycle_through_a_function_level_import():
    graph = {"a": {"b": [(1, False)]}, "b": {"c": [(3, True)]}, "c": {"a": [(9, True)]}, "d": {}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": []}, "b": {}}) is None


def test_below_the_stage_layer_our_modules_are_imported_at_the_top():
    late = [f"{name}:{line} imports {target}" for name, edges in import_graph().items()
            if not name.startswith(LAZY_LAYER) for target, places in edges.items() for line, inside in places if inside]
    assert not late, "imports inside functions: " + "; ".join(late)


LOAD_EVERY_RECIPE = """
import json, sys
from pathlib import Path
from alignment.recipe import load_recipe
for path in sorted(Path("recipes").rglob("*.yaml")):
    load_recipe(path)
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("alignment", "torch", "transformers", "trl",
                                                                     "datasets", "accelerate", "peft"))))
"""


def test_loading_any_shipped_recipe_imports_no_torch_and_only_the_config_layer():
    done = subprocess.run([sys.executable, "-c", LOAD_EVERY_RECIPE], capture_output=True, text=True, cwd=REPO,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = json.loads(done.stdout)
    heavy = sorted({m.split(".")[0] for m in loaded} - {"alignment"})
    assert heavy == [], f"loading a recipe imported {heavy}"
    ours = {m for m in loaded if m.startswith("alignment")}
    assert {"alignment.recipe", "alignment.config.base", "alignment.stages.ppo"} <= ours
    allowed = ("alignment.config", "alignment.stages", "alignment.tasks")
    extra = sorted(m for m in ours if not m.startswith(allowed) and m not in
                   ("alignment", "alignment.recipe", "alignment.errors", "alignment.files"))
    assert extra == [], f"loading a recipe imported {extra}"


def test_every_module_imports():
    names = [n for n in sorted(MODULES) if not n.endswith(("_sandbox_harness", "__main__"))]  # scripts, not modules
    done = subprocess.run([sys.executable, "-c", "import importlib, sys\nfor n in sys.argv[1:]: importlib.import_module(n)",
                           *names], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]

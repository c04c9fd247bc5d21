"""stratkit's modules import each other in one direction: no import cycle inside `stratkit/`.

Read from the source with `ast` (nothing is imported), so a cycle fails here
before it fails, or half-initialises a module, at someone's import time.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "stratkit"

# Packages that must not be in any cycle even through imports inside functions (a deferred
# import still ties two modules together: the PS loop and its evaluator once did).
NO_DEFERRED_CYCLES = ("stratkit.training.ps", "stratkit.training.inputs", "stratkit.strategy.keras_ps")


def _modules(root: Path = PACKAGE) -> dict[str, Path]:
    modules = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """Statements run at import time: the module body, into if/try blocks (not TYPE_CHECKING ones)."""
    out: list[ast.stmt] = []
    for node in body:
        out.append(node)
        if isinstance(node, ast.If) and not _is_type_checking(node):
            out += _top_level(node.body) + _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            out += _top_level(node.body) + _top_level(node.orelse) + _top_level(node.finalbody)
            for handler in node.handlers:
                out += _top_level(handler.body)
    return out


def imports(name: str, path: Path, modules: dict[str, Path], *, deferred: bool) -> set[str]:
    """The stratkit modules `name` imports (at import time; with `deferred`, inside functions too)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    nodes = list(ast.walk(tree)) if deferred else _top_level(tree.body)
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in modules else base)
    return {module for module in found if module in modules and module != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _graph(*, deferred: bool) -> dict[str, set[str]]:
    modules = _modules()
    return {name: imports(name, path, modules, deferred=deferred) for name, path in modules.items()}


def test_no_import_cycle_among_module_level_imports():
    assert cycles(_graph(deferred=False)) == []


def test_the_ps_loop_and_the_input_layer_are_in_no_cycle_even_through_deferred_imports():
    tangled = [c for c in cycles(_graph(deferred=True)) if any(m.startswith(NO_DEFERRED_CYCLES) for m in c)]
    assert tangled == []


def test_the_cycle_finder_finds_a_cycle(tmp_path):
    package = tmp_path / "stratkit"
    (package / "training").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "training" / "__init__.py").write_text("")
    (package / "training" / "ps.py").write_text("from stratkit.training import evaluator\n")
    (package / "training" / "evaluator.py").write_text("def f():\n    from . import ps\n")
    modules = _modules(package)
    top = {name: imports(name, path, modules, deferred=False) for name, path in modules.items()}
    every = {name: imports(name, path, modules, deferred=True) for name, path in modules.items()}
    assert cycles(top) == []
    assert cycles(every) == [["stratkit.training.evaluator", "stratkit.training.ps"]]

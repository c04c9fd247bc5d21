"""stratkit's modules import each other in one direction: no import cycle inside `stratkit/`, and every
import follows the layers of `docs/architecture.md` (cluster -> strategy -> training -> launching).

Read from the source with `ast` (nothing is imported), so a cycle fails here
before it fails, or half-initialises a module, at someone's import time. Both
rules count imports inside functions too: a function-level import is the same
circle, only hidden until the function runs (issue 46 left one between
`keras_compat/float8.py` and `global_gradient.py`, which the rule then checked
for three packages only; issue 49 untied it and made the rule whole).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "stratkit"

#: The layers, first to last: a module imports (even inside a function) only its own layer and the ones before it.
LAYERS = (("stratkit.cluster",), ("stratkit.strategy",), ("stratkit.data",), ("stratkit.training",),
          ("stratkit.process", "stratkit.launch", "stratkit.spark", "stratkit.ray", "stratkit.tuning"))
#: The public entry points, which offer every layer (`import stratkit`, `stratkit.callbacks`, `stratkit` CLI):
#: they count as the last layer (only it imports them). Every other module outside the layers is the floor
#: (`errors`, `status`, `files`, ...): it imports no layer.
ENTRY_POINTS = frozenset({"stratkit", "stratkit.callbacks", "stratkit.cli"})


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
        if isinstance(node, ast.Call) and _dynamic_import(node):  # importlib.import_module("stratkit....")
            found.add(node.args[0].value)
        elif isinstance(node, ast.Import):
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


def _dynamic_import(node: ast.Call) -> bool:
    """`importlib.import_module("...")` / `import_module("...")` / `__import__("...")` with a literal name."""
    name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
    return (name in ("import_module", "__import__") and bool(node.args) and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str))


def layer(module: str) -> int | None:
    """The index in `LAYERS` of `module`'s layer (an entry point: the last); None for the floor."""
    if module in ENTRY_POINTS:
        return len(LAYERS) - 1
    for index, packages in enumerate(LAYERS):
        if any(module == package or module.startswith(package + ".") for package in packages):
            return index
    return None


def against_the_layers(graph: dict[str, set[str]]) -> list[str]:
    """The imports that point against the layers: into a later layer, or from the floor into any layer."""
    found = []
    for source, targets in sorted(graph.items()):
        if source in ENTRY_POINTS:
            continue  # they offer every layer
        for target in sorted(targets):
            here, there = layer(source), layer(target)
            if there is not None and (here is None or there > here):
                found.append(f"{source} -> {target}")
    return found


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


def test_no_import_cycle_even_through_imports_inside_functions():
    # a deferred import still ties two modules together: the PS loop and its evaluator once did, float8 and
    # global_gradient did until issue 49 (what both need went down to keras_compat/replicas.py)
    assert cycles(_graph(deferred=True)) == []


def test_every_import_follows_the_layers_even_inside_functions():
    # e.g. strategy/ importing training/ inside a function (the fit guard and the done markers once did)
    assert against_the_layers(_graph(deferred=True)) == []


def test_the_layer_check_finds_an_import_against_the_layers(tmp_path):
    package = tmp_path / "stratkit"
    for folder in ("strategy/keras_compat", "training", "cluster"):
        (package / folder).mkdir(parents=True)
    for init in ("", "strategy", "strategy/keras_compat", "training", "cluster"):
        (package / init / "__init__.py").write_text("")
    (package / "errors.py").write_text("")
    (package / "files.py").write_text("def f():\n    from stratkit.cluster import spec\n")
    (package / "cluster" / "spec.py").write_text("from stratkit import errors\n")
    (package / "training" / "backup.py").write_text("from stratkit import files\nfrom ..strategy import guards\n")
    (package / "strategy" / "server.py").write_text("def f():\n    from stratkit.training import backup\n")
    (package / "strategy" / "keras_compat" / "guards.py").write_text(
        "import importlib\n\ndef f():\n    from ...training.backup import x\n    from stratkit import files\n"
        "    importlib.import_module('stratkit.training')\n    import stratkit\n")
    modules = _modules(package)
    every = {name: imports(name, path, modules, deferred=True) for name, path in modules.items()}
    assert against_the_layers(every) == [
        "stratkit.files -> stratkit.cluster.spec",
        "stratkit.strategy.keras_compat.guards -> stratkit",
        "stratkit.strategy.keras_compat.guards -> stratkit.training",
        "stratkit.strategy.keras_compat.guards -> stratkit.training.backup",
        "stratkit.strategy.server -> stratkit.training.backup",
    ]


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

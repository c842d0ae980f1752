"""The modules of scaler-core import one another without a cycle, lazy imports included.

import-linter (``.ci/typecheck``) checks the layers; this test checks what layers
cannot see by themselves: an import inside a function (loaded on first use) that
closes a circle. The graph is read from the source with :mod:`ast`, every
``import`` statement wherever it sits, for the package as it is installed (the
backends inside it, as the wheel lays them out, or beside it in a checkout).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import scaler_core

PACKAGE = "scaler_core"


def _sources(package_dir: Path, backends_dir: Path) -> dict[str, Path]:
    """Every module's dotted name and its file."""
    out: dict[str, Path] = {}
    for base, prefix in ((package_dir, [PACKAGE]), (backends_dir, [PACKAGE, "backends"])):
        for path in base.rglob("*.py"):
            if "__pycache__" in path.parts or (base == package_dir and "backends" in path.parts):
                continue
            parts = [*prefix, *path.relative_to(base).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ``modules`` it imports, at any depth of its code.

    ``from a import b`` counts as importing ``a.b`` when that is a module, else
    ``a``; a module importing a submodule does not count as importing the package
    (``from scaler_core._errors import X`` runs ``scaler_core/__init__`` first, but
    that is the package's order, not a dependency of the module)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join([*base, node.module] if node.module else base)
                else:
                    target = node.module or ""
                subs = {f"{target}.{a.name}" for a in node.names} & modules.keys()
                graph[name] |= subs
                if len(subs) < len(node.names) and target in modules:
                    graph[name].add(target)
            elif isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names} & modules.keys()
        graph[name].discard(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return found


def _installed() -> dict[str, Path]:
    package_dir = Path(scaler_core.__file__).parent
    inside = package_dir / "backends"
    return _sources(package_dir, inside if inside.is_dir() else package_dir.parent / "backends")


def test_no_module_imports_itself_back_through_others() -> None:
    modules = _installed()
    assert f"{PACKAGE}.backends._torch" in modules
    assert f"{PACKAGE}._state" in modules
    assert cycles(import_graph(modules)) == []


def test_the_graph_sees_lazy_imports_and_names_the_circle(tmp_path: Path) -> None:
    """The checker itself: a circle closed by an import inside a function is found,
    and one of plain layers is not."""
    package = tmp_path / PACKAGE
    (package / "backends").mkdir(parents=True)
    (package / "__init__.py").write_text("from . import a\n")
    (package / "a.py").write_text("from .backends import _x\n")
    (package / "backends" / "__init__.py").write_text("")
    (package / "backends" / "_x.py").write_text("from scaler_core.a import thing\n")
    (package / "backends" / "_y.py").write_text(
        "def later():\n    from . import _z  # loaded on first use\n"
    )
    (package / "backends" / "_z.py").write_text("import scaler_core.backends._x\n")
    modules = _sources(package, package / "backends")
    graph = import_graph(modules)
    assert graph["scaler_core.backends._y"] == {"scaler_core.backends._z"}
    assert cycles(graph) == [["scaler_core.a", "scaler_core.backends._x"]]
    (package / "backends" / "_x.py").write_text("")
    assert cycles(import_graph(modules)) == []
    (package / "backends" / "_x.py").write_text(
        "def later():\n    from ._y import later\n"  # _x -> _y -> (lazily) _z -> _x
    )
    assert cycles(import_graph(modules)) == [
        ["scaler_core.backends._x", "scaler_core.backends._y", "scaler_core.backends._z"]
    ]

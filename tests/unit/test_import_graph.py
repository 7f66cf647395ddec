"""The import graph of the product: no module cycles, and nothing of the product (or of
its unit tests) leans on the benchmark scripts.

Every import counts, at module top or inside a function (a lazy import is still a
dependency); imports under `if TYPE_CHECKING:` do not, since they never run.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("app", "deployments", "predictor")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(packages: tuple[str, ...]) -> dict[str, Path]:
    return {module_name(p): p for package in packages for p in (REPO / package).rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_names(path: Path, name: str) -> Iterator[str]:
    """Every dotted name `path` imports at run time (`from a import b` yields a.b, which
    resolves to a when b is not a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    stack: list[ast.AST] = [ast.parse(path.read_text())]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            yield from (f"{base}.{alias.name}" for alias in node.names)
        stack.extend(ast.iter_child_nodes(node))


def import_graph(known: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the known modules it imports (a name resolves to its longest known
    prefix: `from pkg import sub` is the submodule when there is one)."""
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        targets = set()
        for imported in imported_names(path, name):
            while imported and imported not in known:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in graph:
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


def test_cycles_finds_a_lazy_cycle_and_ignores_type_checking_imports(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x\n"
                      "def f():\n    from y import z\n")
    assert set(imported_names(source, "m")) == {"typing.TYPE_CHECKING", "y.z"}


def test_the_product_and_the_benchmarks_have_no_import_cycle():
    known = modules((*PRODUCT, "benchmarks"))
    assert cycles(import_graph(known)) == []


def test_nothing_in_the_product_imports_the_benchmark_scripts():
    known = modules((*PRODUCT, "benchmarks"))
    graph = import_graph(known)
    leaning = {name: sorted(t for t in graph[name] if t.split(".")[0] == "benchmarks")
               for name in modules(PRODUCT)}
    assert {name: targets for name, targets in leaning.items() if targets} == {}


def test_no_unit_test_imports_the_benchmark_scripts():
    unit = REPO / "tests" / "unit"
    leaning = [path.name for path in unit.glob("test_*.py")
               if any(n.split(".")[0] == "benchmarks"
                      for n in imported_names(path, path.stem))]
    assert leaning == []

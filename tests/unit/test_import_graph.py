"""The import graph of the product: no module cycles, and nothing of the product (or of
its unit tests) leans on the benchmark scripts.

Every import counts: at module top, inside a function (a lazy import is still a
dependency) and under `if TYPE_CHECKING:` (two modules that need each other's types are
one piece, however the imports are arranged).
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


def imported_names(path: Path, name: str) -> Iterator[str]:
    """Every dotted name `path` imports (`from a import b` yields a.b, which resolves to a
    when b is not a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            yield from (f"{base}.{alias.name}" for alias in node.names)


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


def loop_through(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One import loop inside a cycle's `component`: its first module, the modules it
    reaches through, and the first module again (shortest such loop)."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for child in sorted(graph[node] & members):
            if child == start:
                return [*paths[node], start]
            if child not in paths:
                paths[child] = [*paths[node], child]
                frontier.append(child)
    raise AssertionError(f"{component} is not a cycle")


def test_cycles_finds_lazy_and_type_checking_cycles_and_names_a_loop(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert loop_through(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x\n"
                      "def f():\n    from y import z\n")
    assert set(imported_names(source, "m")) == {"typing.TYPE_CHECKING", "x", "y.z"}


def test_a_relative_import_of_a_submodule_is_that_submodule(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "b.py").write_text("name = 1\n")
    (package / "a.py").write_text("from . import b\nfrom .b import name\n")
    known = {"pkg": package / "__init__.py", "pkg.a": package / "a.py",
             "pkg.b": package / "b.py"}
    assert set(imported_names(known["pkg.a"], "pkg.a")) == {"pkg.b", "pkg.b.name"}
    assert import_graph(known)["pkg.a"] == {"pkg.b"}


def test_the_product_and_the_benchmarks_have_no_import_cycle():
    graph = import_graph(modules((*PRODUCT, "benchmarks")))
    loops = [" -> ".join(loop_through(graph, c)) for c in cycles(graph)]
    assert not loops, "import cycles:\n  " + "\n  ".join(loops)


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

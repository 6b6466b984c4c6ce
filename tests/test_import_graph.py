"""No import circle among the modules of growcache/, counting imports inside functions too.

An import inside a function hides a circle from Python (it runs after both modules loaded)
but not from a reader: the two modules still depend on each other. Only imports under
``if TYPE_CHECKING:`` are left out, since they never run.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import growcache

PACKAGE = Path(growcache.__file__).parent


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported(node: ast.AST, modules: set[str]) -> set[str]:
    """The growcache modules ``node`` imports (``from . import m``, ``from .m import x``,
    ``import growcache.m``, ``from growcache.m import x``)."""
    found: set[str] = set()
    if isinstance(node, ast.ImportFrom):
        if node.level == 1 or node.module == "growcache" or (node.module or "").startswith("growcache."):
            base = node.module if node.level == 1 else (node.module or "").partition(".")[2]
            if base:
                found.add(base.split(".")[0])
            else:  # from . import m
                found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.Import):
        found.update(alias.name.split(".")[1] for alias in node.names if alias.name.startswith("growcache."))
    return found & modules


def _graph(package: Path) -> dict[str, set[str]]:
    modules = {path.stem for path in package.glob("*.py") if path.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name in sorted(modules):
        tree = ast.parse((package / f"{name}.py").read_text(), name)
        skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node.test)
                   for stmt in node.body for n in ast.walk(stmt)}
        graph[name] = set()
        for node in ast.walk(tree):
            if id(node) not in skipped:
                graph[name] |= _imported(node, modules) - {name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected group of modules (Tarjan), as a path that closes."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_path(graph, group) for group in groups]


def _path(graph: dict[str, set[str]], group: list[str]) -> list[str]:
    # A shortest way from the group's first module back to itself, inside the group.
    start, inside = group[0], set(group)
    ways = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for other in sorted(graph[node] & inside):
                if other == start:
                    return [*ways[node], start]
                if other not in ways:
                    ways[other] = [*ways[node], other]
                    following.append(other)
        frontier = following
    return group


def _graph_in_a_fresh_interpreter(package: Path) -> dict[str, set[str]]:
    # In a full run, CPython 3.11's ast.parse raised "SystemError: AST constructor recursion depth
    # mismatch" (gh-106905, fixed in 3.11.8) after earlier tests had moved the recursion limit: the
    # modules are read in an interpreter of their own, as tests/test_package.py does.
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); "
            "from pathlib import Path; from test_import_graph import _graph; "
            f"print(json.dumps({{k: sorted(v) for k, v in _graph(Path({str(package)!r})).items()}}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return {name: set(imported) for name, imported in json.loads(result.stdout).items()}


def test_no_import_circle_among_core_modules():
    graph = _graph_in_a_fresh_interpreter(PACKAGE)
    assert len(graph) > 10 and any(graph.values())
    circles = _circles(graph)
    assert circles == [], "import circles in growcache/ (function-level imports count too): " + "; ".join(
        " -> ".join(circle) for circle in circles)


def test_the_scan_sees_circles_through_function_level_imports(tmp_path):
    (tmp_path / "a.py").write_text("from .b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    from .c import y\n")
    (tmp_path / "c.py").write_text("class C:\n    def g(self):\n        from . import a\n")
    (tmp_path / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n")
    (tmp_path / "e.py").write_text("import growcache.d\n")
    graph = _graph(tmp_path)
    assert graph == {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set(), "e": {"d"}}
    assert _circles(graph) == [["a", "b", "c", "a"]]

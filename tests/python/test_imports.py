"""halocp's import graph: no circle (at any depth, function-level imports
included), and the leaf helpers import nothing of the package. Read from
the source with ast, so nothing is imported to check it.

    python3 -m pytest -p no:cacheprovider tests/python/test_imports.py
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "halocp"
LEAVES = ("_layout",)


def _graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (relative or absolute)."""
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    graph = {}
    for path in PACKAGE.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level == 1 or (node.module or "").split(".")[0] == "halocp":
                    base = (node.module or "").removeprefix("halocp").lstrip(".") if node.level == 0 else node.module
                    if base:
                        deps.add(base.split(".")[0])
                    else:  # from . import a, b
                        deps.update(a.name for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name.split(".")[1] for a in node.names if a.name.startswith("halocp."))
        graph[path.stem] = {d for d in deps if d in modules and d != path.stem}
    return graph


def _cycle(graph) -> list[str] | None:
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                return stack[stack.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        state[m] = "done"
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_circle():
    graph = _graph()
    assert "__init__" in graph and graph["__init__"], "the walk found no imports: is the package where it was?"
    found = _cycle({m: d - {"__init__"} for m, d in graph.items()})
    assert found is None, "halocp imports in a circle: " + " -> ".join(found)


def test_leaves_import_nothing_of_the_package():
    graph = _graph()
    for leaf in LEAVES:
        assert not graph[leaf], f"halocp.{leaf} imports {sorted(graph[leaf])}: it is a leaf"


def test_the_walk_sees_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]

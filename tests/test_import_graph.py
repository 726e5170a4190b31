"""The import graph: no circle among the project's modules, and the client side loads
nothing of the server side.

The graph is read from the source (``ast``): every ``import`` and ``from ... import``
of a project module, at module level or inside a function, counts; those under
``if TYPE_CHECKING:`` do not (they never run).  ``from pkg import name`` counts as an
import of ``pkg.name`` when that is a module, else of ``pkg``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("kvmaster", "tools")
#: Modules of the master's side: a client process never needs them.
SERVER_SIDE = ("kvmaster.master", "kvmaster._shard", "kvmaster._records", "kvmaster._sessions",
               "kvmaster._any_shard",
               "kvmaster._writers",
               "kvmaster._ends",
               "kvmaster._starts",
               "kvmaster._removals",
               "kvmaster._inspection",
               "kvmaster._reads",
               "kvmaster._tagged",
               "kvmaster._placement",
               "kvmaster._walks",
               "kvmaster._segment_life",
               "kvmaster._groups", "kvmaster._shard_replicas", "kvmaster._shardproc",
               "kvmaster._tenancy", "kvmaster._eviction", "kvmaster._limits",
               "kvmaster._mounts", "kvmaster.ha", "kvmaster.metrics", "kvmaster.config",
               "kvmaster._front", "kvmaster._ha_fence", "kvmaster._registry",
               "kvmaster._shardref")


@pytest.fixture(autouse=True)
def no_leaked_segments() -> None:
    """Overrides the conftest fixture: nothing here creates shared memory."""


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _targets(mods: dict[str, Path], current: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = current.split(".")
            if mods[current].name != "__init__.py":
                parts = parts[:-1]
            parts = parts[:len(parts) - (node.level - 1)]
            base = ".".join(parts + ([base] if base else []))
        subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
        names = subs if len(subs) == len(node.names) else [base, *subs]
    out = set()
    for name in names:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        if name and name != current:
            out.add(name)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports when it runs."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps: set[str] = set()
        todo: list[ast.AST] = [ast.parse(path.read_text(), str(path))]
        while todo:
            node = todo.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and _is_type_checking(child):
                    todo.extend(child.orelse)
                    continue
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    deps |= _targets(mods, name, child)
                todo.append(child)
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_graph_is_read_and_circles_are_found() -> None:
    graph = import_graph()
    assert "kvmaster._records" in graph["kvmaster._shard"]
    assert "kvmaster._records" in graph["kvmaster._sessions"]
    assert "kvmaster._shard" not in graph["kvmaster._sessions"]  # only under TYPE_CHECKING
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle() -> None:
    assert circles(import_graph()) == []


def test_the_client_side_loads_nothing_of_the_server_side() -> None:
    code = textwrap.dedent(f"""
        import sys
        import kvmaster, kvmaster.client, kvmaster.aio, kvmaster.compat, kvmaster.errors
        server = {SERVER_SIDE!r}
        print(sorted(m for m in server if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr

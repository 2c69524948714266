"""No import cycle inside steadyrl/: the graph of its modules' top-level imports (read with ast,
nothing imported) has none. A package's `__init__` is not an edge of its submodules (Python
runs it first either way); `if TYPE_CHECKING:` blocks are not imports at run time."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import ROOT

PKG = ROOT / "steadyrl"


def module_files() -> dict[str, Path]:
    """Dotted name -> file of every module under steadyrl/ (the services, linked in, excluded)."""
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(ROOT).with_suffix("")
        if "__pycache__" in rel.parts or rel.parts[1] == "services":
            continue
        parts = list(rel.parts[:-1]) if rel.parts[-1] == "__init__" else list(rel.parts)
        out[".".join(parts)] = p
    return out


def _top_level(tree: ast.Module):
    """Statements run at import: the module's body, into if/try blocks but not TYPE_CHECKING's."""
    todo = list(tree.body)
    while todo:
        n = todo.pop(0)
        if isinstance(n, ast.If):
            test = n.test
            name = test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", None)
            if name != "TYPE_CHECKING":
                todo += n.body + n.orelse
        elif isinstance(n, ast.Try):
            todo += n.body + n.orelse + n.finalbody + [s for h in n.handlers for s in h.body]
        else:
            yield n


def import_graph(files: dict[str, Path], everywhere: bool = False) -> dict[str, set[str]]:
    """module -> the steadyrl modules its top-level imports load (`everywhere`: its imports
    inside functions too)."""
    def resolve(name: str) -> str | None:
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in files:
                return ".".join(parts[:i])
        return None

    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        edges = set()
        tree = ast.parse(path.read_text(), str(path))
        for n in (ast.walk(tree) if everywhere else _top_level(tree)):
            names = []
            if isinstance(n, ast.Import):
                names = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom):
                base = n.module or ""
                if n.level:
                    up = package.split(".")[:len(package.split(".")) - n.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in n.names]
            for name in names:
                target = resolve(name)
                if target is not None and target != mod and not mod.startswith(target + "."):
                    edges.add(target)
        graph[mod] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_finder_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_steadyrl_has_no_import_cycle():
    files = module_files()
    assert "steadyrl.run.runfolder" in files and "steadyrl.cli.up" in files
    graph = import_graph(files)
    assert "steadyrl.run.runfolder" in graph["steadyrl.cli.up"]
    assert cycles(graph) == []

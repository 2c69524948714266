"""Imports inside functions (issue 35): none in steadyrl/ or services/ except at entry points and
for optional or heavy dependencies, each saying which on its own line (`# lazy: <why>`); and
no import cycle even counting those lazy imports (a cycle hidden inside a function is still one).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import ROOT
from tests.steadyrl.test_import_cycles import cycles, import_graph, module_files

MARK = "# lazy:"


def function_level_imports(path: Path) -> list[tuple[int, str]]:
    """(line, source line) of every import statement inside a function of `path`."""
    src = path.read_text()
    lines = src.splitlines()
    found = set()
    for fn in ast.walk(ast.parse(src, str(path))):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for n in ast.walk(fn):
                if isinstance(n, (ast.Import, ast.ImportFrom)):
                    found.add((n.lineno, lines[n.lineno - 1].strip()))
    return sorted(found)


def python_files() -> list[Path]:
    return sorted(p for top in ("steadyrl", "services") for p in (ROOT / top).rglob("*.py")
                  if "__pycache__" not in p.parts and p.relative_to(ROOT).parts[:2] != ("steadyrl", "services"))


def test_the_finder_sees_an_import_in_a_method(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("import os\nclass A:\n    def f(self):\n        import json  # lazy: x\n"
                 "        def g():\n            from pathlib import Path\n")
    assert function_level_imports(p) == [(4, "import json  # lazy: x"), (6, "from pathlib import Path")]


def test_every_function_level_import_says_why_it_is_lazy():
    files = python_files()
    assert any(p.name == "up.py" for p in files) and any(p.parts[-3:-1] == ("services", "actor") for p in files)
    unmarked = [f"{p.relative_to(ROOT)}:{line}: {text}" for p in files
                for line, text in function_level_imports(p) if MARK not in text]
    assert not unmarked, ("import at the module's top, or say why not with `# lazy: <entry point | heavy or "
                          "optional dependency: which>` on the import's line:\n" + "\n".join(unmarked))


def test_no_import_cycle_even_through_lazy_imports():
    graph = import_graph(module_files(), everywhere=True)
    assert graph["steadyrl.cli.up"], "the graph has edges"
    assert cycles(graph) == []

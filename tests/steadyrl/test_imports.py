"""Import boundaries, read from the source (ast), nothing imported to check them:

- `steadyrl/` never imports `services` (the shared runtime under every service must not
  depend on one), at module level or inside a function, nor by importlib with a literal name;
- `steadyrl up` starts each service by module name, `python -m steadyrl.services.<name>`, from the
  SERVICES mapping, whose every module exists under services/;
- no service imports another service's package (services/<a>/ reaches services/<b>/ only
  through Kafka topics and HTTP).
"""

from __future__ import annotations

import ast
import sys
import threading
from pathlib import Path

import pytest

from tests.helpers import ROOT

IMPORTERS = {"import_module", "__import__"}  # importlib.import_module("x"), __import__("x")


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, dotted module name) of every import anywhere in `tree`: `import a.b`, `from a.b
    import c` (as a.b and a.b.c: c may be a module), and importlib.import_module / __import__
    with a literal name. Relative imports (`from . import x`) stay inside their package: skipped."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else None
            if name in IMPORTERS:
                found.append((node.lineno, node.args[0].value))
    return found


def is_services(module: str) -> bool:
    """A service module, under its one import path (steadyrl.services) or the checkout's folder name."""
    return any(module == p or module.startswith(p + ".") for p in ("steadyrl.services", "services"))


def service_of(module: str) -> str | None:
    """`learner` for steadyrl.services.learner.x (the folder services/learner/), else None."""
    parts = module.split(".")
    return parts[2] if parts[:2] == ["steadyrl", "services"] and len(parts) > 2 else None


def py_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def test_the_reader_finds_every_kind_of_import():
    """The check below would see each of these (so an empty answer there means something)."""
    src = '''
import os, services
import steadyrl.services.reward.server as srv
from steadyrl.services.learner import learner
from services import actor
def f():
    from steadyrl.services.reward.server import RewardServer
    import importlib
    importlib.import_module("steadyrl.services.rollout")
    return __import__("steadyrl.services.actor")
from . import sibling
from steadyrl.model.scorers import build_scorer
'''
    hits = [(line, m) for line, m in imported_modules(ast.parse(src)) if is_services(m)]
    assert [line for line, _ in hits] == [2, 3, 4, 4, 5, 5, 7, 7, 9, 10]
    assert {"services", "steadyrl.services.actor", "steadyrl.services.rollout",
            "steadyrl.services.reward.server.RewardServer"} <= {m for _, m in hits}
    assert not is_services("servicesx") and not is_services("steadyrl.servicesx")
    assert service_of("steadyrl.services.learner.main") == "learner" and service_of("services.learner") is None


def test_every_module_has_one_import_path():
    """The services ship as steadyrl.services (pyproject's package-dir); nothing imports the
    checkout's folder name `services`, or every Prometheus metric would register twice."""
    files = [f for d in ("steadyrl", "services", "tests", "bench", "scripts") for f in py_files(ROOT / d)]
    bad = [f"{f.relative_to(ROOT)}:{line}: {m}" for f in files
           for line, m in imported_modules(ast.parse(f.read_text(), str(f)))
           if m == "services" or m.startswith("services.")]
    assert bad == []


def test_steadyrl_never_imports_services():
    files = py_files(ROOT / "steadyrl")
    assert len(files) > 30 and ROOT / "steadyrl" / "cli" / "score.py" in files
    bad = [f"{f.relative_to(ROOT)}:{line}: {m}" for f in files
           for line, m in imported_modules(ast.parse(f.read_text(), str(f))) if is_services(m)]
    assert bad == [], "steadyrl/ must not import a service (move the shared code into steadyrl/)"


def _module_path(module: str) -> Path | None:
    """The file `python -m module` runs, looked up on disk (nothing imported), or None."""
    base = ROOT.joinpath("services", *module.split(".")[2:])
    for p in (base / "__main__.py", base.with_suffix(".py")):
        if p.is_file():
            return p
    return None


def test_up_starts_every_service_as_python_m_its_module(monkeypatch, tmp_path):
    from steadyrl.cli import SERVICES, main
    from steadyrl.cli import up as up_cmd

    for svc, module in SERVICES.items():
        assert isinstance(module, str) and service_of(module), (svc, module)
        assert (ROOT / "services" / service_of(module)).is_dir(), module
        assert _module_path(module) is not None, f"{module}: no services/.../__main__.py or .py to run"

    started = []

    class FakeSupervisor:  # records the children instead of starting them
        def __init__(self, children, is_done, log_dir=None, out=None, liveness=None):
            started.extend(children)
            self.stop = threading.Event()

        def start_all(self):
            pass

        def wait_ready(self):
            return {c.name: True for c in started}

        def stop_all(self):
            pass

    monkeypatch.setattr(up_cmd, "Supervisor", FakeSupervisor)  # where the command looks them up
    monkeypatch.setattr(up_cmd, "create_topics", lambda bootstrap, prefix: {})
    monkeypatch.setattr(up_cmd, "_require_broker", lambda bootstrap: None)
    monkeypatch.setattr(up_cmd.signal, "signal", lambda signum, handler: None)  # leave pytest's Ctrl-C alone
    assert main(["up", "--bootstrap", "h:9", "--state-dir", str(tmp_path), "--exit-when-ready",
                 "--scale", "rollout=2"]) == 0
    modules = []
    for child in started:
        argv = child.argv
        assert argv[:2] == [sys.executable, "-m"], argv
        modules.append(argv[2])
    assert sorted(set(modules)) == sorted(SERVICES.values())
    assert modules.count(SERVICES["rollout"]) == 2


def _service_packages() -> list[str]:
    return sorted(p.name for p in (ROOT / "services").iterdir() if (p / "__init__.py").is_file())


@pytest.mark.parametrize("service", _service_packages())
def test_no_service_imports_another_services_package(service):
    others = set(_service_packages()) - {service}
    bad = []
    for f in py_files(ROOT / "services" / service):
        for line, m in imported_modules(ast.parse(f.read_text(), str(f))):
            if service_of(m) in others:
                bad.append(f"{f.relative_to(ROOT)}:{line}: {m}")
    assert bad == [], f"services/{service}/ imports another service (talk over Kafka or HTTP instead)"

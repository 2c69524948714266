"""The built wheel alone gives a working `steadyrl` from any folder.

The wheel is built from a copy of the sources the Dockerfile copies (`pip wheel --no-deps
--no-build-isolation`: no stale build/ of the checkout gets in) and installed with `--no-deps`
into a fresh venv outside the checkout. That venv has no pip and no packages of its own: one
.pth line puts .venv's site-packages after its own, for the third-party dependencies. A path
a .pth adds is not a site folder, so the .pth files there, the editable install's finder among
them, never run: `steadyrl` and everything it reads (schemas, topic catalogue, data, configs,
broker manifest) can only come from the wheel, which the first test checks.

Then `steadyrl up` from the venv, in an empty folder, runs the tiny config shipped in the
package to its end with a broker of its own (jars from the user cache, started with the shipped
log4j2.properties), and the installed files are compared before and after: nothing written.
And `steadyrl up --model --data --reward` on a user's own things, made in another empty folder
(a tiny model folder, a JSONL and a reward file with verl's signature), runs to its end too
(issue 38). About 60 s on 2 idle CPU cores (150 s with the machine busy): wheel, venv and
install 6 s.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from steadyrl.local.jars import fetch
from steadyrl.local.ports import free_port_pair
from tests.helpers import ROOT, own_things

pytestmark = pytest.mark.slow

#: What the package is built from (the Dockerfile's COPY sources).
SOURCES = ["pyproject.toml", "README.md", "steadyrl", "services", "schemas", "data", "configs",
           "broker/pom.xml", "broker/log4j2.properties"]


def _run(cmd: list, cwd: Path, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                       env={**env, **kw.pop("env", {})}, **kw)
    assert r.returncode == 0, f"{cmd} exited {r.returncode}:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """{"python": the venv's interpreter, "steadyrl": its console script, "package": the installed
    steadyrl folder, "site": the venv's site-packages, "work": an empty folder outside the checkout}."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    for name in SOURCES:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / name, src / name)
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp / "wheels",
          src], cwd=tmp)
    [wheel] = (tmp / "wheels").glob("steadyrl-*.whl")

    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp)
    python = venv / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=tmp).stdout.strip())
    deps = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))   # .venv's, in order
    (site / "deps-from-dot-venv.pth").write_text("".join(f"{d}\n" for d in deps))
    # pip comes from .venv's site-packages; --ignore-installed: the editable steadyrl it sees there
    # is neither uninstalled nor taken as the install
    _run([python, "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", wheel], cwd=tmp)
    work = tmp / "work"
    work.mkdir()
    return {"python": python, "steadyrl": venv / "bin" / "steadyrl", "package": site / "steadyrl", "site": site,
            "work": work}


def _probe(installed: dict, code: str) -> dict:
    return json.loads(_run([installed["python"], "-c", code], cwd=installed["work"]).stdout)


def test_the_venv_imports_steadyrl_and_its_files_from_the_wheel_only(installed):
    got = _probe(installed, """if True:
        import json, sys
        import steadyrl, steadyrl.services.learner.config as lc, steadyrl.bus.topics as t, steadyrl.local.broker as b
        from steadyrl.assets import asset_dir
        from steadyrl.model.data import ARITHMETIC
        rows = lc.load_dataset(lc.check_dataset("data/arithmetic/train.parquet"))   # the default, from any folder
        print(json.dumps({"steadyrl": steadyrl.__file__, "learner": lc.__file__,
                          **{n: str(asset_dir(n)) for n in ("schemas", "data", "configs", "broker")},
                          "catalogue": str(t.CATALOGUE_PATH), "topics": len(t.load_catalogue()),
                          "arithmetic": str(ARITHMETIC), "rows": len(rows), "libs": str(b.libs_dir()),
                          "finders": [type(f).__name__ if not isinstance(f, type) else f.__name__
                                      for f in sys.meta_path]}))""")
    package = installed["package"]
    for key in ("steadyrl", "learner", "catalogue", "arithmetic", "schemas", "data", "configs", "broker"):
        path = Path(got[key])
        assert path.exists() and path.is_relative_to(package) and not path.is_relative_to(ROOT), (key, path)
    for name in ("configs/tiny.yaml", "schemas/topics.yaml", "schemas/prompt.v1.schema.json",
                 "data/arithmetic/test.parquet", "broker/pom.xml", "broker/log4j2.properties"):
        assert (package / "assets" / name).is_file(), name
    assert got["topics"] >= 5 and got["rows"] > 1000
    assert not any("Editable" in f for f in got["finders"]), got["finders"]
    assert not Path(got["libs"]).is_relative_to(package)   # the jars go to the user cache
    # only the listed files of the shipped folders: no jars an older checkout left in broker/libs
    assert sorted(p.name for p in (package / "assets" / "broker").iterdir()) == ["log4j2.properties", "pom.xml"]
    assert not [p for p in package.rglob("*") if p.is_symlink()]


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """relative path -> (size, mtime in ns) of every file under `folder` but bytecode caches."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")
            if "__pycache__" not in p.parts and not p.is_dir()}


def test_steadyrl_up_runs_the_shipped_tiny_config_to_its_end_from_another_folder(installed, tmp_path):
    fetch()   # the broker jars into the user cache, where the installed steadyrl finds them too
    tiny = _probe(installed, "import json; from steadyrl.assets import asset_dir; "
                             "print(json.dumps(str(asset_dir('configs') / 'tiny.yaml')))")
    assert Path(tiny).is_relative_to(installed["package"])
    before = _snapshot(installed["site"])
    port, offset = free_port_pair(), 3000 + os.getpid() % 2000
    state = installed["work"] / "state"
    r = subprocess.run([installed["steadyrl"], "up", "--state-dir", "state", "--port", str(port),
                        "--port-offset", str(offset), "--prefix", "install.", "--config", tiny],
                       cwd=installed["work"], capture_output=True, text=True, timeout=480,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, start_new_session=True)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert "learner-0 finished its run; stopping the stack" in out and out.rstrip().endswith("stopped"), out[-3000:]
    run = state / "learner" / (state / "learner" / "CURRENT").read_text().strip()
    st = json.loads((run / "state.json").read_text())
    assert st["finished"] and st["step"] == 100, st
    assert (run / "summary.json").is_file()
    assert _snapshot(installed["site"]) == before, "steadyrl wrote into its installed package"
    assert "stopping broker" in out   # the broker up started from the shipped manifest


#: A user's reward file: verl's signature, the share of the first four characters that repeat the digit.
REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    assert data_source == "mine", data_source
    return sum(c == ground_truth for c in solution_str[:4]) / 4.0
"""


def test_steadyrl_up_trains_a_users_model_data_and_reward_from_another_folder(installed, tmp_path):
    """The installed `steadyrl up --model <folder> --data <jsonl> --reward <file.py>:<function>` from
    a folder of the user's own (tests/integration/test_own_things.py runs it from the checkout),
    at the shipped tiny config's sizes, for a few steps."""
    fetch()
    home = installed["work"].parent / "own"
    home.mkdir()
    assert not list(home.iterdir())
    own_things(home, REWARD)
    tiny = _probe(installed, "import json; from steadyrl.assets import asset_dir; "
                             "print(json.dumps(str(asset_dir('configs') / 'tiny.yaml')))")
    port, offset = free_port_pair(), 3000 + (os.getpid() + 500) % 2000
    r = subprocess.run([installed["steadyrl"], "up", "--config", tiny, "--model", "model", "--data", "train.jsonl",
                        "--reward", "my_reward.py:compute_score", "--steps", "3", "--state-dir", "state",
                        "--port", str(port), "--port-offset", str(offset), "--prefix", "install-own."],
                       cwd=home, capture_output=True, text=True, timeout=480,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, start_new_session=True)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert "learner-0 finished its run; stopping the stack" in out and out.rstrip().endswith("stopped"), out[-3000:]
    assert "evaluation: none (--data without --eval-data" in out
    run = home / "state" / "learner" / (home / "state" / "learner" / "CURRENT").read_text().strip()
    st = json.loads((run / "state.json").read_text())
    assert st["finished"] and st["step"] == 3, st
    summary = json.loads((run / "summary.json").read_text())
    assert summary["data"] == "train.jsonl" and summary["model"] == "model" and len(summary["reward_per_step"]) == 3

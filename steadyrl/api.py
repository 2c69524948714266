"""A run from Python: start the whole stack, follow it, wait for it, stop it, export its weights.

    import steadyrl

    run = steadyrl.up(config="configs/tiny.yaml", state_dir="runs/demo", learner={"steps": 20})
    for p in run.follow():                      # the learner's /progress, each time it changes
        print(p["step"], p.get("reward_mean"))
    summary = run.wait()                        # summary.json of the finished run
    run.export("runs/demo-model")               # the last version as a Hugging Face model folder

A `Run` is `steadyrl up` in a process of its own (its own session: `stop()` ends it and
everything it started, broker included), its output in `<state_dir>/up.log`. Settings are the
config file's, with `sections` (e.g. `learner={"steps": 20}`) merged over it, written to
`<state_dir>/api-config.yaml`. Used as a context manager it stops on exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import yaml

from steadyrl.cli.up import SERVICE_PORTS
from steadyrl.config import config_path
from steadyrl.run.runfolder import RunDir
from steadyrl.run.runview import fetch_metrics, fetch_progress

LEARNER_PORT = SERVICE_PORTS["learner"]   # before --port-offset


class RunFailed(RuntimeError):
    """`steadyrl up` exited with a status other than 0; the message ends with its last output."""


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class Run:
    """One `steadyrl up` started from Python.

    Args:
        config: a YAML file (as `up --config`: `configs/tiny.yaml` is the shipped one from any
            folder); None: the defaults (`make run`).
        state_dir: up's `--state-dir` (broker, policies/, learner/, up.log).
        port: the local broker's port (its controller on port + 1); ignored with `bootstrap`.
        port_offset: added to every service's HTTP port (`up --port-offset`).
        bootstrap: an existing cluster instead of a local broker.
        model, data, eval_data, reward, steps: up's `--model`, `--data`, `--eval-data`,
            `--reward`, `--steps` (each set everywhere it is read; paths relative to the working
            folder; data and eval_data one file or a list).
        tools, env: up's `--tools` (`my_tools.py:calc,search`) or `--env` (`my_env.py:Class`):
            multi-turn episodes (docs/agents.md).
        **sections: settings merged over the config, by section (`learner={"steps": 5}`).
    """

    def __init__(self, config: str | Path | None = None, state_dir: str | Path = ".steadyrl",
                 port: int | None = None, port_offset: int = 0, bootstrap: str | None = None,
                 model: str | Path | None = None, data: str | Path | list[str | Path] | None = None,
                 eval_data: str | Path | list[str | Path] | None = None, reward: str | None = None,
                 steps: int | None = None, tools: str | None = None, env: str | None = None,
                 **sections: dict[str, Any]):
        self.state_dir = Path(state_dir).resolve()
        self.port, self.port_offset, self.bootstrap = port, port_offset, bootstrap
        self.own: list[str] = []   # up's flags for the user's own things
        for flag, value in (("--model", model), ("--data", data), ("--eval-data", eval_data),
                            ("--reward", reward), ("--steps", steps), ("--tools", tools), ("--env", env)):
            if value is not None:
                self.own += [flag, *(map(str, value) if isinstance(value, list) else [str(value)])]
        base = yaml.safe_load(config_path(config).read_text()) or {} if config is not None else {}
        self.settings: dict[str, Any] = _merge(base, sections)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.state_dir / "up.log"
        self._http = httpx.Client(timeout=2.0)

    def start(self) -> Run:
        """Start `steadyrl up` (returns at once); returns self. Raises RuntimeError when started."""
        if self.proc is not None:
            raise RuntimeError("this run was started already")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        config = self.state_dir / "api-config.yaml"
        config.write_text(yaml.safe_dump(self.settings, sort_keys=False))
        cmd = [sys.executable, "-m", "steadyrl.cli", "up", "--config", str(config), "--state-dir",
               str(self.state_dir), "--port-offset", str(self.port_offset), *self.own]
        cmd += ["--bootstrap", self.bootstrap] if self.bootstrap else []
        cmd += ["--port", str(self.port)] if self.port and not self.bootstrap else []
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        return self

    @property
    def running(self) -> bool:
        """Whether `up` was started and has not exited."""
        return self.proc is not None and self.proc.poll() is None

    def progress(self) -> dict[str, Any]:
        """The learner's GET /progress (phase, step, steps, reward_mean, done, run_id, ...); {}
        while it does not answer."""
        return fetch_progress(self.learner_url, self._http)

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        """The learner's /metrics as {(name, frozenset of (label, value)): value}, e.g.
        `run.metrics()[("steadyrl_learner_step", frozenset())]`; {} while it does not answer."""
        return fetch_metrics(self.learner_url, self._http)

    @property
    def learner_url(self) -> str:
        """The learner's HTTP address under this run's port offset."""
        return f"http://127.0.0.1:{LEARNER_PORT + self.port_offset}"

    def follow(self, interval_s: float = 2.0) -> Iterator[dict[str, Any]]:
        """Yield /progress each time its step or phase changes, until `up` exits."""
        last: tuple[Any, Any] | None = None
        while self.running:
            p = self.progress()
            if p and (p.get("step"), p.get("phase")) != last:
                last = (p.get("step"), p.get("phase"))
                yield p
            time.sleep(interval_s)

    def wait(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Wait for `up` to exit; returns the run's summary.json. Raises RunFailed (a status
        other than 0, with the end of up.log), subprocess.TimeoutExpired."""
        if self.proc is None:
            raise RuntimeError("start() the run first")
        rc = self.proc.wait(timeout_s)
        if rc != 0:
            raise RunFailed(f"steadyrl up exited with {rc}; the end of {self.log_path}:\n{self.log()[-3000:]}")
        return RunDir.of_up(self.state_dir).summary()

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM to `up` (it stops its services and the broker it started), then whatever of its
        session is left; returns its exit status (None: never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)   # our session only: what up left behind
        rc = self.proc.wait(10)
        self._http.close()
        return rc

    @property
    def run_dir(self) -> Path:
        """The learner's run folder (`<state_dir>/learner/<run_id>`). FileNotFoundError before one."""
        return RunDir.of_up(self.state_dir).path

    def log(self) -> str:
        """up's output so far (every service's lines, prefixed by its name)."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def export(self, out: str | Path, version: int | str = "latest", force: bool = False) -> Path:
        """Write a policy version of the run (default: the last) as a Hugging Face model folder
        `out` (steadyrl.run.export.export_version); returns `out`."""
        from steadyrl.run.export import export_version  # lazy: torch and transformers

        return export_version(self.run_dir, version, out, policy_root=self.state_dir / "policies", force=force)

    def __enter__(self) -> Run:
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()


def up(config: str | Path | None = None, state_dir: str | Path = ".steadyrl", **kwargs: Any) -> Run:
    """Start a run (`Run(config, state_dir, **kwargs).start()`); see `Run` for the arguments."""
    return Run(config, state_dir, **kwargs).start()

"""`steadyrl up` as a harness: its children found through /proc, their HTTP endpoints, its
prefixed log, and `Pipeline` (a broker of its own plus `up --bootstrap` on it), which the
chaos and recovery benches drive."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from steadyrl.cli import SERVICE_PORTS
from steadyrl.local.broker import LocalBroker
from steadyrl.local.jars import fetch
from steadyrl.run.runview import Metrics, parse_metrics  # here too: the harness's names
from steadyrl.testing.procs import REPO
from steadyrl.testing.run import RunDir

#: The kinds of service `steadyrl up` runs; an instance is `<kind>-<i>`.
KINDS = ("reward-server", "actor", "rollout", "reward", "learner")

def kind_of(instance: str) -> str:
    """`rollout-1` -> `rollout`."""
    return instance.rsplit("-", 1)[0]


def proc_start_epoch(pid: int) -> float | None:
    """Wall-clock start time of a process (from /proc, 10 ms resolution); None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                     if line.startswith("btime "))
        return btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError, StopIteration):
        return None


def alive(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def up_child_pid(up_pid: int, instance: str) -> int | None:
    """PID of the live (not zombie) child of `up_pid` started with `--instance-id instance`."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[1]) != up_pid or stat[0] == "Z":
                continue
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if b"--instance-id" in cmd and cmd[cmd.index(b"--instance-id") + 1] == instance.encode():
            return int(d.name)
    return None


def log_records(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(instance, record) of every JSON log line in up's prefixed output (`name | {json}`), in
    order; other lines (plain text, a line cut short) are skipped."""
    out = []
    for line in text.splitlines():
        name, sep, rest = line.partition(" | ")
        if not sep or not rest.startswith("{"):
            continue
        try:
            out.append((name.strip(), json.loads(rest)))
        except ValueError:
            continue
    return out


def log_lines(log_path: Path, instance: str, since: float) -> list[dict[str, Any]]:
    """JSON log records of `instance` in up's prefixed output (`name | {json}`) with ts >= since."""
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return []
    return [rec for name, rec in log_records(text) if name == instance and rec.get("ts", 0) >= since]


class Pipeline:
    """Our broker plus `steadyrl up --bootstrap` on it (in its own process group).

    Args:
        state_dir: broker data (`broker/`), up's state (policies/, learner/), logs.
        port: broker port (KRaft controller on port + 1).
        port_offset: added to every service port (as `up --port-offset`).
        config: YAML passed to every service.
        scale: {"rollout": n, "reward": m}.
    """

    def __init__(self, state_dir: Path, port: int, port_offset: int, config: Path, scale: dict[str, int]):
        self.state_dir, self.port_offset, self.config, self.scale = state_dir, port_offset, config, scale
        self.broker = LocalBroker(state_dir / "broker", port=port, controller_port=port + 1)
        self.log_path = state_dir / "up.log"
        self.up: subprocess.Popen[bytes] | None = None
        self.http = httpx.Client(timeout=2.0)
        self.instances = [f"{k}-{i}" for k in KINDS for i in range(scale.get(k, 1))]

    @property
    def bootstrap(self) -> str:
        """The broker's bootstrap address."""
        return self.broker.bootstrap

    def run(self) -> RunDir:
        """The learner's run (CURRENT under `state_dir/learner`)."""
        return RunDir.of_up(self.state_dir)

    def start(self) -> None:
        """Start the broker, then `up` (returns at once; `running()` says whether up still runs)."""
        fetch()
        self.broker.start()
        scale = [a for k, n in self.scale.items() for a in ("--scale", f"{k}={n}")]
        with open(self.log_path, "ab") as log:
            self.up = subprocess.Popen(
                [sys.executable, "-m", "steadyrl.cli", "up", "--bootstrap", self.bootstrap,
                 "--state-dir", str(self.state_dir), "--port-offset", str(self.port_offset),
                 "--config", str(self.config), *scale],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def running(self) -> bool:
        """Whether `up` was started and has not exited."""
        return self.up is not None and self.up.poll() is None

    def url(self, instance: str) -> str:
        """http://127.0.0.1:<port> of an instance, as `up` assigns ports."""
        kind, i = instance.rsplit("-", 1)
        return f"http://127.0.0.1:{SERVICE_PORTS[kind] + self.port_offset + int(i)}"

    def pid(self, instance: str) -> int | None:
        """PID of `up`'s child running `--instance-id instance`, if any."""
        return None if self.up is None else up_child_pid(self.up.pid, instance)

    def get(self, instance: str, path: str) -> httpx.Response | None:
        """GET `path` of an instance; None when it does not answer."""
        try:
            return self.http.get(f"{self.url(instance)}{path}")
        except httpx.HTTPError:
            return None

    def progress(self) -> dict[str, Any]:
        """The learner's /progress ({} when it does not answer)."""
        r = self.get("learner-0", "/progress")
        try:
            return r.json() if r is not None and r.status_code == 200 else {}
        except ValueError:
            return {}

    def metrics(self, instance: str) -> Metrics:
        """An instance's /metrics as `parse_metrics` gives them ({} when it does not answer)."""
        r = self.get(instance, "/metrics")
        return parse_metrics(r.text) if r is not None and r.status_code == 200 else {}

    def ready(self, instance: str) -> bool:
        """Whether an instance's /readyz answers 200."""
        r = self.get(instance, "/readyz")
        return r is not None and r.status_code == 200

    def restart_broker(self, sig: str, down_s: float) -> dict[str, Any]:
        """Stop the broker (SIGKILL, or SIGTERM = a clean shutdown) and start it again on the
        same state dir and port. Returns its timings."""
        pid = self.broker.pid()
        t0 = time.time()
        if sig == "kill":
            self.broker.kill()
        else:
            self.broker.stop()
        t_down = time.time()
        time.sleep(down_s)
        t_start = time.time()
        self.broker.start(timeout_s=120)
        t_up = time.time()
        return {"signal": sig, "pid": pid, "t": t0, "stop_s": round(t_down - t0, 2),
                "down_s": round(t_up - t0, 2), "start_s": round(t_up - t_start, 2), "new_pid": self.broker.pid()}

    def log_lines(self, instance: str, since: float) -> list[dict[str, Any]]:
        """JSON log records of `instance` in up's output with ts >= since."""
        return log_lines(self.log_path, instance, since)

    def stop(self, timeout_s: float = 30) -> int | None:
        """Stop `up` (SIGTERM: it stops its children), then the broker. Returns up's status."""
        rc = None
        if self.up is not None:
            if self.up.poll() is None:
                self.up.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.up.wait(timeout_s)
            rc = self.up.poll()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.up.pid, signal.SIGKILL)  # anything of its group left behind
            if rc is None:
                rc = self.up.wait(10)
        self.broker.stop()
        self.http.close()
        return rc

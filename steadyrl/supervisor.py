"""`steadyrl up`: broker, topics and every service as its own process, kept running.

Each service instance is a child process with a stable instance id (`reward-0`, ...), so
a restarted transactional worker fences its crashed predecessor at once. A child that
exits unexpectedly is restarted with exponential backoff (1 s doubling to 30 s; reset
after 60 s of healthy running). Output lines are prefixed with the instance name, and kept
whole in `<log_dir>/<instance>.log` (`steadyrl logs <instance>`).
A child marked `final` (the learner) that exits with status 0 and `is_done()` has finished
its work: the whole stack stops (exit 0 without `is_done()` is a stop from outside: it is
restarted). A child that exits with status 2 (configuration error) would fail the same way
again: the stack stops and `failed` names it. SIGINT/SIGTERM stop the children (SIGTERM, then
SIGKILL after a grace period) and then
the broker, if this command started it.

Why our own ~100 lines and not supervisord/circus/honcho: honcho stops everything when
one process exits (no restarts); supervisord and circus are daemons driven by their own
config files and control sockets, which would be a second configuration system beside the
typed service configs. See docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TextIO

import httpx

from steadyrl.broker import BrokerError, ForeignBroker, LocalBroker


@dataclass
class Child:
    """One supervised service instance."""

    name: str
    argv: list[str]
    port: int
    proc: subprocess.Popen[bytes] | None = None
    final: bool = False      # exit status 0 means "done": stop the whole stack
    env: dict[str, str] = field(default_factory=dict)   # added to the environment (placement's threads)
    cpus: frozenset[int] | None = None                   # CPU affinity, set before exec (None: any)
    restarts: int = 0
    backoff_s: float = 1.0
    started_at: float = 0.0
    next_start: float = 0.0
    threads: list[threading.Thread] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _pump(prefix: str, stream: IO[bytes], out: TextIO, log: Path | None = None) -> None:
    """Copy a child's output lines to `out`, prefixed, and whole to the file `log` (appended).
    A line redrawn with carriage returns (a progress bar) shows on `out` as its last state."""
    with open(log, "ab") if log is not None else contextlib.nullcontext() as f:
        for line in iter(stream.readline, b""):
            if f is not None:
                f.write(line if line.endswith(b"\n") else line + b"\n")
                f.flush()
            text = line.decode(errors="replace").rstrip()
            shown = next((part for part in reversed(text.split("\r")) if part.strip()), "")
            out.write(f"{prefix} | {shown}\n")
            out.flush()
    stream.close()


class Supervisor:
    """Starts, watches and stops child processes.

    Args:
        children: what to run.
        grace_s: SIGTERM-to-SIGKILL grace period when stopping.
    """

    def __init__(self, children: list[Child], grace_s: float = 20.0, out: TextIO = sys.stdout,
                 is_done: Callable[[], bool] = lambda: True, log_dir: Path | None = None) -> None:
        self.children = children
        self.log_dir = log_dir   # each child's output also goes, whole, to <log_dir>/<name>.log
        self.is_done = is_done
        self.grace_s = grace_s
        self.out = out
        self.stop = threading.Event()
        self.finished: str | None = None   # name of the `final` child that exited 0
        self.failed: str | None = None     # name of a child that exited 2 (bad configuration)
        width = max(len(c.name) for c in children) if children else 0
        self._prefix = {c.name: c.name.ljust(width) for c in children}

    def _start(self, c: Child) -> None:
        cpus = c.cpus
        c.proc = subprocess.Popen(c.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1", **c.env},
                                  preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
        c.started_at = time.monotonic()
        log = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log = self.log_dir / f"{c.name}.log"
        c.threads = [threading.Thread(target=_pump, args=(self._prefix[c.name], s, self.out, log), daemon=True)
                     for s in (c.proc.stdout, c.proc.stderr)]
        for t in c.threads:
            t.start()

    def start_all(self) -> None:
        for c in self.children:
            self._start(c)

    def wait_ready(self, timeout_s: float = 120.0) -> dict[str, bool]:
        """Poll each child's /readyz until 200 or timeout; returns name -> ready."""
        ready = {c.name: False for c in self.children}
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as http:
            while not all(ready.values()) and time.monotonic() < deadline and not self.stop.is_set():
                for c in self.children:
                    if not ready[c.name]:
                        with contextlib.suppress(httpx.HTTPError):
                            ready[c.name] = http.get(f"{c.url}/readyz").status_code == 200
                self.watch_once()
                time.sleep(0.5)
        return ready

    def watch_once(self) -> None:
        """Restart children that died, after their backoff."""
        now = time.monotonic()
        for c in self.children:
            if c.proc is None:
                if now >= c.next_start:
                    self._start(c)
                continue
            rc = c.proc.poll()
            if rc is None:
                if now - c.started_at > 60:
                    c.backoff_s = 1.0
                continue
            if rc == 0 and c.final and self.is_done():
                self.finished = c.name
                self.stop.set()
                return
            if rc == 2:
                self.failed = c.name
                self.stop.set()
                return
            c.restarts += 1
            self.out.write(f"{self._prefix[c.name]} | exited with {rc}; restart #{c.restarts} in {c.backoff_s:.0f}s\n")
            c.proc = None
            c.next_start = now + c.backoff_s
            c.backoff_s = min(c.backoff_s * 2, 30.0)

    def run_until_stopped(self, tick: Callable[[], None] | None = None) -> None:
        while not self.stop.is_set():
            self.watch_once()
            if tick is not None:
                tick()
            self.stop.wait(0.5)

    def stop_all(self) -> None:
        live = [c.proc for c in self.children if c.proc is not None and c.proc.poll() is None]
        for proc in live:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for proc in live:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for c in self.children:
            for t in c.threads:
                t.join(timeout=2)


def volume_of(path: str | os.PathLike[str]) -> str:
    """The mount point of the filesystem that holds `path` (its nearest existing folder): the
    name a full volume is reported by."""
    p = Path(path).resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return str(p)


class BrokerWatch:
    """Keeps `steadyrl up`'s own broker (a steadyrl.broker.LocalBroker it started) running, as
    the Supervisor keeps the services: `tick()`, called from up's loop, never blocks.

    - A broker that is gone (killed, crashed, or halted: Kafka halts its JVM when its only log
      folder fails, e.g. on a full disk) is reported in one line -- `broker | exited (code C,
      pid P): <why>; data folder D on volume V: N bytes free; restart #n in Bs` -- and started
      again on the same data after its backoff (1 s doubling to 30 s; reset after 60 s of
      healthy running), in a thread (start waits until metadata answers). A start that fails
      (the volume still full) is reported the same way and tried again after the next backoff,
      so the broker comes back by itself once space returns.
    - A data volume with less than `low_free_bytes` free is reported once per fall below it,
      by its mount point and free bytes (`broker | data folder D on volume V is nearly full: N
      bytes free`), before Kafka's writes fail.

    `restarts` counts the restarts begun. `close()` ends a restart under way (its wait for the
    broker to answer, within about 5 s) and returns; the caller stops the broker after it (its
    pid file names the JVM a restart spawned).
    """

    def __init__(self, broker: LocalBroker, out: TextIO = sys.stdout, check_s: float = 1.0,
                 ready_timeout_s: float = 120.0, low_free_bytes: int = 256 * 1024 * 1024) -> None:
        self.broker = broker
        self.out = out
        self.check_s = check_s
        self.ready_timeout_s = ready_timeout_s
        self.low_free_bytes = low_free_bytes
        self.restarts = 0
        self.backoff_s = 1.0
        self._next_check = 0.0
        self._next_start: float | None = None   # set while the broker is down
        self._up_since = time.monotonic()
        self._low = False
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()
        self._pid = broker.pid()

    def _say(self, text: str) -> None:
        self.out.write(f"broker | {text}\n")
        self.out.flush()

    def _space(self) -> tuple[str, int]:
        data = self.broker.data
        try:
            free = shutil.disk_usage(data).free
        except OSError:
            free = -1
        return f"data folder {data} on volume {volume_of(data)}: {free} bytes free", free

    def tick(self) -> None:
        now = time.monotonic()
        if (self._thread is not None and self._thread.is_alive()) or now < self._next_check:
            return
        self._next_check = now + self.check_s
        space, free = self._space()
        if 0 <= free < self.low_free_bytes:
            if not self._low:
                self._say(f"{space.replace(':', ' is nearly full:', 1)}")
            self._low = True
        else:
            self._low = False
        pid = self.broker.pid()
        if pid is not None:
            self._pid = pid
            if now - self._up_since > 60:
                self.backoff_s = 1.0
            return
        if self._next_start is None:   # just found down
            why = self.broker.failure() or "no reason in its log"
            self._next_start = now + self.backoff_s
            self._say(f"exited (code {self.broker.exit_code(wait_s=2.0)}, pid {self._pid}): {why}; {space}; "
                      f"restart #{self.restarts + 1} in {self.backoff_s:.0f}s")
            self.backoff_s = min(self.backoff_s * 2, 30.0)
        elif now >= self._next_start:
            self.restarts += 1
            self._thread = threading.Thread(target=self._restart, name="broker-restart", daemon=True)
            self._thread.start()

    def _restart(self) -> None:
        try:
            proc = self.broker.spawn()
            deadline = time.monotonic() + self.ready_timeout_s
            while True:   # in slices, so that close() need not wait the whole timeout
                try:
                    self.broker.wait_ready(min(5.0, max(0.1, deadline - time.monotonic())), proc)
                    break
                except ForeignBroker:
                    raise
                except BrokerError:
                    if self._closing.is_set() or proc.poll() is not None or time.monotonic() >= deadline:
                        raise
        except BrokerError as e:
            if self._closing.is_set():
                return   # up is stopping: it stops the broker itself
            self.broker.stop(grace_s=5.0)   # a JVM that came up without answering: ours, by its pid file
            space, _ = self._space()
            why = self.broker.failure() or str(e).splitlines()[0]
            self._next_start = time.monotonic() + self.backoff_s
            self._say(f"restart #{self.restarts} failed: {why}; {space}; next try in {self.backoff_s:.0f}s")
            self.backoff_s = min(self.backoff_s * 2, 30.0)
            return
        self._pid = proc.pid
        self._next_start = None
        self._up_since = time.monotonic()
        self._say(f"restarted (pid {proc.pid}, {self.broker.bootstrap}, restart #{self.restarts})")

    def close(self) -> None:
        self._closing.set()
        if self._thread is not None:
            self._thread.join(10.0)

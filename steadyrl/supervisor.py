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

Liveness (`Liveness`): a thread polls each child's `GET /livez` every `period_s` (10 s); a
child whose /livez fails `failures` polls in a row (6: not 200, or no answer within 5 s; a
refused connection -- nothing listens, the process is starting or stopping -- is not a poll) is
hung -- its main loop stopped beating (steadyrl/http.py) -- and is stopped (SIGTERM, SIGKILL
after the grace period) and restarted like a child that exited, counted in `restarts`, with a
line naming why (`liveness failed: ... /livez 503 {...}`). Not while a child is starting: it
is judged once its /readyz has answered 200 since its start, or `start_s` (600 s) after it,
whichever comes first (a model still loading does not beat). The defaults are the Kubernetes
manifests' (deploy/k8s: period 10 s, timeout 5 s, 6 failures).

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

from steadyrl.local.broker import ForeignBroker, LocalBroker
from steadyrl.local.jars import BrokerError
from steadyrl.output import LossyWriter, lossy


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
    # liveness (Supervisor's poll thread writes these, its loop reads them; reset at each start)
    ready_seen: bool = False                 # /readyz answered 200 since this start
    live_failures: int = 0                   # /livez polls failed in a row
    live_detail: str = ""                    # what the last failed poll got
    liveness_restarts: int = 0               # of `restarts`: those for a failed liveness
    stopping_since: float | None = None      # when up sent it SIGTERM for a failed liveness

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _pump(prefix: str, stream: IO[bytes], out: TextIO, log: Path | None = None) -> None:
    """Copy a child's output lines to `out`, prefixed, and whole to the file `log` (appended).
    A line redrawn with carriage returns (a progress bar) shows on `out` as its last state.
    A line that cannot be written (a full disk, a closed pipe) is dropped and counted, and said
    once writing works again (steadyrl.output.LossyWriter): the child's output is always read,
    so the child never blocks on a full pipe."""
    sink = lossy(out)
    file = LossyWriter(log, prefix="steadyrl up | ", note=" from this file") if log is not None else None
    try:
        for line in iter(stream.readline, b""):
            if file is not None:
                file.write_bytes(line if line.endswith(b"\n") else line + b"\n")
            text = line.decode(errors="replace").rstrip()
            shown = next((part for part in reversed(text.split("\r")) if part.strip()), "")
            sink.write(f"{prefix} | {shown}\n")
            sink.flush()
    finally:
        if file is not None:
            file.close()
        stream.close()


@dataclass(frozen=True)
class Liveness:
    """How the Supervisor judges each child's `/livez` (see the module doc).

    Args:
        period_s: seconds between two polls of one child.
        failures: polls failed in a row that make a child hung (restarted); 0: no polls.
        start_s: a child not yet ready is judged this many seconds after its start.
        timeout_s: a poll not answered within this many seconds has failed.
    """

    period_s: float = 10.0
    failures: int = 6
    start_s: float = 600.0
    timeout_s: float = 5.0

    def describe(self) -> str:
        if self.failures <= 0:
            return "liveness: not watched (--liveness-failures 0)"
        return (f"liveness: each service's /livez every {self.period_s:g} s; {self.failures} failed in a row "
                f"restart it (judged once it is ready, or {self.start_s:g} s after its start)")


class Supervisor:
    """Starts, watches and stops child processes.

    Args:
        children: what to run.
        grace_s: SIGTERM-to-SIGKILL grace period when stopping.
        out: where the children's lines and the supervisor's own go (None: sys.stdout);
            a line that cannot be written there is dropped and counted (steadyrl.output).
        liveness: how /livez is watched (None: Liveness()'s defaults).
    """

    def __init__(self, children: list[Child], grace_s: float = 20.0, out: TextIO | None = None,
                 is_done: Callable[[], bool] = lambda: True, log_dir: Path | None = None,
                 liveness: Liveness | None = None) -> None:
        self.children = children
        self.log_dir = log_dir   # each child's output also goes, whole, to <log_dir>/<name>.log
        self.is_done = is_done
        self.grace_s = grace_s
        self.out = lossy(out if out is not None else sys.stdout)
        self.liveness = liveness if liveness is not None else Liveness()
        self._lock = threading.Lock()   # a child's liveness fields: the poll thread and the loop
        self._poller: threading.Thread | None = None
        self.stop = threading.Event()
        self.finished: str | None = None   # name of the `final` child that exited 0
        self.failed: str | None = None     # name of a child that exited 2 (bad configuration)
        width = max(len(c.name) for c in children) if children else 0
        self._prefix = {c.name: c.name.ljust(width) for c in children}

    def _start(self, c: Child) -> None:
        cpus = c.cpus
        with self._lock:   # before the new process is c.proc: no poll of the old one counts for it
            c.ready_seen, c.live_failures, c.live_detail, c.stopping_since = False, 0, "", None
            c.started_at = time.monotonic()
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
        if self.liveness.failures > 0 and self._poller is None:
            self._poller = threading.Thread(target=self._poll_liveness, name="liveness", daemon=True)
            self._poller.start()

    # ---- liveness --------------------------------------------------------------------------
    def _poll_liveness(self) -> None:
        """The poll thread: every period_s, each running child's /livez (once it is judged)."""
        lv = self.liveness
        with httpx.Client(timeout=lv.timeout_s) as http:
            while not self.stop.wait(lv.period_s):
                for c in self.children:
                    if self.stop.is_set():
                        return
                    self._probe(c, http)

    def _probe(self, c: Child, http: httpx.Client) -> None:
        """One poll of `c`: its /readyz until it was ready once (and not judged before that,
        for start_s), then its /livez; the counts go to `c` if it is still the same process."""
        proc = c.proc
        if proc is None or proc.poll() is not None or c.stopping_since is not None:
            return
        if not c.ready_seen:
            ready = False
            with contextlib.suppress(httpx.HTTPError):
                ready = http.get(f"{c.url}/readyz").status_code == 200
            with self._lock:
                if c.proc is proc and ready:
                    c.ready_seen = True
            if not ready and time.monotonic() - c.started_at < self.liveness.start_s:
                return   # still starting
        try:
            r = http.get(f"{c.url}/livez")
            ok, detail = r.status_code == 200, f"/livez {r.status_code} {r.text.strip()[:300]}"
        except httpx.TimeoutException:
            ok, detail = False, f"/livez did not answer within {self.liveness.timeout_s:g} s"
        except httpx.ConnectError:
            return   # nothing listens: it is starting or stopping (its exit is watched), not hung
        except httpx.HTTPError as e:
            ok, detail = False, f"/livez: {type(e).__name__}: {e}"
        with self._lock:
            if c.proc is not proc or c.stopping_since is not None:
                return   # restarted (or being stopped) meanwhile: not this process's poll
            c.live_failures = 0 if ok else c.live_failures + 1
            if not ok:
                c.live_detail = detail

    def _check_liveness(self, c: Child, now: float) -> None:
        """From the loop: stop a running child whose liveness failed (SIGTERM; SIGKILL after
        grace_s); its exit is then restarted by watch_once."""
        assert c.proc is not None
        if c.stopping_since is not None:
            if now - c.stopping_since > self.grace_s:
                with contextlib.suppress(OSError):
                    c.proc.kill()
            return
        lv = self.liveness
        with self._lock:
            failed = lv.failures > 0 and c.live_failures >= lv.failures
            if failed:
                c.stopping_since = now
        if not failed:
            return
        self.out.write(f"{self._prefix[c.name]} | liveness failed: {c.live_failures} polls in a row over "
                       f"{c.live_failures * lv.period_s:.0f} s, the last: {c.live_detail}; stopping it (SIGTERM, "
                       f"SIGKILL after {self.grace_s:.0f} s) to restart it\n")
        self.out.flush()
        with contextlib.suppress(OSError):
            c.proc.send_signal(signal.SIGTERM)

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
                        if ready[c.name]:
                            with self._lock:
                                c.ready_seen = True
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
                if now - c.started_at > 60 and c.stopping_since is None:
                    c.backoff_s = 1.0
                self._check_liveness(c, now)
                continue
            if rc == 0 and c.final and self.is_done():
                self.finished = c.name
                self.stop.set()
                return
            hung = c.stopping_since is not None   # stopped by us: restarted whatever its status
            if rc == 2 and not hung:
                self.failed = c.name
                self.stop.set()
                return
            c.restarts += 1
            c.liveness_restarts += hung
            why = " (stopped: liveness failed)" if hung else ""
            self.out.write(f"{self._prefix[c.name]} | exited with {rc}{why}; restart #{c.restarts} in "
                           f"{c.backoff_s:.0f}s\n")
            self.out.flush()
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
        self.stop.set()   # and the liveness polls with it
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
        if self._poller is not None:
            self._poller.join(timeout=self.liveness.timeout_s + 1)


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
    """Keeps `steadyrl up`'s own broker (a steadyrl.local.broker.LocalBroker it started) running, as
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

    def __init__(self, broker: LocalBroker, out: TextIO | None = None, check_s: float = 1.0,
                 ready_timeout_s: float = 120.0, low_free_bytes: int = 256 * 1024 * 1024) -> None:
        self.broker = broker
        self.out = lossy(out if out is not None else sys.stdout)   # a line it cannot write: dropped, counted
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

"""Free space as a resource: the gauge of each volume a service writes, the retry of a write the
disk refused for lack of space, the room a run needs at start, and the cleaning of temporaries.

    watch("policy_root", path)        steadyrl_disk_free_bytes / _size_bytes{volume, path}, at scrape
    retry(fn, "policy", path)         fn() again with backoff while it raises ENOSPC/EDQUOT
    readiness()                       /readyz's `disk` check: not ready while a writer waits
    refuse_small(needs)               ConfigError (exit 2) naming the folder that cannot hold a run
    clean_temporaries(folder)         this process's and dead processes' `*.tmp-<pid>`, `*.old-<pid>`

A writer that meets a full disk keeps what it had (the last good version, checkpoint, state:
every writer writes a temporary, fsyncs it and its folder, and renames it into place, so a
failed write leaves the old file whole, and the temporary is removed at once to give the space
back), counts it (`steadyrl_disk_full_writes_total{writer}`), logs it once per wait and once
when the write went through, and waits with exponential backoff (tenacity; 0.5 s doubling to
`max_wait_s`), calling the liveness heartbeat meanwhile: the process is alive, not ready.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from prometheus_client import Counter, Gauge
from tenacity import RetryCallState, Retrying, retry_if_exception, wait_exponential

from steadyrl.config import ConfigError
from steadyrl.local.ports import pid_alive

log = logging.getLogger(__name__)
T = TypeVar("T")

#: errors that mean "no space": the filesystem is full, or the user's quota is
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})

FREE = Gauge("steadyrl_disk_free_bytes", "Bytes free for this process on the volume of a folder the service "
                                          "writes (statvfs f_bavail; computed at scrape)", ["volume", "path"])
SIZE = Gauge("steadyrl_disk_size_bytes", "Size in bytes of the volume of a folder the service writes "
                                          "(statvfs f_blocks; computed at scrape)", ["volume", "path"])
FULL_WRITES = Counter("steadyrl_disk_full_writes", "Writes the disk refused for lack of space "
                                                         "(ENOSPC, EDQUOT), each retried, by writer", ["writer"])
WAITING = Gauge("steadyrl_disk_full_waiting", "1 while the writer waits for space to write again, else 0",
                ["writer"])

#: a write temporary of one process: `step_000005.tmp-<pid>` (checkpoints), `.v000007.tmp-<pid>` and
#: `.v000007.old-<pid>` (policy versions), `.<name>.tmp-<pid>` (files.write_atomic)
TEMPORARY = re.compile(r"^(?:step_\d+|\.v\d+|\..+)\.(?:tmp|old)-(\d+)$")

_waits: dict[str, tuple[float, str]] = {}   # writer -> (monotonic since, what it waits to write)
_lock = threading.Lock()
_beat: Callable[[], None] = lambda: None


def set_beat(beat: Callable[[], None]) -> None:
    """The liveness heartbeat `retry` calls while it waits (the service's Health.beat)."""
    global _beat
    _beat = beat


def is_no_space(e: BaseException) -> bool:
    """True when `e` is an OSError for lack of space (ENOSPC, EDQUOT)."""
    return isinstance(e, OSError) and e.errno in NO_SPACE


def _existing(path: Path) -> Path:
    """`path`, or its nearest existing ancestor (the volume it will be on)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def usage(path: Path) -> tuple[int, int]:
    """(free bytes for this process, volume size in bytes) of the volume `path` is or will be on."""
    st = os.statvfs(_existing(path))
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def watch(volume: str, path: Path) -> None:
    """Export the free bytes and the size of `path`'s volume, read at each scrape, labelled
    {volume: the setting that names the folder, path}. NaN while it cannot be read."""
    def read(i: int) -> float:
        try:
            return float(usage(path)[i])
        except OSError:
            return float("nan")

    FREE.labels(volume, str(path)).set_function(lambda: read(0))
    SIZE.labels(volume, str(path)).set_function(lambda: read(1))


def readiness() -> tuple[bool, str]:
    """/readyz's `disk` check: not ready while any writer waits for space (naming it, what it
    writes and for how long), ready otherwise."""
    with _lock:
        waits = dict(_waits)
    if not waits:
        return True, "no write waits for space"
    now = time.monotonic()
    return False, "; ".join(f"{w} waits for space since {now - t:.0f} s to write {p}"
                            for w, (t, p) in sorted(waits.items()))


def _sleeper(beat: Callable[[], None] | None, stop: threading.Event | None) -> Callable[[float], None]:
    def sleep(seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if stop is not None and stop.wait(min(left, 1.0)):
                return
            if stop is None:
                time.sleep(min(left, 1.0))
            (beat or _beat)()
    return sleep


def retry(fn: Callable[[], T], writer: str, path: Path | str, *, beat: Callable[[], None] | None = None,
          stop: threading.Event | None = None, max_wait_s: float = 30.0,
          sleep: Callable[[float], None] | None = None) -> T:
    """`fn()`, called again while it raises OSError for lack of space (is_no_space), with
    exponential backoff from 0.5 s doubling up to `max_wait_s`, forever unless `stop` is set
    (then the last error is raised). `fn` must leave what it writes whole when it fails (a
    temporary renamed into place, removed on failure). Each refusal counts in
    steadyrl_disk_full_writes_total{writer}; steadyrl_disk_full_waiting{writer} is 1 and
    readiness() not ready while it waits; the first refusal and the success after it are
    logged (warning, info) with `path`. `beat` (default: set_beat's) is called about every
    second of waiting; `sleep` replaces the wait (tests). Any other error is raised at once."""
    failed = [0]

    def before_sleep(rs: RetryCallState) -> None:
        err = rs.outcome.exception() if rs.outcome is not None else None
        FULL_WRITES.labels(writer).inc()
        if not failed[0]:
            log.warning("no space left to write: keeping the last good copy and retrying until space returns",
                        extra={"writer": writer, "path": str(path), "error": str(err),
                               "free_bytes": _free_or_none(path)})
            with _lock:
                _waits[writer] = (time.monotonic(), str(path))
            WAITING.labels(writer).set(1)
        failed[0] += 1

    retrying = Retrying(retry=retry_if_exception(is_no_space), reraise=True, before_sleep=before_sleep,
                        wait=wait_exponential(multiplier=0.5, min=0.5, max=max_wait_s),
                        stop=lambda rs: stop is not None and stop.is_set(),
                        sleep=sleep or _sleeper(beat, stop))
    try:
        result = retrying(fn)
    finally:
        if failed[0]:
            with _lock:
                since = _waits.pop(writer, (time.monotonic(), ""))[0]
            WAITING.labels(writer).set(0)
            log.info("space returned: write went through" if not (stop is not None and stop.is_set())
                     else "stopped while waiting for space", extra={
                         "writer": writer, "path": str(path), "refusals": failed[0],
                         "waited_s": round(time.monotonic() - since, 1)})
    return result


def _free_or_none(path: Path | str) -> int | None:
    try:
        return usage(Path(path))[0]
    except OSError:
        return None


def clean_temporaries(folder: Path) -> list[Path]:
    """Remove the write temporaries directly in `folder` (TEMPORARY: `step_*.tmp-<pid>`,
    `.vNNNNNN.tmp-<pid>`, `.vNNNNNN.old-<pid>`, `.<name>.tmp-<pid>`) left by this process's pid
    or by a pid that is not alive; call it at start, before the process writes there (this
    pid's are then a dead process's that had the same pid: a restarted container). A live
    process's are left alone. Returns what was removed (logged); a missing folder is none."""
    gone: list[Path] = []
    try:
        entries = list(Path(folder).iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return gone
    for p in entries:
        m = TEMPORARY.match(p.name)
        if m is None:
            continue
        pid = int(m.group(1))
        if pid != os.getpid() and pid_alive(pid):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        gone.append(p)
    if gone:
        log.info("removed write temporaries of ended processes", extra={
            "folder": str(folder), "removed": sorted(p.name for p in gone)})
    return gone


def refuse_small(needs: list[tuple[str, Path, int, int]]) -> None:
    """Refuse a run its volumes cannot hold: `needs` is (setting, folder, bytes the run needs
    there, bytes already held there that the run will replace). Folders on the same volume
    add up; raises steadyrl.config.ConfigError (exit 2) naming each folder of a volume where
    free + held < needed, with the figures."""
    volumes: dict[int, list[tuple[str, Path, int, int]]] = {}
    for need in needs:
        volumes.setdefault(os.stat(_existing(need[1])).st_dev, []).append(need)
    for group in volumes.values():
        want, held = sum(n[2] for n in group), sum(n[3] for n in group)
        free = usage(group[0][1])[0]
        if free + held < want:
            names = ", ".join(f"{s} {p} ({n / 2**20:.1f} MiB)" for s, p, n, _ in group)
            raise ConfigError(f"not enough disk space for this run: {names} need {want / 2**20:.1f} MiB on one "
                              f"volume (two checkpoints and two policy versions), {free / 2**20:.1f} MiB free"
                              + (f" + {held / 2**20:.1f} MiB the run already holds" if held else "")
                              + ": free space or point the setting at a larger volume")


def tree_bytes(path: Path) -> int:
    """Bytes of the files under `path` (0 when it does not exist)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, f)).st_size
    return total


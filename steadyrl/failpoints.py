"""Failpoints: named places where a test or `bench/chaos` can crash a process on purpose.

A crash at a chosen instant (half-way through a checkpoint save, say) cannot be hit by
timing a `kill -9` from outside. Set

    STEADYRL_FAILPOINT=<name>:<marker file>

and the first process to reach `hit(name)` creates the marker file and SIGKILLs itself;
later hits (a restarted process, the same environment) find the marker and go on. Unset,
`hit` is one dictionary lookup. Names in use: `checkpoint.mid_write` (weights written,
optimizer not yet, folder still `.tmp-*`).
"""

from __future__ import annotations

import os
import signal


def hit(name: str) -> None:
    """SIGKILL this process if STEADYRL_FAILPOINT arms `name` and its marker does not exist yet."""
    spec = os.environ.get("STEADYRL_FAILPOINT")
    if not spec:
        return
    armed, _, marker = spec.partition(":")
    if armed != name or not marker:
        return
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.write(fd, f"{name} pid {os.getpid()}\n".encode())
    os.fsync(fd)
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)

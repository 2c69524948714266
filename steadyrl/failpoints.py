"""Failpoints: named places where a test or `bench/chaos` can crash a process on purpose.

A crash at a chosen instant (half-way through a checkpoint save, say) cannot be hit by
timing a `kill -9` from outside. Set

    STEADYRL_FAILPOINT=<name>:<marker file>

and the first process to reach `hit(name)` creates the marker file and SIGKILLs itself, or, at
`hang(name)`, the calling thread sleeps for good (a hung user function: signals are handled,
nothing returns); later hits (a restarted process, the same environment) find the marker and
go on. Unset, either is one dictionary lookup. Names in use: `checkpoint.mid_write` (hit:
weights written, optimizer not yet, folder still `.tmp-*`), `learner.eval_hang` (hang: the
learner's evaluation, at its first progress).
"""

from __future__ import annotations

import os
import signal
import time


def _armed(name: str) -> bool:
    """Whether STEADYRL_FAILPOINT arms `name` and its marker did not exist (it does now)."""
    spec = os.environ.get("STEADYRL_FAILPOINT")
    if not spec:
        return False
    armed, _, marker = spec.partition(":")
    if armed != name or not marker:
        return False
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(fd, f"{name} pid {os.getpid()}\n".encode())
    os.fsync(fd)
    os.close(fd)
    return True


def hit(name: str) -> None:
    """SIGKILL this process if STEADYRL_FAILPOINT arms `name` and its marker does not exist yet."""
    if _armed(name):
        os.kill(os.getpid(), signal.SIGKILL)


def hang(name: str) -> None:
    """Never return if STEADYRL_FAILPOINT arms `name` and its marker does not exist yet."""
    if _armed(name):
        while True:
            time.sleep(3600)

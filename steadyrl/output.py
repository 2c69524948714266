"""Output that never stops the process writing it: `steadyrl up`'s own lines and the files it
keeps of each service's.

`steadyrl up > run.log` on a volume that fills, or `steadyrl up | head`, used to end `up` at
its next line (OSError: no space left on device; BrokenPipeError), and the run with it. A
`LossyWriter` writes whole lines straight to the file descriptor (no Python buffer holding a
line that failed) and, when a write fails for any reason, drops that line, counts it and goes
on; at its first write that works again it says first what was lost:

    up | 212 lines of output could not be written (No space left on device) from 14:03:11 for 41 s: dropped

(on a closed pipe nothing can be written again: the count stays in `dropped`). `guard_stdio()`
puts one over `sys.stdout` and `sys.stderr` for the duration of a command.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

#: A pending partial line longer than this is written without waiting for its newline.
MAX_PENDING = 64 * 1024


class LossyWriter(io.TextIOBase):
    """A line-buffered text stream whose failed writes are dropped and counted, never raised.

    Args:
        target: a text stream (written through its file descriptor when it has one, else
            through its `write`), or a file path (opened for appending at the first write, and
            again after a failure).
        prefix: starts the line that reports a loss (`"up | "`).
        note: ends that line (what the reader may do about it).

    Attributes:
        dropped: lines dropped in all. `losses`: spells of failed writes.
    """

    def __init__(self, target: TextIO | Path, prefix: str = "up | ", note: str = "") -> None:
        super().__init__()
        self.prefix, self.note = prefix, note
        self.dropped = 0
        self.losses = 0
        self._target = target
        self._fd: int | None = None
        self._own_fd = isinstance(target, Path)
        if not isinstance(target, Path):
            with contextlib.suppress(OSError, ValueError, AttributeError, io.UnsupportedOperation):
                target.flush()   # what it holds already goes first
            with contextlib.suppress(OSError, ValueError, AttributeError, io.UnsupportedOperation):
                self._fd = target.fileno()
        self._lock = threading.Lock()
        self._pending = bytearray()
        self._lost = 0                     # lines dropped since the last report
        self._lost_since: float | None = None
        self._lost_why = ""
        self._cut = False                  # a line was cut part-way: start the report on a new line

    # ---- io.TextIOBase ---------------------------------------------------------------------
    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._target, "encoding", None) or "utf-8"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        if isinstance(self._target, Path):
            return False
        try:
            return bool(self._target.isatty())
        except (OSError, ValueError, AttributeError):
            return False

    def fileno(self) -> int:
        if self._fd is None:
            raise io.UnsupportedOperation("fileno")
        return self._fd

    def write(self, s: str) -> int:
        self.write_bytes(s.encode(self.encoding, errors="replace"))
        return len(s)

    def flush(self) -> None:
        with self._lock:
            if self._pending:
                data, self._pending = bytes(self._pending), bytearray()
                self._emit(data)

    def close(self) -> None:
        self.flush()
        if self._own_fd and self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    # ---- bytes -----------------------------------------------------------------------------
    def write_bytes(self, data: bytes) -> None:
        """Append `data`; every whole line in what is pending is written now."""
        with self._lock:
            self._pending += data
            end = self._pending.rfind(b"\n")
            if end < 0 and len(self._pending) < MAX_PENDING:
                return
            cut = end + 1 if end >= 0 else len(self._pending)
            lines, self._pending = bytes(self._pending[:cut]), self._pending[cut:]
            self._emit(lines)

    def _raw(self, data: bytes) -> None:
        """Write all of `data` or raise (OSError, ValueError: a closed stream)."""
        if self._own_fd and self._fd is None:
            assert isinstance(self._target, Path)
            self._fd = os.open(self._target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if self._fd is None:
            stream = self._target
            assert not isinstance(stream, Path)
            stream.write(data.decode(self.encoding, errors="replace"))
            stream.flush()
            return
        view = memoryview(data)
        while view:
            try:
                n = os.write(self._fd, view)
            except OSError:
                if len(view) < len(data):
                    self._cut = True
                raise
            view = view[n:]

    def _emit(self, data: bytes) -> None:
        if self._lost:
            try:
                self._raw(self._report())
            except (OSError, ValueError) as e:
                self._lose(data, e)
                return
            self._lost, self._lost_since, self._cut = 0, None, False
        try:
            self._raw(data)
        except (OSError, ValueError) as e:
            self._lose(data, e)

    def _lose(self, data: bytes, e: BaseException) -> None:
        lines = max(1, data.count(b"\n"))
        self.dropped += lines
        if not self._lost:
            self.losses += 1
            self._lost_since = time.time()
            self._lost_why = (e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}")
        self._lost += lines
        if self._own_fd and self._fd is not None:   # a file of ours: open it again next time
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def _report(self) -> bytes:
        since = self._lost_since or time.time()
        at = time.strftime("%H:%M:%S", time.localtime(since))
        text = (("\n" if self._cut else "") + f"{self.prefix}{self._lost} line{'s' if self._lost != 1 else ''} of "
                f"output could not be written ({self._lost_why}) from {at} for {time.time() - since:.0f} s: "
                f"dropped{self.note}\n")
        return text.encode(self.encoding, errors="replace")


def lossy(out: TextIO, prefix: str = "up | ", note: str = "") -> LossyWriter:
    """`out` itself when it is a LossyWriter already, else one over it."""
    return out if isinstance(out, LossyWriter) else LossyWriter(out, prefix, note)


@contextlib.contextmanager
def guard_stdio(note: str = "") -> Iterator[tuple[LossyWriter, LossyWriter]]:
    """For the block, `sys.stdout` and `sys.stderr` are LossyWriters over them (`print` never
    raises on a full disk or a closed pipe); both are put back after."""
    before = sys.stdout, sys.stderr
    out, err = lossy(sys.stdout, note=note), lossy(sys.stderr, note=note)
    sys.stdout, sys.stderr = out, err
    try:
        yield out, err
    finally:
        out.flush()
        err.flush()
        sys.stdout, sys.stderr = before



"""File helpers shared by the services: checksums, atomic writes and per-step JSON-lines logs."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def sha256_files(paths: list[Path | str]) -> str:
    """Hex sha256 of the files' bytes back to back, read in 1 MiB chunks. Raises OSError if
    one cannot be read."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def sha256_file(path: Path | str) -> str:
    """Hex sha256 of one file. Raises OSError if it cannot be read."""
    return sha256_files([path])


@contextmanager
def replacing(path: Path, tmp: Path | None = None) -> Iterator[Path]:
    """A temporary (`tmp`, default `.<name>.tmp-<pid>` beside `path`) for the caller to write and fsync; when
    the block ends, it is renamed over `path` and the folder fsynced: readers see the old file
    or the new one, never half, and after a crash the new one once this returned. When the
    block raises (OSError: ENOSPC...) the temporary is removed, `path` is left as it was, and
    the error goes on (steadyrl.run.diskspace.retry retries it)."""
    tmp = tmp if tmp is not None else path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_atomic(path: Path, text: str) -> None:
    """`text` as the file `path`, written, fsynced and renamed into place (`replacing`)."""
    with replacing(path) as tmp, open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """fsync a folder: the renames and new entries in it survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_step_lines(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The rows of an append-only per-step JSON-lines log (the learner's consumed.jsonl and
    history.jsonl: each row has a "step"), in file order, and the file's line count ([], 0
    without the file). A line cut short by a crash mid-append is skipped: the learner saves
    the step's state after the line, so its step was never saved."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return [], 0
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows, len(lines)


def append_line(path: Path, row: dict[str, Any]) -> None:
    """Append `row` as one JSON line to `path`, fsynced (a record a person or an audit reads)."""
    append_lines(path, [json.dumps(row)])


def append_lines(path: Path, lines: list[str], fsync: bool = True) -> None:
    """Append `lines` (each without its newline) to `path` in one write, fsynced unless told
    not to. All or nothing: when the disk refuses part way (OSError: ENOSPC...), the file is
    cut back to its size before the call and the error raised, so a retry never leaves a
    half line in front of the whole one."""
    data = "".join(line + "\n" for line in lines).encode()
    with open(path, "ab", buffering=0) as f:
        start = f.seek(0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[f.write(view) or 0:]
            if fsync:
                os.fsync(f.fileno())
        except BaseException:
            f.truncate(start)
            raise

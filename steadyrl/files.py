"""File helpers shared by the services: checksums and atomic writes."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


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


def write_atomic(path: Path, text: str) -> None:
    """Write, fsync, rename: readers see the old file or the new one, never half."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)

"""A small filesystem of a test's own: a tmpfs mounted on a folder (root only), to fill to the brim."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_fs(path: Path, size: str):
    """Mount a tmpfs of `size` (mount's syntax: "2m") on `path` for the block; skips the test
    with the reason when mounting is not permitted (not root, no CAP_SYS_ADMIN)."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (uid {os.getuid()}): {done.stderr.strip() or done.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path, leave: int = 0) -> Path:
    """Fill `path`'s filesystem with one file until `leave` bytes are free (0: to the brim);
    returns the file (delete it to free the space)."""
    ballast = path / "ballast"
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    with open(ballast, "ab", buffering=0) as f:
        chunk = b"\0" * (1 << 20)
        want = max(free - leave, 0)
        while want > 0:
            try:
                want -= f.write(chunk[:want]) or 0
            except OSError:
                break
    return ballast

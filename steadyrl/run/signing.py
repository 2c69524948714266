"""HMAC signing of a checkpoint's manifest (`manifest.sig`): a key file kept off the
checkpoint volume (`read_key`), `sign` for a trusted folder, `check_signature` for `verify`.
The manifest hashes every other file, so the signature covers the whole folder."""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from steadyrl.files import write_atomic
from steadyrl.run.tensors import CheckpointError

SIGNATURE = "manifest.sig"   # "hmac-sha256 <hex of HMAC-SHA256(key, manifest.json's bytes)>"
MIN_KEY_BYTES = 32


def read_key(path: Path) -> bytes:
    """The signing key held in `path` (surrounding whitespace dropped). Raises CheckpointError
    naming the file when it cannot be read or holds fewer than MIN_KEY_BYTES bytes (e.g. make
    one with `openssl rand -hex 32 > FILE`)."""
    try:
        key = Path(path).read_bytes().strip()
    except OSError as e:
        raise CheckpointError(f"checkpoint key file {path}: cannot read it: {e.strerror}") from None
    if len(key) < MIN_KEY_BYTES:
        raise CheckpointError(f"checkpoint key file {path}: {len(key)} bytes, at least {MIN_KEY_BYTES} needed "
                              "(openssl rand -hex 32)")
    return key


def signature(key: bytes, manifest: bytes) -> str:
    return "hmac-sha256 " + hmac.new(key, manifest, hashlib.sha256).hexdigest()


def sign(path: Path, key: bytes) -> None:
    """Sign the checkpoint folder `path` (its manifest.json as it is) with `key`: writes
    manifest.sig atomically. For a checkpoint you trust that was written without the key
    (`steadyrl ckpt sign`); the learner signs what it writes itself."""
    write_atomic(path / SIGNATURE, signature(key, (path / "manifest.json").read_bytes()) + "\n")


def check_signature(path: Path, manifest: bytes, key: bytes) -> None:
    sig = path / SIGNATURE
    if not sig.is_file():
        raise CheckpointError(f"{path}: not signed (no {SIGNATURE}) and a checkpoint key is configured: a "
                              "checkpoint written without the key is refused (if you trust it: steadyrl ckpt sign "
                              f"{path} --key-file KEY)")
    if not hmac.compare_digest(sig.read_bytes().strip(), signature(key, manifest).encode()):
        raise CheckpointError(f"{path}: {SIGNATURE} does not match manifest.json under the configured key "
                              "(signed with another key, or the manifest was changed after signing)")

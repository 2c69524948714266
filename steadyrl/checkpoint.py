"""Layered, verified learner checkpoints.

Layout (one folder per step, `LATEST` names the newest complete one):

    <dir>/step_000500/
      model/model.safetensors        weights
      optimizer/optimizer.safetensors  optimizer state tensors (AdamW moments, steps)
      meta.json                      global_step, RNG states, learner state, and the optimizer's
                                     param groups and LR-scheduler state (JSON)
      manifest.json                  format version, step, config, every file's size and sha256
    <dir>/LATEST                     written last, atomically

A learner sharded over N ranks (`train.sharding: fsdp`) writes format 3: in place of `model/`
and `optimizer/`, `shards/` holds the same two tables (`model.<name>`, `optimizer.state.<i>.<k>`)
as a `torch.distributed.checkpoint` folder (`.metadata` and one `__<rank>_0.distcp` per rank,
each rank writing only its shards, at once); meta.json and manifest.json are rank 0's, and
the manifest lists and hashes every shard. `read` gives the whole tables of either format on
one process (DCP reassembles the shards), so a checkpoint of N ranks resumes on M.

A step is written into `step_000500.tmp-<pid>/`, every file fsynced, the folder renamed,
and only then `LATEST` replaced: a crash mid-save leaves at most a `.tmp-*` folder that is
never read (and is removed by the next save). `verify` checks everything `manifest.json`
promises and raises `CheckpointError` naming the mismatch (expected vs got).

`AsyncCheckpointer` takes a CPU snapshot on the caller's thread (the only part the step
loop waits for) and writes it in a background thread at a lower CPU priority (nice +10);
at most one save is in flight. The same thread then verifies the folder as a resume would
(`verify`: every file re-read and re-hashed) and records the step (`last_verified_step`).
`write` refuses weights or optimizer tensors holding NaN or infinity (`NonFiniteWeights`).

Tensors are streamed into safetensors files by `write_safetensors` in 16 MiB chunks, each
hashed and written by calls that release the GIL, so the step loop's Python thread is not
held up (the library's `save_file`/`save` serialise under the GIL, which cost the step
loop most of a save's duration: measured in docs/benchmarks.md). Files are hashed as they
are written; `write` never reads them back (the verification after it does). Format 2
pickles nothing: the optimizer's tensors are safetensors and the rest is JSON. Format 3's
`shards/.metadata` is torch.distributed.checkpoint's, a pickle: it is read only through
`shard_metadata`'s allow-list (DCP's metadata classes, torch.Size, dtypes, layouts, a
PosixPath), so a pickle naming anything else is refused (CheckpointError naming it) without
running any of it, by `verify` and by `read`; the shards' tensors are read with
`torch.load(weights_only=True)` (DCP's reader).

Signing (`key`: the bytes of a key file kept off the checkpoint volume, `read_key`): a
checkpoint written with a key holds `manifest.sig`, the HMAC-SHA256 of manifest.json's
bytes ("hmac-sha256 <hex>"). The manifest hashes every other file, so the signature
covers the whole folder. `verify(path, key=...)` refuses a folder with no signature or
one that does not match (a checkpoint written without the key, or by someone without it);
without a key the signature is not checked and unsigned folders verify as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import io
import json
import logging
import os
import pickle
import random
import re
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from steadyrl import failpoints
from steadyrl.files import fsync_dir, sha256_file, write_atomic
from steadyrl.model.models import state_dict_mismatch
from steadyrl.run import diskspace

# torch.distributed.checkpoint (DCP) takes seconds to import: the format-3 (sharded) functions
# import it themselves (`# lazy: heavy (torch DCP)`).
if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
    from torch.optim.lr_scheduler import LRScheduler

log = logging.getLogger(__name__)

FORMAT_VERSION = "2.0"  # 2.0: optimizer state as safetensors + JSON (1.0: torch.save)
SHARDED_FORMAT_VERSION = "3.0"  # 3.0: the same tables as a torch.distributed.checkpoint folder (shards/)
READABLE = ("2", "3")  # major versions `verify` and `read` take


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message names what mismatched (expected vs got)."""


class NonFiniteWeights(ValueError):
    """Weights (or optimizer tensors) holding NaN or infinity, refused before anything is written."""


def _finite(t: torch.Tensor) -> bool:
    """No NaN or infinity in `t`: its min and max are finite (min/max propagate NaN). One
    reduction without a temporary: 0.09 s for SmolLM2's 135M weights on 2 busy cores, where
    `isfinite(t).all()` took 1.7 s."""
    lo, hi = torch.aminmax(t.detach())
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def nonfinite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors in `tensors` with a NaN or infinite entry."""
    return [k for k, t in tensors.items() if t.is_floating_point() and t.numel() and not _finite(t)]


def refuse_nonfinite(tensors: dict[str, torch.Tensor], what: str) -> None:
    """Raise NonFiniteWeights naming the first tensors of `tensors` that are not finite."""
    bad = nonfinite(tensors)
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise NonFiniteWeights(f"{what}: refusing to write non-finite weights: {', '.join(bad[:3])}{more} "
                               "hold NaN or infinity")


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch RNG states, JSON-serialisable."""
    py = random.getstate()
    np_state = cast(tuple[str, Any, int, int, float], np.random.get_state())   # legacy=True: the tuple
    return {"python": [py[0], list(py[1]), py[2]],
            "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
            "torch": torch.get_rng_state().tolist()}


def set_rng_state(state: dict[str, Any]) -> None:
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}


def _write_chunks(path: Path, parts: Iterable[bytes | memoryview], chunk: int = 16 << 20, *,
                  fsync: bool = True) -> dict[str, Any]:
    """Write the buffers in `parts` to a new file in `chunk`-byte pieces, hashing each on the
    way (hashlib and unbuffered file writes release the GIL), and fsync it (unless `fsync` is
    False: the caller syncs later). Returns the manifest entry {"size": bytes, "sha256": hex}."""
    h, size = hashlib.sha256(), 0
    with open(path, "wb", buffering=0) as f:
        for data in parts:
            view = memoryview(data).cast("B")
            for off in range(0, len(view), chunk):
                piece = view[off:off + chunk]
                h.update(piece)
                while piece:
                    n = f.write(piece)
                    piece = piece[n:]
            size += len(view)
        if fsync:
            os.fsync(f.fileno())
    return {"size": size, "sha256": h.hexdigest()}


def _file_entry(path: Path) -> dict[str, Any]:
    """{"size", "sha256"} of a file written by another writer (DCP's shards)."""
    return {"size": path.stat().st_size, "sha256": sha256_file(path)}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None,
                      *, fsync: bool = True) -> dict[str, Any]:
    """Stream `tensors` (CPU) into a safetensors file, hashing as it writes; fsynced unless
    `fsync` is False (the caller syncs it later).

    The format (https://github.com/huggingface/safetensors, "Format"): 8-byte little-endian
    header length, a JSON header {name: {dtype, shape, data_offsets}} padded with spaces to
    8 bytes, then the tensors' bytes. `safetensors.torch.load_file` reads it back.
    Returns {"size", "sha256"}. Raises KeyError for a dtype safetensors has no name for.
    """
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    datas: list[bytes | memoryview] = []
    offset = 0
    for name, t in tensors.items():
        t = t.detach().contiguous()
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        datas.append(t.reshape(-1).view(torch.uint8).numpy().data if n else b"")
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return _write_chunks(path, [len(head).to_bytes(8, "little") + head, *datas], fsync=fsync)


def _optimizer_parts(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split an optimizer state_dict into tensors ("state.<param>.<name>") and JSON (the rest)."""
    tensors, plain = {}, {}
    for idx, per_param in state["state"].items():
        for name, v in per_param.items():
            if isinstance(v, torch.Tensor):
                tensors[f"state.{idx}.{name}"] = v
            else:
                plain[f"{idx}.{name}"] = v
    return tensors, {"param_groups": state["param_groups"], "plain_state": plain}


def _optimizer_state(tensors: dict[str, torch.Tensor], js: dict[str, Any]) -> dict[str, Any]:
    """Inverse of _optimizer_parts."""
    state: dict[int, dict[str, Any]] = {}
    for key, t in tensors.items():
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = t
    for key, v in js["plain_state"].items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = v
    groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in js["param_groups"]]  # JSON lists
    return {"state": state, "param_groups": groups}


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP2's shards), else `t`."""
    return t.to_local() if hasattr(t, "to_local") else t


def _alias_key(t: torch.Tensor) -> tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...]]:
    """Equal for the same view of the same memory (tied weights; FSDP2 gives two DTensors over
    one shard), different otherwise."""
    t = _local(t)
    return (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


def unique_tensors(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One name per storage, the first in order: safetensors refuses tensors that share memory
    (tied embeddings keep `model.embed_tokens.weight`; `load_weights` accepts the tie)."""
    seen, out = set(), {}
    for k, v in state_dict.items():
        if v.numel() and _alias_key(v) in seen:
            continue
        seen.add(_alias_key(v))
        out[k] = v
    return out


def load_weights(path: Path, model: torch.nn.Module) -> None:
    """Load a safetensors file of `model`'s weights (tied keys may be absent).

    Raises CheckpointError naming missing, unexpected or wrongly shaped keys
    (steadyrl.model.models.state_dict_mismatch).
    """
    fit_weights(model, load_file(str(path)), path)


def fit_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], where: Path) -> None:
    """Load `weights` into `model` (tied keys may be absent). Raises CheckpointError naming
    `where` and the missing, unexpected or wrongly shaped keys (steadyrl.model.models.state_dict_mismatch)."""
    why = state_dict_mismatch(model, weights)
    if why:
        raise CheckpointError(f"{where}: weights do not fit the model: {why}")
    model.load_state_dict(weights, strict=False)


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: LRScheduler | None
             ) -> dict[str, Any]:
    """CPU copies of everything a save writes (the step loop may go on changing the originals).
    Tensors that share storage (tied embeddings) stay shared in the copy."""
    copies: dict[tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}

    def cpu(obj: Any) -> Any:   # a state dict's nesting: dicts, lists and tuples of tensors and plain values
        if isinstance(obj, torch.Tensor):
            if obj.numel() == 0:  # every empty tensor has data_ptr 0
                return obj.detach().to("cpu", copy=True)
            key = _alias_key(obj)
            if key not in copies:
                copies[key] = obj.detach().to("cpu", copy=True)
            return copies[key]
        if isinstance(obj, dict):
            return {k: cpu(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(cpu(v) for v in obj)
        return obj

    return {"model": cpu(model.state_dict()), "optimizer": cpu(optimizer.state_dict()),
            "scheduler": scheduler.state_dict() if scheduler is not None else None}


def write(root: Path, step: int, snap: dict[str, Any], meta: dict[str, Any], config: dict[str, Any],
          keep: int = 3, key: bytes | None = None) -> Path:
    """Write one checkpoint for `step` and make it LATEST. Returns its folder.

    `config` (model, tokenizer, algorithm, ...) is recorded in the manifest and checked on
    resume. Keeps the newest `keep` complete checkpoints. With `key`, the manifest is signed
    (manifest.sig, see the module doc). Raises NonFiniteWeights (nothing
    written) when a weight or optimizer tensor holds NaN or infinity.
    """
    opt_tensors, opt_json = _optimizer_parts(snap["optimizer"])
    refuse_nonfinite(snap["model"], f"checkpoint step {step}: model")
    refuse_nonfinite(opt_tensors, f"checkpoint step {step}: optimizer")
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f"{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "model").mkdir(parents=True)
    (tmp / "optimizer").mkdir()
    files = {"model/model.safetensors": write_safetensors(tmp / "model" / "model.safetensors",
                                                          unique_tensors(snap["model"]))}
    failpoints.hit("checkpoint.mid_write")
    files["optimizer/optimizer.safetensors"] = write_safetensors(tmp / "optimizer" / "optimizer.safetensors",
                                                                 opt_tensors)
    meta = {**meta, "optimizer": opt_json, "scheduler": snap["scheduler"]}
    return _finish(root, tmp, final, step, files, meta, config, keep, FORMAT_VERSION, key)


def _finish(root: Path, tmp: Path, final: Path, step: int, files: dict[str, Any], meta: dict[str, Any],
            config: dict[str, Any], keep: int, version: str, key: bytes | None = None) -> Path:
    """meta.json and manifest.json (and with `key` its signature, manifest.sig) into `tmp`
    (every file fsynced), `tmp` renamed to `final`, LATEST replaced, old checkpoints pruned.
    Returns `final`."""
    files["meta.json"] = _write_chunks(tmp / "meta.json", [json.dumps(meta).encode()])
    manifest = {"format_version": version, "step": step, "config": config, "files": files,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    body = json.dumps(manifest, indent=2).encode()
    _write_chunks(tmp / "manifest.json", [body])
    if key is not None:
        _write_chunks(tmp / SIGNATURE, [(_signature(key, body) + "\n").encode()])
    for d in [*(p for p in tmp.iterdir() if p.is_dir()), tmp]:
        fsync_dir(d)
    replaced = None
    if final.exists():  # the same step saved again: the old folder stays whole until the new one is in
        replaced = root / f"{final.name}.old-{os.getpid()}"
        shutil.rmtree(replaced, ignore_errors=True)
        final.rename(replaced)
    tmp.rename(final)
    fsync_dir(root)
    write_atomic(root / "LATEST", final.name + "\n")
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    for old in list_checkpoints(root)[:-keep]:
        if old != final.name:  # never the one just written (a newer-named folder may be broken)
            shutil.rmtree(root / old, ignore_errors=True)
    for stray in [*root.glob("step_*.tmp-*"), *root.glob("step_*.old-*")]:
        shutil.rmtree(stray, ignore_errors=True)
    return final


def list_checkpoints(root: Path) -> list[str]:
    """Complete checkpoint folder names under root, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.glob("step_*") if p.is_dir() and re.fullmatch(r"step_\d{6,}", p.name))


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


def _signature(key: bytes, manifest: bytes) -> str:
    return "hmac-sha256 " + hmac.new(key, manifest, hashlib.sha256).hexdigest()


def sign(path: Path, key: bytes) -> None:
    """Sign the checkpoint folder `path` (its manifest.json as it is) with `key`: writes
    manifest.sig atomically. For a checkpoint you trust that was written without the key
    (`steadyrl ckpt sign`); the learner signs what it writes itself."""
    write_atomic(path / SIGNATURE, _signature(key, (path / "manifest.json").read_bytes()) + "\n")


def _check_signature(path: Path, manifest: bytes, key: bytes) -> None:
    sig = path / SIGNATURE
    if not sig.is_file():
        raise CheckpointError(f"{path}: not signed (no {SIGNATURE}) and a checkpoint key is configured: a "
                              "checkpoint written without the key is refused (if you trust it: steadyrl ckpt sign "
                              f"{path} --key-file KEY)")
    if not hmac.compare_digest(sig.read_bytes().strip(), _signature(key, manifest).encode()):
        raise CheckpointError(f"{path}: {SIGNATURE} does not match manifest.json under the configured key "
                              "(signed with another key, or the manifest was changed after signing)")


#: (module, name) a format-3 `.metadata` pickle may name: torch.distributed.checkpoint's
#: metadata dataclasses and what their fields hold. Everything else is refused unresolved.
_METADATA_GLOBALS = frozenset({
    *(("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),   # torch.layout pickles as _get_layout("torch.strided")
    ("pathlib", "PosixPath"),                 # StorageMeta.checkpoint_id: the folder it was written to
})


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only _METADATA_GLOBALS and torch's dtypes; refuses any other global before it is
    imported or called (and any persistent id: the default `persistent_load` raises)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"names {module}.{name}, which a checkpoint's metadata does not hold "
                              "(refused, not loaded)")


def shard_metadata(folder: Path, data: bytes | None = None) -> Metadata:
    """The torch.distributed.checkpoint `Metadata` of a format-3 shards folder (its `.metadata`,
    or `data`), unpickled through an allow-list (_METADATA_GLOBALS), so nothing in it runs.

    Also checks what `read` relies on: every entry is a tensor of the `model` or `optimizer`
    table, and every piece of data lies in a plain file of `folder` with no transform.
    Raises CheckpointError naming the folder and what is refused (a global outside the list,
    an unexpected entry, a path, a file that is not DCP's metadata)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo  # lazy: heavy (torch DCP)
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata  # lazy: heavy (torch DCP)

    where = Path(folder) / ".metadata"
    try:
        raw = data if data is not None else where.read_bytes()
        md = _MetadataUnpickler(io.BytesIO(raw)).load()
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e}") from None
    except Exception as e:  # noqa: BLE001 - a truncated or foreign pickle: UnpicklingError, EOFError, TypeError, ...
        raise CheckpointError(f"{where}: not a distributed checkpoint's metadata: {type(e).__name__}: {e}") from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict) \
            or not isinstance(md.storage_data, dict):
        raise CheckpointError(f"{where}: not a distributed checkpoint's metadata (a {type(md).__name__})")
    for key, entry in md.state_dict_metadata.items():
        if str(key).partition(".")[0] not in ("model", "optimizer") or not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"{folder}: unexpected entry {key!r} in the shards' metadata")
    for info in md.storage_data.values():
        if not isinstance(info, _StorageInfo) or not isinstance(info.relative_path, str) \
                or not re.fullmatch(r"[\w.-]+", info.relative_path) or info.relative_path.startswith(".") \
                or getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{folder}: the shards' metadata points at {info!r}: only plain files of "
                                  "the folder, untransformed, are read")
    return md


def _safe_reader(folder: Path) -> FileSystemReader:
    """A torch.distributed.checkpoint FileSystemReader of `folder` whose metadata is read by
    `shard_metadata` (torch's own reader unpickles it unrestricted)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader  # lazy: heavy (torch DCP)
    from torch.distributed.checkpoint.metadata import StorageMeta  # lazy: heavy (torch DCP)

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            md = shard_metadata(folder)
            storage_meta = getattr(md, "storage_meta", None)
            if storage_meta is None:
                storage_meta = md.storage_meta = StorageMeta()
            storage_meta.load_id = self.load_id
            return md

    return Reader(str(folder))


def verify(path: Path, expect_config: dict[str, Any] | None = None, key: bytes | None = None) -> dict[str, Any]:
    """Check one checkpoint folder; returns its manifest.

    Raises CheckpointError naming the first mismatch: missing manifest, with `key` a missing
    or wrong signature (checked before anything the manifest says is trusted), other format
    version, a missing/truncated/changed file (size or sha256, expected vs got), format 3's
    metadata refused by `shard_metadata` (never executed), or a config key (model, tokenizer,
    algorithm, ...) that differs from `expect_config`.
    """
    mpath = path / "manifest.json"
    if not mpath.is_file():
        raise CheckpointError(f"{path}: no manifest.json (incomplete checkpoint)")
    body = mpath.read_bytes()
    if key is not None:
        _check_signature(path, body, key)
    try:
        manifest = json.loads(body)
    except ValueError as e:
        raise CheckpointError(f"{mpath}: not JSON: {e}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{mpath}: not a manifest (no files table)")
    got = manifest.get("format_version")
    if str(got).split(".")[0] not in READABLE:
        raise CheckpointError(f"{path}: checkpoint format mismatch: expected v{FORMAT_VERSION} or "
                              f"v{SHARDED_FORMAT_VERSION}, got v{got}")
    for rel, want in manifest["files"].items():
        if not isinstance(want, dict) or not {"size", "sha256"} <= set(want):
            raise CheckpointError(f"{path}: manifest entry for {rel} lacks size/sha256")
        p = path / rel
        if not p.is_file():
            raise CheckpointError(f"{path}: {rel} missing (expected {want['size']} bytes)")
        size = p.stat().st_size
        if size != want["size"]:
            raise CheckpointError(f"{path}: {rel} size mismatch: expected {want['size']} bytes, got {size}")
        digest = sha256_file(p)
        if digest != want["sha256"]:
            raise CheckpointError(f"{path}: {rel} sha256 mismatch: expected {want['sha256']}, got {digest}")
    sharded = str(got).split(".")[0] == "3"
    for required in (("shards/.metadata", "meta.json") if sharded else
                     ("model/model.safetensors", "optimizer/optimizer.safetensors", "meta.json")):
        if required not in manifest["files"]:
            raise CheckpointError(f"{path}: {required} not in the manifest")
    if sharded:
        md = shard_metadata(path / "shards")
        for info in md.storage_data.values():
            if f"shards/{info.relative_path}" not in manifest["files"]:
                raise CheckpointError(f"{path}: the shards' metadata names shards/{info.relative_path}, "
                                      "which the manifest does not list")
    for name, want in (expect_config or {}).items():
        have = manifest.get("config", {}).get(name)
        if have != want:
            raise CheckpointError(f"{path}: {name} mismatch: expected {want!r}, got {have!r}")
    return manifest


def latest_valid(root: Path, expect_config: dict[str, Any] | None = None, key: bytes | None = None
                 ) -> Path | None:
    """The newest checkpoint that verifies (`verify`, with `key` when given): LATEST, else older
    ones with a warning saying why.

    Returns None when root holds no checkpoint at all. Raises CheckpointError when there
    are checkpoints but none verifies (never silently starts from zero).
    """
    names = list_checkpoints(root)
    if not names:
        return None
    latest = (root / "LATEST").read_text().strip() if (root / "LATEST").exists() else names[-1]
    order = [latest] + [n for n in reversed(names) if n != latest]
    errors = []
    for name in order:
        try:
            verify(root / name, expect_config, key)
        except CheckpointError as e:
            errors.append(str(e))
            log.warning("checkpoint unusable; trying the previous one", extra={"checkpoint": name, "why": str(e)})
            continue
        return root / name
    raise CheckpointError("no usable checkpoint in " + str(root) + ":\n  " + "\n  ".join(errors))


def _read_shards(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The whole `model` and `optimizer` tables of a torch.distributed.checkpoint folder, on this
    process alone (no collective: DCP's no_dist load reassembles every rank's shards). The
    metadata is read through `shard_metadata`'s allow-list, here and inside DCP's load."""
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load  # lazy: heavy (torch DCP)

    reader = _safe_reader(folder)
    tables: dict[str, dict[str, torch.Tensor]] = {"model": {}, "optimizer": {}}
    for key, md in reader.read_metadata().state_dict_metadata.items():   # shard_metadata checked each
        table, _, name = key.partition(".")
        tensor = cast("TensorStorageMetadata", md)   # shard_metadata refused every other kind of entry
        tables[table][name] = torch.empty(tensor.size, dtype=tensor.properties.dtype)
    with warnings.catch_warnings():   # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_load(tables, storage_reader=reader, no_dist=True)
    return tables["model"], tables["optimizer"]


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """The whole weights, optimizer state dict (index-keyed, as `Optimizer.state_dict()`) and
    meta.json of a verified checkpoint of either format (one rank's safetensors, or N ranks'
    shards), on this process alone."""
    meta = json.loads((path / "meta.json").read_text())
    if (path / "shards").is_dir():
        weights, opt_tensors = _read_shards(path / "shards")
    else:
        weights = load_file(str(path / "model" / "model.safetensors"))
        opt_tensors = load_file(str(path / "optimizer" / "optimizer.safetensors"))
    return weights, _optimizer_state(opt_tensors, meta["optimizer"]), meta


def load(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
         scheduler: LRScheduler | None) -> dict[str, Any]:
    """Load a verified checkpoint (either format) into model/optimizer/scheduler; returns
    meta.json. With `optimizer` None the optimizer's state dict is returned as
    meta["optimizer_state"] instead (a sharded trainer scatters it: steadyrl.rl.distributed.sync).

    Raises CheckpointError if the weights do not fit the model (see
    steadyrl.model.models.state_dict_mismatch).
    """
    weights, opt_state, meta = read(path)
    fit_weights(model, weights, path)
    if optimizer is None:
        meta["optimizer_state"] = opt_state
    else:
        optimizer.load_state_dict(opt_state)
    if scheduler is not None and meta.get("scheduler") is not None:
        scheduler.load_state_dict(meta["scheduler"])
    return meta


def _lower_priority() -> None:
    """Nice +10 for the calling thread (Linux: a thread has its own nice value), so the step
    loop's threads win the CPU over a checkpoint writer."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


class ShardedTrainer(Protocol):
    """What a sharded save uses of a trainer (steadyrl.rl.trainer.Trainer): its whole model,
    its (FSDP-sharded) module, optimizer and schedule, and the gloo group checkpoints use."""

    @property
    def model(self) -> torch.nn.Module: ...
    @property
    def module(self) -> torch.nn.Module: ...
    @property
    def opt(self) -> torch.optim.Optimizer: ...
    @property
    def sched(self) -> LRScheduler: ...
    @property
    def checkpoint_group(self) -> ProcessGroup | int | None: ...   # int: torch's NON_GROUP_MEMBER, in its types


class ShardWriter:
    """One rank's part of a sharded checkpoint (format 3): `save(tmp, trainer)` copies this
    rank's shards of the trained weights and optimizer state (the only part the caller waits
    for) and writes them into `<tmp>/shards/` in a background thread with
    `torch.distributed.checkpoint.save`, over the trainer's `checkpoint_group` (a gloo group of
    its own: its collectives never meet the training's). Every rank of the group calls `save`
    with the same `tmp`, one save at a time. `wait()` joins the write in flight and re-raises
    its error."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def snapshot(self, trainer: ShardedTrainer) -> tuple[dict[str, Any], dict[str, Any]]:
        """(tables of this rank's shard copies, the optimizer's JSON part)."""
        from steadyrl.rl.distributed import to_host  # lazy: heavy (torch.distributed, FSDP), only sharded trainers

        opt_tensors, opt_json = _optimizer_parts(trainer.opt.state_dict())
        tables = {"model": {k: to_host(v)   # tied weights: one name, as format 2
                            for k, v in unique_tensors(trainer.module.state_dict()).items()},
                  "optimizer": {k: to_host(v) for k, v in opt_tensors.items()}}
        return tables, opt_json

    def save(self, tmp: str | Path, trainer: ShardedTrainer, then: Callable[[dict[str, Any]], None] | None = None
             ) -> None:
        """Start writing this rank's shards into `<tmp>/shards/`; `then(opt_json)` runs in the same
        thread after the write (rank 0: the manifest), given the optimizer's JSON part. Every rank
        first learns whether any rank's optimizer shards hold NaN or infinity (a MAX all-reduce
        on the checkpoint group): if one does, no rank writes and each raises NonFiniteWeights
        from `wait()`, so no rank waits in DCP for one that refused."""
        self.wait()
        tables, opt_json = self.snapshot(trainer)

        def run() -> None:
            from torch.distributed.checkpoint.filesystem import FileSystemWriter  # lazy: heavy (torch DCP)
            from torch.distributed.checkpoint.state_dict_saver import save as dcp_save  # lazy: heavy (torch DCP)

            # a gloo group of every rank (dist.new_group): never NON_GROUP_MEMBER, which torch's types allow
            group = cast("ProcessGroup | None", trainer.checkpoint_group)
            _lower_priority()
            try:
                bad = nonfinite({k: _local(v) for k, v in tables["optimizer"].items()})
                flag = torch.tensor([1.0 if bad else 0.0])
                if group is not None:
                    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
                if float(flag) > 0:
                    raise NonFiniteWeights(f"checkpoint {tmp}: refusing to write non-finite optimizer state "
                                           f"({', '.join(bad[:3]) or 'on another rank'})")
                dcp_save(tables, storage_writer=FileSystemWriter(str(Path(tmp) / "shards"), thread_count=1),
                         process_group=group)
                if then is not None:
                    then(opt_json)
            except BaseException as e:  # noqa: BLE001 - handed to wait(), which raises it in the caller
                self.error = e

        self._thread = threading.Thread(target=run, name="checkpoint-shards", daemon=False)
        self._thread.start()

    def wait(self, beat: Callable[[], None] = lambda: None) -> None:
        """Block until this rank's write (if any) is done, calling `beat` about every second."""
        if self._thread is not None:
            _join(self._thread, beat)
            self._thread = None
        if self.error is not None:
            err, self.error = self.error, None
            raise CheckpointError(f"checkpoint save failed: {type(err).__name__}: {err}") from err


def _join(thread: threading.Thread, beat: Callable[[], None]) -> None:
    """Join `thread`, calling `beat` about every second until it ends."""
    while thread.is_alive():
        thread.join(timeout=1.0)
        beat()


class AsyncCheckpointer:
    """Background writer: `save()` snapshots on the caller's thread and returns; the write
    runs in a thread, and then (`verify`) the verification of what was written, in the same
    thread. At most one save is in flight (a second waits for the first).

    Args:
        root: checkpoint folder.
        config: recorded in every manifest, checked on resume.
        keep: complete checkpoints kept.
        verify: re-read and re-hash each checkpoint after writing it (`verify()`).
        verified_step: the step of a checkpoint known to verify already (the one a resume
            verified), or None.
        key: sign every checkpoint with it (manifest.sig) and verify with it (`read_key`).
        beat: called about every second while `save` or `wait` waits for the write in
            flight (the liveness heartbeat of the thread that waits).

    Attributes:
        last_verified_step: the newest step whose checkpoint verified after it was written
            (or `verified_step`); a checkpoint that fails is logged and leaves it as it was.
        last_seconds, last_verify_seconds: the last write's and verification's durations.
    """

    def __init__(self, root: Path, config: dict[str, Any], keep: int = 3, verify: bool = True,
                 verified_step: int | None = None, beat: Callable[[], None] = lambda: None,
                 key: bytes | None = None) -> None:
        self.root, self.config, self.keep, self.verify = Path(root), config, keep, verify
        self.key = key
        self.beat = beat
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.last_seconds: float | None = None
        self.last_verify_seconds: float | None = None
        self.last_verified_step = verified_step
        self.shards: ShardWriter | None = None   # made at the first sharded save; its write is a save in flight

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: LRScheduler | None,
             meta: dict[str, Any]) -> None:
        self.wait()
        snap = snapshot(model, optimizer, scheduler)

        def attempt() -> Path:
            try:
                return write(self.root, step, snap, meta, self.config, self.keep, self.key)
            except OSError:  # a refused write's temporary goes at once; LATEST stays the last good one
                shutil.rmtree(self.root / f"step_{step:06d}.tmp-{os.getpid()}", ignore_errors=True)
                raise

        def run() -> None:
            _lower_priority()
            t0 = time.perf_counter()
            try:  # a full disk: retried with backoff until space returns (steadyrl.run.diskspace.retry)
                final = diskspace.retry(attempt, "checkpoint", self.root / f"step_{step:06d}", beat=lambda: None)
                self.last_seconds = time.perf_counter() - t0
            except BaseException as e:  # noqa: BLE001 - handed to wait(), which raises it in the caller
                self.error = e
                return
            if self.verify:
                self._verify(final, step)

        self._thread = threading.Thread(target=run, name=f"checkpoint-{step}", daemon=False)
        self._thread.start()

    def save_sharded(self, step: int, trainer: ShardedTrainer, meta: dict[str, Any],
                     announce: Callable[[str], None]) -> None:
        """Rank 0's side of a sharded checkpoint (format 3) of `trainer` (sharding fsdp): refuse
        non-finite weights (its whole `model`), prepare the folder, `announce(tmp)` it to the
        other ranks (each then calls ShardWriter.save with it; rank 0's Leader.save hands them
        the restored state first), write rank 0's shards, and --
        in the writer's thread, once every rank's shards are in (DCP's last collective) --
        meta.json, the manifest of every shard, LATEST, and the verification."""
        self.wait()
        self.shards = self.shards or ShardWriter()
        refuse_nonfinite(trainer.model.state_dict(), f"checkpoint step {step}: model")
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f"{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        announce(str(tmp))
        t0 = time.perf_counter()
        scheduler = trainer.sched.state_dict()   # now: the step loop goes on while the shards are written

        def finish(opt_json: dict[str, Any]) -> None:
            files = {str(p.relative_to(tmp)): _file_entry(p) for p in sorted((tmp / "shards").iterdir())}
            full_meta = {**meta, "optimizer": opt_json, "scheduler": scheduler}
            written = _finish(self.root, tmp, final, step, files, full_meta, self.config, self.keep,
                              SHARDED_FORMAT_VERSION, self.key)
            self.last_seconds = time.perf_counter() - t0
            if self.verify:
                self._verify(written, step)

        self.shards.save(tmp, trainer, then=finish)

    def _verify(self, path: Path, step: int) -> None:
        """Verify the checkpoint just written (as a resume would); record its step when it does."""
        t0 = time.perf_counter()
        try:
            verify(path, self.config, self.key)
        except CheckpointError as e:  # the previous verified checkpoint stays the one to count on
            log.error("checkpoint did not verify after it was written", extra={"checkpoint": str(path),
                                                                                "why": str(e)})
        else:
            self.last_verified_step = step
        finally:
            self.last_verify_seconds = time.perf_counter() - t0

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete, calling `beat` about every
        second meanwhile (the waiting thread stays live). Re-raises its error."""
        if self._thread is not None:
            _join(self._thread, self.beat)
            self._thread = None
        if self.shards is not None:
            self.shards.wait(self.beat)   # raises CheckpointError naming the failed sharded save
        if self.error is not None:
            err, self.error = self.error, None
            raise CheckpointError(f"checkpoint save failed: {type(err).__name__}: {err}") from err

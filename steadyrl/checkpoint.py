"""Layered, verified learner checkpoints.

Layout (one folder per step, `LATEST` names the newest complete one):

    <dir>/step_000500/
      model/model.safetensors        weights
      optimizer/optimizer.safetensors  optimizer state tensors (AdamW moments, steps)
      meta.json                      global_step, RNG states, learner state, and the optimizer's
                                     param groups and LR-scheduler state (JSON)
      manifest.json                  format version, step, config, every file's size and sha256
    <dir>/LATEST                     written last, atomically

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
are written; `write` never reads them back (the verification after it does). Nothing is
pickled: the optimizer's tensors are safetensors and the rest is JSON.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch

from steadyrl import failpoints
from steadyrl.files import sha256_file, write_atomic

log = logging.getLogger(__name__)

FORMAT_VERSION = "2.0"  # 2.0: optimizer state as safetensors + JSON (1.0: torch.save)


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
    import numpy as np

    py = random.getstate()
    np_state = np.random.get_state()
    return {"python": [py[0], list(py[1]), py[2]],
            "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
            "torch": torch.get_rng_state().tolist()}


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}


def _write_chunks(path: Path, parts, chunk: int = 16 << 20) -> dict[str, Any]:
    """Write the buffers in `parts` to a new file in `chunk`-byte pieces, hashing each on the
    way (hashlib and unbuffered file writes release the GIL), and fsync it.
    Returns the manifest entry {"size": bytes, "sha256": hex}."""
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
        os.fsync(f.fileno())
    return {"size": size, "sha256": h.hexdigest()}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
                      ) -> dict[str, Any]:
    """Stream `tensors` (CPU) into a safetensors file, hashing as it writes; fsynced.

    The format (https://github.com/huggingface/safetensors, "Format"): 8-byte little-endian
    header length, a JSON header {name: {dtype, shape, data_offsets}} padded with spaces to
    8 bytes, then the tensors' bytes. `safetensors.torch.load_file` reads it back.
    Returns {"size", "sha256"}. Raises KeyError for a dtype safetensors has no name for.
    """
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    datas, offset = [], 0
    for name, t in tensors.items():
        t = t.detach().contiguous()
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        datas.append(t.reshape(-1).view(torch.uint8).numpy() if n else b"")
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return _write_chunks(path, [len(head).to_bytes(8, "little") + head, *datas])


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


def _alias_key(t: torch.Tensor) -> tuple:
    """Equal for the same view of the same memory (tied weights), different otherwise."""
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


def load_weights(path: Path, model) -> None:
    """Load a safetensors file of `model`'s weights (tied keys may be absent).

    Raises CheckpointError naming missing, unexpected or wrongly shaped keys
    (steadyrl.models.state_dict_mismatch).
    """
    from safetensors.torch import load_file

    from steadyrl.models import state_dict_mismatch

    weights = load_file(str(path))
    why = state_dict_mismatch(model, weights)
    if why:
        raise CheckpointError(f"{path}: weights do not fit the model: {why}")
    model.load_state_dict(weights, strict=False)


def snapshot(model, optimizer, scheduler) -> dict[str, Any]:
    """CPU copies of everything a save writes (the step loop may go on changing the originals).
    Tensors that share storage (tied embeddings) stay shared in the copy."""
    copies: dict[tuple, torch.Tensor] = {}

    def cpu(obj):
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
          keep: int = 3) -> Path:
    """Write one checkpoint for `step` and make it LATEST. Returns its folder.

    `config` (model, tokenizer, algorithm, ...) is recorded in the manifest and checked on
    resume. Keeps the newest `keep` complete checkpoints. Raises NonFiniteWeights (nothing
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
    files["meta.json"] = _write_chunks(tmp / "meta.json", [json.dumps(meta).encode()])
    manifest = {"format_version": FORMAT_VERSION, "step": step, "config": config, "files": files,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    _write_chunks(tmp / "manifest.json", [json.dumps(manifest, indent=2).encode()])
    for d in (tmp / "model", tmp / "optimizer", tmp):
        _fsync_dir(d)
    replaced = None
    if final.exists():  # the same step saved again: the old folder stays whole until the new one is in
        replaced = root / f"{final.name}.old-{os.getpid()}"
        shutil.rmtree(replaced, ignore_errors=True)
        final.rename(replaced)
    tmp.rename(final)
    _fsync_dir(root)
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


def verify(path: Path, expect_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Check one checkpoint folder; returns its manifest.

    Raises CheckpointError naming the first mismatch: missing manifest, other format
    version, a missing/truncated/changed file (size or sha256, expected vs got), or a
    config key (model, tokenizer, algorithm, ...) that differs from `expect_config`.
    """
    mpath = path / "manifest.json"
    if not mpath.is_file():
        raise CheckpointError(f"{path}: no manifest.json (incomplete checkpoint)")
    try:
        manifest = json.loads(mpath.read_text())
    except ValueError as e:
        raise CheckpointError(f"{mpath}: not JSON: {e}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{mpath}: not a manifest (no files table)")
    got = manifest.get("format_version")
    if str(got).split(".")[0] != FORMAT_VERSION.split(".")[0]:
        raise CheckpointError(f"{path}: checkpoint format mismatch: expected v{FORMAT_VERSION}, got v{got}")
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
    for required in ("model/model.safetensors", "optimizer/optimizer.safetensors", "meta.json"):
        if required not in manifest["files"]:
            raise CheckpointError(f"{path}: {required} not in the manifest")
    for key, want in (expect_config or {}).items():
        have = manifest.get("config", {}).get(key)
        if have != want:
            raise CheckpointError(f"{path}: {key} mismatch: expected {want!r}, got {have!r}")
    return manifest


def latest_valid(root: Path, expect_config: dict[str, Any] | None = None) -> Path | None:
    """The newest checkpoint that verifies: LATEST, else older ones with a warning saying why.

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
            verify(root / name, expect_config)
        except CheckpointError as e:
            errors.append(str(e))
            log.warning("checkpoint unusable; trying the previous one", extra={"checkpoint": name, "why": str(e)})
            continue
        return root / name
    raise CheckpointError("no usable checkpoint in " + str(root) + ":\n  " + "\n  ".join(errors))


def load(path: Path, model, optimizer, scheduler) -> dict[str, Any]:
    """Load a verified checkpoint into model/optimizer/scheduler; returns meta.json.

    Raises CheckpointError if the weights do not fit the model (see
    steadyrl.models.state_dict_mismatch).
    """
    from safetensors.torch import load_file

    load_weights(path / "model" / "model.safetensors", model)
    meta = json.loads((path / "meta.json").read_text())
    opt_tensors = load_file(str(path / "optimizer" / "optimizer.safetensors"))
    optimizer.load_state_dict(_optimizer_state(opt_tensors, meta["optimizer"]))
    if scheduler is not None and meta.get("scheduler") is not None:
        scheduler.load_state_dict(meta["scheduler"])
    return meta


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

    Attributes:
        last_verified_step: the newest step whose checkpoint verified after it was written
            (or `verified_step`); a checkpoint that fails is logged and leaves it as it was.
        last_seconds, last_verify_seconds: the last write's and verification's durations.
    """

    def __init__(self, root: Path, config: dict[str, Any], keep: int = 3, verify: bool = True,
                 verified_step: int | None = None):
        self.root, self.config, self.keep, self.verify = Path(root), config, keep, verify
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.last_seconds: float | None = None
        self.last_verify_seconds: float | None = None
        self.last_verified_step = verified_step

    def save(self, step: int, model, optimizer, scheduler, meta: dict[str, Any]) -> None:
        self.wait()
        snap = snapshot(model, optimizer, scheduler)

        def run():
            try:  # Linux: a thread has its own nice value; let the step loop's threads win the CPU
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            except (AttributeError, OSError):
                pass
            t0 = time.perf_counter()
            try:
                final = write(self.root, step, snap, meta, self.config, self.keep)
                self.last_seconds = time.perf_counter() - t0
            except BaseException as e:  # reported by wait()
                self.error = e
                return
            if self.verify:
                self._verify(final, step)

        self._thread = threading.Thread(target=run, name=f"checkpoint-{step}", daemon=False)
        self._thread.start()

    def _verify(self, path: Path, step: int) -> None:
        """Verify the checkpoint just written (as a resume would); record its step when it does."""
        t0 = time.perf_counter()
        try:
            verify(path, self.config)
        except CheckpointError as e:  # the previous verified checkpoint stays the one to count on
            log.error("checkpoint did not verify after it was written", extra={"checkpoint": str(path),
                                                                                "why": str(e)})
        else:
            self.last_verified_step = step
        finally:
            self.last_verify_seconds = time.perf_counter() - t0

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete. Re-raises its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.error is not None:
            err, self.error = self.error, None
            raise CheckpointError(f"checkpoint save failed: {type(err).__name__}: {err}") from err

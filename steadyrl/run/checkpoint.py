"""Layered, verified learner checkpoints: the layout, `write`, `verify`, `read`.

Its parts by job: `steadyrl.run.tensors` (errors, non-finite checks, RNG, safetensors
streaming), `steadyrl.run.signing` (HMAC), `steadyrl.run.shards` (format 3, read through an
allow-list), `steadyrl.run.ckpt_writer` (the background writers).

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

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file

from steadyrl import failpoints
from steadyrl.files import fsync_dir, sha256_file, write_atomic
from steadyrl.model.models import state_dict_mismatch
from steadyrl.run.shards import read_shards, shard_metadata
from steadyrl.run.signing import SIGNATURE, check_signature, signature
from steadyrl.run.tensors import CheckpointError as CheckpointError  # raised here too: callers catch it from here
from steadyrl.run.tensors import (
    alias_key,
    optimizer_parts,
    optimizer_state,
    refuse_nonfinite,
    unique_tensors,
    write_chunks,
    write_safetensors,
)

# torch.distributed.checkpoint (DCP) takes seconds to import: the format-3 (sharded) functions
# import it themselves (`# lazy: heavy (torch DCP)`).
if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler
log = logging.getLogger(__name__)

FORMAT_VERSION = "2.0"  # 2.0: optimizer state as safetensors + JSON (1.0: torch.save)
SHARDED_FORMAT_VERSION = "3.0"  # 3.0: the same tables as a torch.distributed.checkpoint folder (shards/)
READABLE = ("2", "3")  # major versions `verify` and `read` take


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
            key = alias_key(obj)
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
    opt_tensors, opt_json = optimizer_parts(snap["optimizer"])
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
    return finish_folder(root, tmp, final, step, files, meta, config, keep, FORMAT_VERSION, key)


def finish_folder(root: Path, tmp: Path, final: Path, step: int, files: dict[str, Any], meta: dict[str, Any],
            config: dict[str, Any], keep: int, version: str, key: bytes | None = None) -> Path:
    """meta.json and manifest.json (and with `key` its signature, manifest.sig) into `tmp`
    (every file fsynced), `tmp` renamed to `final`, LATEST replaced, old checkpoints pruned.
    Returns `final`."""
    files["meta.json"] = write_chunks(tmp / "meta.json", [json.dumps(meta).encode()])
    manifest = {"format_version": version, "step": step, "config": config, "files": files,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    body = json.dumps(manifest, indent=2).encode()
    write_chunks(tmp / "manifest.json", [body])
    if key is not None:
        write_chunks(tmp / SIGNATURE, [(signature(key, body) + "\n").encode()])
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
        check_signature(path, body, key)
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


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """The whole weights, optimizer state dict (index-keyed, as `Optimizer.state_dict()`) and
    meta.json of a verified checkpoint of either format (one rank's safetensors, or N ranks'
    shards), on this process alone."""
    meta = json.loads((path / "meta.json").read_text())
    if (path / "shards").is_dir():
        weights, opt_tensors = read_shards(path / "shards")
    else:
        weights = load_file(str(path / "model" / "model.safetensors"))
        opt_tensors = load_file(str(path / "optimizer" / "optimizer.safetensors"))
    return weights, optimizer_state(opt_tensors, meta["optimizer"]), meta


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

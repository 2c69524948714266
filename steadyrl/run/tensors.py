"""Tensors in and out of checkpoint files: the checkpoint errors, non-finite checks, RNG
state, safetensors streaming (`write_safetensors`: 16 MiB chunks hashed and written outside
the GIL), an optimizer state dict as tensors + JSON, and one name per shared storage.
The checkpoint layout that uses them is `steadyrl.run.checkpoint`."""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from steadyrl.files import sha256_file


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


def write_chunks(path: Path, parts: Iterable[bytes | memoryview], chunk: int = 16 << 20, *,
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


def file_entry(path: Path) -> dict[str, Any]:
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
    return write_chunks(path, [len(head).to_bytes(8, "little") + head, *datas], fsync=fsync)


def optimizer_parts(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split an optimizer state_dict into tensors ("state.<param>.<name>") and JSON (the rest)."""
    tensors, plain = {}, {}
    for idx, per_param in state["state"].items():
        for name, v in per_param.items():
            if isinstance(v, torch.Tensor):
                tensors[f"state.{idx}.{name}"] = v
            else:
                plain[f"{idx}.{name}"] = v
    return tensors, {"param_groups": state["param_groups"], "plain_state": plain}


def optimizer_state(tensors: dict[str, torch.Tensor], js: dict[str, Any]) -> dict[str, Any]:
    """Inverse of optimizer_parts."""
    state: dict[int, dict[str, Any]] = {}
    for key, t in tensors.items():
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = t
    for key, v in js["plain_state"].items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = v
    groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in js["param_groups"]]  # JSON lists
    return {"state": state, "param_groups": groups}


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP2's shards), else `t`."""
    return t.to_local() if hasattr(t, "to_local") else t


def alias_key(t: torch.Tensor) -> tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...]]:
    """Equal for the same view of the same memory (tied weights; FSDP2 gives two DTensors over
    one shard), different otherwise."""
    t = local_part(t)
    return (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


def unique_tensors(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One name per storage, the first in order: safetensors refuses tensors that share memory
    (tied embeddings keep `model.embed_tokens.weight`; `load_weights` accepts the tie)."""
    seen, out = set(), {}
    for k, v in state_dict.items():
        if v.numel() and alias_key(v) in seen:
            continue
        seen.add(alias_key(v))
        out[k] = v
    return out

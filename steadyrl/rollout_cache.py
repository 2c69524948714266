"""The rollout cache: every trained group, appended to Arrow IPC files partitioned by hour.

    <root>/2026-11-29/14/part-000003.arrow     Arrow IPC file format (Feather v2)

One row per sample (prompt id, run, step, policy version, reward and its source, the
response text and token ids, the prompt's last user turn and ground truth). Each file
carries the schema version in its metadata (`steadyrl.rollout_cache.schema`). The rows of the
open part are held in memory and the part is written when it is closed: at every learner
checkpoint, when the UTC hour changes, and when its rows pass `max_file_bytes` (default 2 GB);
it is written as `*.arrow.tmp`, fsynced, renamed and its folder fsynced, so a reader sees
whole parts only. A crash loses only the open part, whose steps the resumed learner trains
again (an unclosed `.tmp` left by a crash mid-write is removed on open), and the learner
drops rows of steps after the checkpoint it resumes from (`truncate_after`), so every trained
group is in the cache exactly once -- until the cache's own limits delete the oldest parts
(`max_total_bytes`, `retention_s`: oldest part number first). A close the disk refuses
(ENOSPC) removes its temporary, keeps the rows and is retried until space returns
(steadyrl.run.diskspace.retry). Read with pyarrow (`pyarrow.dataset.dataset(root, format="ipc")`),
polars (`pl.read_ipc`) or duckdb (over that pyarrow dataset).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import pyarrow as pa  # type: ignore[import-untyped]  # no stubs published

from steadyrl.files import replacing
from steadyrl.run import diskspace
from steadyrl.wire.contracts import ScoredGroup

log = logging.getLogger(__name__)

SCHEMA_VERSION = "1.0"
SCHEMA_KEY = b"steadyrl.rollout_cache.schema"
SCHEMA = pa.schema([
    ("prompt_id", pa.string()), ("run_id", pa.string()), ("step", pa.int64()),
    ("policy_version", pa.int64()), ("sample", pa.int32()), ("reward", pa.float64()),
    ("reward_source", pa.string()), ("scorer", pa.string()), ("response", pa.string()),
    ("token_ids", pa.list_(pa.int32())), ("prompt", pa.string()), ("ground_truth", pa.string()),
    ("data_source", pa.string()), ("scored_ms", pa.int64()),
], metadata={SCHEMA_KEY: SCHEMA_VERSION.encode()})


class CacheSchemaError(Exception):
    """A cache file written with another schema major version (message: expected vs got)."""


def rows_of(scored: ScoredGroup, step: int) -> list[dict[str, Any]]:
    """One row per sample of a ScoredGroup trained at `step`."""
    g, p = scored.group, scored.group.prompt
    user = next((m.content for m in reversed(p.messages) if m.role == "user"), "")
    return [{"prompt_id": p.prompt_id, "run_id": p.run_id, "step": step, "policy_version": g.policy_version,
             "sample": j, "reward": float(r), "reward_source": scored.reward_source.value, "scorer": scored.scorer,
             "response": s.text, "token_ids": s.token_ids, "prompt": user, "ground_truth": p.ground_truth or "",
             "data_source": p.data_source, "scored_ms": scored.scored_ms}
            for j, (s, r) in enumerate(zip(g.samples, scored.rewards, strict=True))]


def check_schema(root: Path) -> None:
    """Raise CacheSchemaError if any closed file's schema major differs from SCHEMA_VERSION."""
    for f in sorted(Path(root).rglob("*.arrow")):
        with pa.memory_map(str(f)) as src:
            meta = pa.ipc.open_file(src).schema.metadata or {}
        got = meta.get(SCHEMA_KEY, b"?").decode()
        if got.split(".")[0] != SCHEMA_VERSION.split(".")[0]:
            raise CacheSchemaError(f"rollout cache schema mismatch: expected v{SCHEMA_VERSION}, got v{got} ({f})")


class RolloutCache:
    """Holds appended rows as the open part; writes it whole at `close()`.

    Args:
        root: cache folder.
        max_file_bytes: a part is closed once its rows reach this size (in memory: the rows of
            one part are held until it is written).
        max_total_bytes: after each close, the oldest closed parts are deleted until the closed
            parts take at most this (None: no cap); the part just closed always stays.
        retention_s: after each close, closed parts last modified longer ago are deleted (None:
            kept forever).
    Raises CacheSchemaError on open if existing files use another schema major version.
    """

    def __init__(self, root: Path, max_file_bytes: int = 2 * 1024 ** 3, max_total_bytes: int | None = None,
                 retention_s: float | None = None):
        self.root, self.max_file_bytes = Path(root), max_file_bytes
        self.max_total_bytes, self.retention_s = max_total_bytes, retention_s
        self.root.mkdir(parents=True, exist_ok=True)
        for stray in self.root.rglob("*.arrow.tmp"):  # a crash: those steps are trained again
            log.warning("removing an unclosed rollout cache part", extra={"path": str(stray)})
            stray.unlink()
        check_schema(self.root)
        self._batches: list[pa.RecordBatch] = []
        self._bytes = 0
        self._hour: str | None = None

    def parts(self) -> list[Path]:
        """The closed parts, oldest (lowest part number) first."""
        return sorted(self.root.rglob("part-*.arrow"), key=lambda p: (_number(p), str(p)))

    def append(self, rows: list[dict[str, Any]]) -> None:
        """Add `rows` to the open part (closing it first when the UTC hour changed, after when
        it reached max_file_bytes). May block in `close()` while the disk is full."""
        if not rows:
            return
        hour = time.strftime("%Y-%m-%d/%H", time.gmtime())
        if self._batches and hour != self._hour:
            self.close()
        self._hour = hour
        batch = pa.RecordBatch.from_pylist(rows, schema=SCHEMA)
        self._batches.append(batch)
        self._bytes += batch.nbytes
        if self._bytes >= self.max_file_bytes:
            self.close()

    def truncate_after(self, step: int) -> int:
        """Drop rows of steps after `step` (a learner resumed from an earlier checkpoint trains
        them again). Rewrites only the parts that hold such rows; returns rows dropped."""
        import pyarrow.compute as pc  # type: ignore[import-untyped]  # lazy: heavy (pyarrow.compute, ~100 ms); no stubs

        dropped = 0
        for f in sorted(self.root.rglob("*.arrow")):
            with pa.memory_map(str(f)) as src:
                table = pa.ipc.open_file(src).read_all()
            keep = table.filter(pc.less_equal(table.column("step"), step))
            if keep.num_rows == table.num_rows:
                continue
            dropped += table.num_rows - keep.num_rows
            _write_part(f, keep.to_batches())
        return dropped

    def close(self) -> None:
        """Write the open part (footer, fsync, renamed from .tmp, folder fsynced), then apply
        the total cap and the retention; the next append opens a new part. On a full disk it
        retries until space returns, the rows kept (steadyrl.run.diskspace.retry, writer
        `rollout_cache`)."""
        if not self._batches:
            return
        folder = self.root / (self._hour or time.strftime("%Y-%m-%d/%H", time.gmtime()))
        n = max((_number(p) for p in self.root.rglob("part-*.arrow")), default=0) + 1
        path = folder / f"part-{n:06d}.arrow"
        diskspace.retry(lambda: _write_part(path, self._batches), "rollout_cache", path)
        self._batches, self._bytes = [], 0
        self.prune(keep=path)

    def prune(self, keep: Path | None = None) -> list[Path]:
        """Delete closed parts past the retention, then the oldest until the closed parts fit
        max_total_bytes (never `keep`); empty hour and date folders go with them. Returns the
        parts deleted (logged)."""
        parts = self.parts()
        gone: list[Path] = []
        if self.retention_s is not None:
            cutoff = time.time() - self.retention_s
            for p in parts:
                if p != keep and p.stat().st_mtime < cutoff:
                    gone.append(p)
        if self.max_total_bytes is not None:
            left = [p for p in parts if p not in gone]
            total = sum(p.stat().st_size for p in left)
            for p in left:
                if total <= self.max_total_bytes or p == keep:
                    break
                total -= p.stat().st_size
                gone.append(p)
        for p in gone:
            p.unlink(missing_ok=True)
            for d in (p.parent, p.parent.parent):
                try:
                    d.rmdir()
                except OSError:
                    break
        if gone:
            log.info("rollout cache parts deleted (total cap, retention)", extra={
                "parts": [str(p.relative_to(self.root)) for p in gone], "max_total_bytes": self.max_total_bytes,
                "retention_s": self.retention_s})
        return gone


def _number(p: Path) -> int:
    try:
        return int(p.stem.removeprefix("part-"))
    except ValueError:
        return 0


def _write_part(path: Path, batches: list[pa.RecordBatch]) -> None:
    """`batches` as the Arrow IPC file `path`, fsynced and renamed into place
    (steadyrl.files.replacing: on an error `path` is left as it was)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path, Path(str(path) + ".tmp")) as tmp:  # *.arrow.tmp: removed on open after a crash
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, SCHEMA) as w:
            for b in batches:
                w.write_batch(b)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())

"""The rollout cache: every trained group, appended to Arrow IPC files partitioned by hour.

    <root>/2026-11-29/14/part-000003.arrow     Arrow IPC file format (Feather v2)

One row per sample (prompt id, run, step, policy version, reward and its source, the
response text and token ids, the prompt's last user turn and ground truth). Each file
carries the schema version in its metadata (`steadyrl.rollout_cache.schema`). A file is
written as `*.arrow.tmp` and renamed when it is closed: at every learner checkpoint, when
the UTC hour changes, and when it passes `max_file_bytes` (default 2 GB). A crash leaves
only a `.tmp` part, whose steps the resumed learner trains again; `RolloutCache` removes
it on open, and the learner drops rows of steps after the checkpoint it resumes from
(`truncate_after`), so every trained group is in the cache exactly once. Read with pyarrow
(`pyarrow.dataset.dataset(root, format="ipc")`), polars
(`pl.read_ipc`) or duckdb (over that pyarrow dataset).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

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


def rows_of(scored, step: int) -> list[dict[str, Any]]:
    """One row per sample of a ScoredGroup trained at `step`."""
    g, p = scored.group, scored.group.prompt
    user = next((m.content for m in reversed(p.messages) if m.role == "user"), "")
    return [{"prompt_id": p.prompt_id, "run_id": p.run_id, "step": step, "policy_version": g.policy_version,
             "sample": j, "reward": float(r), "reward_source": scored.reward_source.value, "scorer": scored.scorer,
             "response": s.text, "token_ids": s.token_ids, "prompt": user, "ground_truth": p.ground_truth or "",
             "data_source": p.data_source, "scored_ms": scored.scored_ms}
            for j, (s, r) in enumerate(zip(g.samples, scored.rewards))]


def check_schema(root: Path) -> None:
    """Raise CacheSchemaError if any closed file's schema major differs from SCHEMA_VERSION."""
    for f in sorted(Path(root).rglob("*.arrow")):
        with pa.memory_map(str(f)) as src:
            meta = pa.ipc.open_file(src).schema.metadata or {}
        got = meta.get(SCHEMA_KEY, b"?").decode()
        if got.split(".")[0] != SCHEMA_VERSION.split(".")[0]:
            raise CacheSchemaError(f"rollout cache schema mismatch: expected v{SCHEMA_VERSION}, got v{got} ({f})")


class RolloutCache:
    """Appends rows to the current hour's part file.

    Args:
        root: cache folder.
        max_file_bytes: a part is closed once it reaches this size.
    Raises CacheSchemaError on open if existing files use another schema major version.
    """

    def __init__(self, root: Path, max_file_bytes: int = 2 * 1024 ** 3):
        self.root, self.max_file_bytes = Path(root), max_file_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        for stray in self.root.rglob("*.arrow.tmp"):  # a crash: those steps are trained again
            log.warning("removing an unclosed rollout cache part", extra={"path": str(stray)})
            stray.unlink()
        check_schema(self.root)
        self._writer = None
        self._sink = None
        self._path: Path | None = None
        self._hour: str | None = None

    def _open(self, hour: str) -> None:
        folder = self.root / hour
        folder.mkdir(parents=True, exist_ok=True)
        n = len(list(self.root.rglob("part-*.arrow"))) + 1
        self._path = folder / f"part-{n:06d}.arrow"
        self._sink = pa.OSFile(str(self._path) + ".tmp", "wb")
        self._writer = pa.ipc.new_file(self._sink, SCHEMA)
        self._hour = hour

    def append(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        hour = time.strftime("%Y-%m-%d/%H", time.gmtime())
        if self._writer is not None and hour != self._hour:
            self.close()
        if self._writer is None:
            self._open(hour)
        self._writer.write_batch(pa.RecordBatch.from_pylist(rows, schema=SCHEMA))
        if self._sink.tell() >= self.max_file_bytes:
            self.close()

    def truncate_after(self, step: int) -> int:
        """Drop rows of steps after `step` (a learner resumed from an earlier checkpoint trains
        them again). Rewrites only the parts that hold such rows; returns rows dropped."""
        import pyarrow.compute as pc

        dropped = 0
        for f in sorted(self.root.rglob("*.arrow")):
            with pa.memory_map(str(f)) as src:
                table = pa.ipc.open_file(src).read_all()
            keep = table.filter(pc.less_equal(table.column("step"), step))
            if keep.num_rows == table.num_rows:
                continue
            dropped += table.num_rows - keep.num_rows
            tmp = Path(str(f) + ".tmp")
            with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, SCHEMA) as w:
                w.write_table(keep)
            tmp.replace(f)
        return dropped

    def close(self) -> None:
        """Finish the current part (footer written, renamed from .tmp); the next append opens a new one."""
        if self._writer is None:
            return
        self._writer.close()
        self._sink.close()
        Path(str(self._path) + ".tmp").rename(self._path)
        self._writer = self._sink = None

"""Reading a replay window: time parsing and `read_range` (steadyrl.replay, docs/replay.md)."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import cast

from confluent_kafka import Consumer, TopicPartition

from steadyrl.bus.kafka import read_ranges, reader_config, retrying
from steadyrl.wire import codec
from steadyrl.wire.contracts import Contract, ScoredGroup

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_UNITS_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_RELATIVE = re.compile(r"^-((?:\d+(?:\.\d+)?[smhdw])+)$")
_RELATIVE_PART = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_SECONDS = re.compile(r"^\d+(?:\.\d+)?$")
TIME_FORMS = ("ISO-8601 (2026-05-01T12:00:00Z; no zone: UTC), unix seconds (1777636800), "
              "relative (-30m, -2h, -1h30m) or now")


# ---- time -------------------------------------------------------------------------------------
def parse_time(text: str, now_ms: int | None = None) -> int:
    """Milliseconds since the epoch for `text`: ISO-8601 (UTC when it names no zone), unix
    seconds (decimals allowed), `now`, or relative to now: `-30m`, `-2h`, `-1h30m`, `-45s`, `-1d`.

    Raises:
        ValueError: none of these forms; the message says which forms are accepted.
    """
    s = text.strip()
    if now_ms is None:
        now_ms = int(time.time() * 1000)
    if not s:
        raise ValueError(f"empty time; give {TIME_FORMS}")
    if s.lower() == "now":
        return now_ms
    m = _RELATIVE.match(s)
    if m:
        secs = sum(Decimal(n) * _UNITS_S[u] for n, u in _RELATIVE_PART.findall(m.group(1)))
        return now_ms - int(secs * 1000)
    if _SECONDS.match(s):
        secs = Decimal(s)
        if secs >= 100_000_000_000:  # year 5138 in seconds: surely milliseconds
            raise ValueError(f"{s} looks like milliseconds; give unix seconds ({int(secs) // 1000})")
        return int(secs * 1000)
    if re.fullmatch(r"-\d+(?:\.\d+)?", s):
        raise ValueError(f"relative time {s!r} needs a unit: s, m, h, d or w (e.g. {s}m)")
    try:
        dt = datetime.fromisoformat(s)
    except ValueError:
        raise ValueError(f"cannot read {s!r} as a time; give {TIME_FORMS}") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return (dt - _EPOCH) // timedelta(milliseconds=1)


def format_ms(ms: int | None) -> str:
    """`2026-05-01T12:00:00.123Z` (UTC, milliseconds), or `-` for None."""
    if ms is None:
        return "-"
    dt = _EPOCH + timedelta(milliseconds=ms)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms % 1000:03d}Z"


# ---- reading ----------------------------------------------------------------------------------
@dataclass
class Record:
    """One decoded record of the window."""

    partition: int
    offset: int
    timestamp_ms: int
    group: ScoredGroup


@dataclass
class Window:
    """What `read_range` read: records in time order (timestamp, partition, offset)."""

    topic: str
    t_from_ms: int
    t_to_ms: int
    records: list[Record]
    ranges: dict[int, tuple[int, int]]          # partition -> [start, end) offsets read
    undecodable: dict[str, int] = field(default_factory=dict)   # DLQ reason -> records skipped
    outside: int = 0                            # in the offset range, timestamp outside [T1, T2]

    @property
    def skipped(self) -> int:
        return sum(self.undecodable.values())


def read_range(bootstrap: str, topic: str, t_from_ms: int, t_to_ms: int, timeout_s: float = 30.0) -> Window:
    """Every committed `ScoredGroup` of `topic` whose timestamp is in [t_from_ms, t_to_ms].

    Per partition: start = offsets_for_times(T1), end = offsets_for_times(T2 + 1) or, when no
    record is that late, the end offset seen now (read_committed: the last stable offset, so
    the records of a transaction still open, or whose commit marker the broker has not yet
    written, are not part of the window). Reads until each partition's position has
    passed its end: an end offset that is a transaction marker is never delivered, and
    read_committed skips aborted records, so counting records would never finish.

    Raises:
        RuntimeError: the topic does not exist, or the range was not read within timeout_s.
        ValueError: t_from_ms > t_to_ms.
    """
    read = read_contracts(bootstrap, topic, t_from_ms, t_to_ms, ScoredGroup, timeout_s)
    records = [Record(part, off, ts, cast(ScoredGroup, g)) for part, off, ts, g in read.records]
    return Window(topic, t_from_ms, t_to_ms, records, read.ranges, read.undecodable, read.outside)


@dataclass
class Read:
    """What `read_contracts` read: (partition, offset, timestamp_ms, record) in time order."""

    records: list[tuple[int, int, int, Contract]]
    ranges: dict[int, tuple[int, int]]
    undecodable: dict[str, int]
    outside: int


def read_contracts(bootstrap: str, topic: str, t_from_ms: int, t_to_ms: int, contract: type[Contract],
                   timeout_s: float = 30.0) -> Read:
    """Every committed record of `topic` that decodes as `contract`, timestamp in [t_from_ms,
    t_to_ms]: `read_range`'s reading for any contract (rl.episodes' EpisodeState, say). Raises
    as `read_range`."""
    if t_from_ms > t_to_ms:
        raise ValueError(f"window starts ({format_ms(t_from_ms)}) after it ends ({format_ms(t_to_ms)})")
    c = Consumer(reader_config(bootstrap, "replay-cli"))
    records: list[tuple[int, int, int, Contract]] = []
    undecodable: dict[str, int] = {}
    outside = 0
    ranges: dict[int, tuple[int, int]] = {}
    try:
        md = c.list_topics(topic, timeout=timeout_s).topics.get(topic)
        if md is None or md.error is not None:
            raise RuntimeError(f"topic {topic} not found" + (f": {md.error}" if md is not None else ""))
        parts = sorted(md.partitions)
        starts = retrying(c.offsets_for_times, [TopicPartition(topic, p, t_from_ms) for p in parts], timeout_s)
        ends = retrying(c.offsets_for_times, [TopicPartition(topic, p, t_to_ms + 1) for p in parts], timeout_s)
        for s, e in zip(starts, ends, strict=True):
            if s.error or e.error:
                raise RuntimeError(f"{topic} [{s.partition}]: offsets_for_times failed: {s.error or e.error}")
            high = retrying(c.get_watermark_offsets, TopicPartition(topic, s.partition), timeout_s)[1]
            start = s.offset if s.offset >= 0 else high   # -1: no record at or after T1
            end = e.offset if e.offset >= 0 else high     # -1: no record after T2
            if start < end:
                ranges[s.partition] = (start, end)
        for m in read_ranges(c, topic, ranges, timeout_s):
            ts = m.timestamp()[1]
            if not t_from_ms <= ts <= t_to_ms:
                outside += 1
                continue
            try:
                g = codec.decode(m.value(), m.headers(), contract)
            except codec.Rejected as rej:
                undecodable[rej.reason.value] = undecodable.get(rej.reason.value, 0) + 1
                continue
            # read_ranges yields only messages of its ranges: partition and offset are set
            records.append((cast(int, m.partition()), cast(int, m.offset()), ts, g))
    finally:
        c.close()
    records.sort(key=lambda r: (r[2], r[0], r[1]))
    return Read(records, ranges, undecodable, outside)

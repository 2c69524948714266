"""Replay a time range of a scored topic: read it, optionally re-score it, report the reward shift.

    steadyrl replay --topic rl.scored --from -30m --to now [--rescore SPEC] [--to-topic T]

`read_range` finds the window's offsets per partition with `offsets_for_times` (start: the
first offset whose timestamp is >= T1; end: the first offset whose timestamp is > T2, else
the end offset) and reads them read_committed: aborted transactions are never seen, and the
window is what is committed at the call (a read_committed client's end offset is the last
stable offset, so a transaction still open is not waited for). Records that do not decode
as `ScoredGroup` are skipped and counted; so are records inside the offset range whose own
timestamp lies outside [T1, T2] (a producer's clock out of order). Both bounds are
inclusive, in milliseconds.

Then one of two comparisons (`shift_report`), each with the two-sample Kolmogorov-Smirnov
statistic and p-value (scipy `ks_2samp`, two-sided), mean, std (population) and their
changes:

- `--rescore SPEC`: the recorded rewards against the same samples scored again in-process by
  `steadyrl.scorers.build_scorer(SPEC)` (a rule, `module:function`, `rm:<dir>`,
  `embedding:all-minilm-l6-v2`), with the N largest per-sample changes and the mean change
  per recorded scorer. Answers "would another scorer have given these samples other rewards?".
- no `--rescore`: the window's first half against its second half, in time order (split at
  the median record), so drift inside the window is visible.

Every report also lists which scorers produced the window's rewards, in time order
(`scorer_timeline`): a scorer change shows there as a new segment. `plot` draws the two
distributions (histogram and empirical CDFs, the KS distance marked) to a PNG; `republish`
writes the (re-scored) groups to another topic in one Kafka transaction, for reprocessing,
each with its original timestamp.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any, Sequence

from steadyrl import codec
from steadyrl.contracts import RewardSource, ScoredGroup

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
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
        dt = dt.replace(tzinfo=timezone.utc)
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
    from confluent_kafka import Consumer, TopicPartition

    from steadyrl.bus.kafka import read_ranges, reader_config, retrying

    if t_from_ms > t_to_ms:
        raise ValueError(f"window starts ({format_ms(t_from_ms)}) after it ends ({format_ms(t_to_ms)})")
    c = Consumer(reader_config(bootstrap, "replay-cli"))
    records: list[Record] = []
    undecodable: dict[str, int] = {}
    outside = 0
    try:
        md = c.list_topics(topic, timeout=timeout_s).topics.get(topic)
        if md is None or md.error is not None:
            raise RuntimeError(f"topic {topic} not found" + (f": {md.error}" if md is not None else ""))
        parts = sorted(md.partitions)
        starts = retrying(c.offsets_for_times, [TopicPartition(topic, p, t_from_ms) for p in parts], timeout_s)
        ends = retrying(c.offsets_for_times, [TopicPartition(topic, p, t_to_ms + 1) for p in parts], timeout_s)
        ranges: dict[int, tuple[int, int]] = {}
        for s, e in zip(starts, ends):
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
                g = codec.decode(m.value(), m.headers(), ScoredGroup)
            except codec.Rejected as rej:
                undecodable[rej.reason.value] = undecodable.get(rej.reason.value, 0) + 1
                continue
            records.append(Record(m.partition(), m.offset(), ts, g))
    finally:
        c.close()
    records.sort(key=lambda r: (r.timestamp_ms, r.partition, r.offset))
    return Window(topic, t_from_ms, t_to_ms, records, ranges, undecodable, outside)


# ---- re-scoring -------------------------------------------------------------------------------
@dataclass
class _Item:
    """What a Scorer reads of one sample (the fields of the reward server's ScoreItem)."""

    data_source: str
    prompt: str
    response: str
    ground_truth: str | None
    extra_info: dict[str, Any]


@dataclass
class Rescored:
    """The groups scored again: `groups[i]` is `ScoredGroup` i with the new rewards, or None when
    a sample of it could not be scored (its errors are in `errors`)."""

    scorer_id: str
    source: RewardSource
    groups: list[ScoredGroup | None]
    errors: list[str] = field(default_factory=list)


def rescore(groups: Sequence[ScoredGroup], scorer, rule_version: str = "1", batch_size: int = 32) -> Rescored:
    """Score every sample of `groups` again with `scorer` (a spec for build_scorer, or a built
    Scorer), in-process, reading the same text the reward worker sends (the prompt's last user
    message, the response, ground_truth, data_source, extra_info).

    Raises:
        ValueError / OSError: the spec cannot be built or its model loaded.
        steadyrl.scorers.ScorerError: a model scorer failed on a batch.
    """
    from steadyrl.scorers import build_scorer

    if isinstance(scorer, str):
        scorer = build_scorer(scorer, rule_version, batch_size)
    scorer.load()
    items = [_Item(g.group.prompt.data_source, g.group.prompt_text(), s.text, g.group.prompt.ground_truth,
                   g.group.prompt.extra_info) for g in groups for s in g.group.samples]
    results = scorer.score(items) if items else []
    out: list[ScoredGroup | None] = []
    errors: list[str] = []
    i = 0
    for g in groups:
        res = results[i:i + len(g.group.samples)]
        i += len(g.group.samples)
        bad = [f"{g.prompt_id} sample {j}: {r.get('error')}" for j, r in enumerate(res) if r.get("reward") is None]
        if bad:
            errors.extend(bad)
            out.append(None)
            continue
        out.append(ScoredGroup(group=g.group, rewards=[float(r["reward"]) for r in res], reward_source=scorer.source,
                               scorer=scorer.id, reward_extra=[r.get("extra") or {} for r in res]))
    return Rescored(scorer.id, scorer.source, out, errors)


# ---- the report -------------------------------------------------------------------------------
def flat_rewards(groups: Sequence[ScoredGroup]) -> list[float]:
    """Every sample's reward, group after group."""
    return [float(r) for g in groups for r in g.rewards]


def _stats(values: Sequence[float]) -> tuple[float | None, float | None]:
    import numpy as np

    if not len(values):
        return None, None
    a = np.asarray(values, dtype=float)
    return float(a.mean()), float(a.std())


def _scorer_name(g: ScoredGroup) -> str:
    return f"{g.scorer} ({g.reward_source.value})"


def shift_report(before: Sequence[ScoredGroup], after: Sequence[ScoredGroup], *, paired: bool = False,
                 top: int = 10, labels: tuple[str, str] = ("before", "after"), text_chars: int = 60) -> dict:
    """How the rewards of `after` differ from those of `before`.

    Returns a JSON-able dict: labels, groups, n (samples), mean, std (population), delta_mean,
    delta_std, ks_statistic, ks_pvalue (None when a side is empty), scorers (samples per scorer
    id on each side). With `paired` (after[i] is before[i] scored again, same samples):
    changed (samples whose reward moved), by_recorded_scorer (per scorer id of `before`:
    samples, mean change, changed) and largest_changes, the `top` largest |after - before|:
    prompt_id, sample, before, after, delta, response (first `text_chars` characters).
    """
    from scipy.stats import ks_2samp

    b, a = flat_rewards(before), flat_rewards(after)
    (mb, sb), (ma, sa) = _stats(b), _stats(a)
    rep: dict[str, Any] = {"labels": list(labels), "groups": [len(before), len(after)], "n": [len(b), len(a)],
                           "mean": [mb, ma], "std": [sb, sa],
                           "delta_mean": None if mb is None or ma is None else ma - mb,
                           "delta_std": None if sb is None or sa is None else sa - sb,
                           "ks_statistic": None, "ks_pvalue": None, "paired": paired}
    if b and a:
        ks = ks_2samp(b, a)
        rep["ks_statistic"], rep["ks_pvalue"] = float(ks.statistic), float(ks.pvalue)
    rep["scorers"] = [_count_by(before, _scorer_name), _count_by(after, _scorer_name)]
    if paired:
        if len(before) != len(after) or any(len(x.rewards) != len(y.rewards) for x, y in zip(before, after)):
            raise ValueError("paired report needs the same groups, with the same samples, on both sides")
        changes = []
        by: dict[str, list[float]] = {}
        for k, (x, y) in enumerate(zip(before, after)):
            for j, (rb, ra) in enumerate(zip(x.rewards, y.rewards)):
                d = float(ra) - float(rb)
                by.setdefault(_scorer_name(x), []).append(d)
                changes.append((abs(d), k, j, d))
        rep["changed"] = sum(1 for c in changes if c[0] > 0)
        rep["by_recorded_scorer"] = {name: {"n": len(ds), "mean_delta": sum(ds) / len(ds),
                                            "changed": sum(1 for d in ds if d != 0)} for name, ds in by.items()}
        changes.sort(key=lambda c: (-c[0], c[1], c[2]))   # largest first; ties in time order
        rep["largest_changes"] = [
            {"prompt_id": before[k].prompt_id, "sample": j, "before": float(before[k].rewards[j]),
             "after": float(after[k].rewards[j]), "delta": d,
             "response": _clip(before[k].group.samples[j].text, text_chars)}
            for _, k, j, d in changes[:top] if d != 0]
    return rep


def _count_by(groups: Sequence[ScoredGroup], key) -> dict[str, int]:
    out: dict[str, int] = {}
    for g in groups:
        out[key(g)] = out.get(key(g), 0) + len(g.rewards)
    return out


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n - 1] + "…"


def scorer_timeline(records: Sequence[Record]) -> list[dict]:
    """Runs of consecutive records (time order) scored by the same scorer and reward source:
    scorer, source, first_ms, last_ms, groups, samples, mean (reward)."""
    segs: list[dict] = []
    for r in records:
        g = r.group
        if segs and segs[-1]["scorer"] == g.scorer and segs[-1]["source"] == g.reward_source.value:
            s = segs[-1]
        else:
            s = {"scorer": g.scorer, "source": g.reward_source.value, "first_ms": r.timestamp_ms,
                 "last_ms": r.timestamp_ms, "groups": 0, "samples": 0, "_sum": 0.0}
            segs.append(s)
        s["last_ms"] = r.timestamp_ms
        s["groups"] += 1
        s["samples"] += len(g.rewards)
        s["_sum"] += sum(g.rewards)
    for s in segs:
        s["mean"] = s.pop("_sum") / s["samples"] if s["samples"] else None
    return segs


def halves(records: Sequence[Record]) -> tuple[list[Record], list[Record]]:
    """The window's records split at the median record, in time order (first half: n // 2)."""
    k = len(records) // 2
    return list(records[:k]), list(records[k:])


def build_report(window: Window, rescored: Rescored | None = None, top: int = 10) -> dict:
    """The whole replay report (JSON-able): the window, what was read, the scorer timeline and
    the shift (`mode` rescore: recorded vs re-scored; halves: first vs second half).
    `_before` / `_after` hold the two reward lists for `plot` (drop them before writing JSON)."""
    groups = [r.group for r in window.records]
    rep: dict[str, Any] = {
        "topic": window.topic, "from": format_ms(window.t_from_ms), "to": format_ms(window.t_to_ms),
        "from_ms": window.t_from_ms, "to_ms": window.t_to_ms,
        "partitions": {str(p): list(r) for p, r in sorted(window.ranges.items())},
        "groups": len(groups), "samples": sum(len(g.rewards) for g in groups),
        "undecodable": window.undecodable, "outside_window": window.outside,
        "scorer_timeline": scorer_timeline(window.records),
    }
    if rescored is not None:
        keep = [k for k, g in enumerate(rescored.groups) if g is not None]
        before = [groups[k] for k in keep]
        after = [rescored.groups[k] for k in keep]
        rep["mode"] = "rescore"
        rep["rescore"] = {"scorer": rescored.scorer_id, "source": rescored.source.value,
                          "groups_not_scored": len(groups) - len(keep), "errors": rescored.errors[:20]}
        rep["shift"] = shift_report(before, after, paired=True, top=top,
                                    labels=("recorded", f"rescored {rescored.scorer_id}"))
    else:
        first, second = halves(window.records)
        before, after = [r.group for r in first], [r.group for r in second]
        rep["mode"] = "halves"
        rep["split_ms"] = second[0].timestamp_ms if second else None
        rep["split"] = format_ms(rep["split_ms"])
        rep["shift"] = shift_report(before, after, top=top, labels=("first half", "second half"))
    rep["_before"], rep["_after"] = flat_rewards(before), flat_rewards(after)
    return rep


def _f(v: float | None, fmt: str = ".4f") -> str:
    return "-" if v is None else format(v, fmt)


def format_report(rep: dict) -> str:
    """The report as text, for people."""
    sh = rep["shift"]
    lines = [f"replay of {rep['topic']} from {rep['from']} to {rep['to']}"]
    parts = rep["partitions"]
    bad = rep["undecodable"]
    lines.append(f"  read {rep['groups']} groups ({rep['samples']} samples) from {len(parts)} partition(s)"
                 + (f" (offsets {', '.join(f'{p}: [{a}, {b})' for p, (a, b) in parts.items())})" if parts else "")
                 + f"; skipped {sum(bad.values())} that did not decode as scored_group"
                 + (f" ({', '.join(f'{k} {v}' for k, v in bad.items())})" if bad else "")
                 + f" and {rep['outside_window']} stamped outside the window")
    tl = rep["scorer_timeline"]
    if tl:
        lines.append("scorers, in time order:")
        width = max(len(f"{s['scorer']} ({s['source']})") for s in tl[:20])
        for s in tl[:20]:
            lines.append(f"  {format_ms(s['first_ms'])} .. {format_ms(s['last_ms'])}  "
                         f"{(s['scorer'] + ' (' + s['source'] + ')'):<{width}}  {s['groups']:5d} groups  "
                         f"reward mean {_f(s['mean'], '.3f')}")
        if len(tl) > 20:
            lines.append(f"  ... {len(tl) - 20} more segments (see --json)")
    if rep["mode"] == "rescore":
        rs = rep["rescore"]
        lines.append(f"shift: recorded rewards -> the same samples rescored with {rs['scorer']} ({rs['source']})"
                     + (f"; {rs['groups_not_scored']} groups could not be rescored, e.g. {rs['errors'][0]}"
                        if rs["groups_not_scored"] else ""))
    else:
        lines.append(f"shift: first half of the window -> second half (time order, split at {rep['split']})")
    lab = sh["labels"]
    w = max(12, *(len(x) for x in lab))
    lines.append(f"  {'':<{w}}  {'groups':>7}  {'samples':>7}  {'mean':>8}  {'std':>8}")
    for i in (0, 1):
        lines.append(f"  {lab[i]:<{w}}  {sh['groups'][i]:7d}  {sh['n'][i]:7d}  {_f(sh['mean'][i]):>8}  "
                     f"{_f(sh['std'][i]):>8}")
    lines.append(f"  {'change':<{w}}  {'':7}  {'':7}  {_f(sh['delta_mean'], '+.4f'):>8}  "
                 f"{_f(sh['delta_std'], '+.4f'):>8}")
    if sh["ks_statistic"] is None:
        lines.append("  KS: not computed (a side has no samples)")
    else:
        lines.append(f"  KS statistic {sh['ks_statistic']:.4f}, p-value {sh['ks_pvalue']:.3g} "
                     f"(two-sample Kolmogorov-Smirnov, two-sided)")
    if sh.get("paired"):
        lines.append(f"  {sh['changed']} of {sh['n'][0]} samples changed reward; by recorded scorer:")
        for name, d in sh["by_recorded_scorer"].items():
            lines.append(f"    {name}: {d['n']} samples, mean change {d['mean_delta']:+.4f}, {d['changed']} changed")
        if sh["largest_changes"]:
            lines.append(f"largest changes ({len(sh['largest_changes'])}):")
            pw = max(9, *(len(c["prompt_id"]) for c in sh["largest_changes"]))
            lines.append(f"  {'prompt_id':<{pw}}  sample  {'before':>7}  {'after':>7}  {'delta':>7}  response")
            for c in sh["largest_changes"]:
                lines.append(f"  {c['prompt_id']:<{pw}}  {c['sample']:6d}  {c['before']:7.3f}  {c['after']:7.3f}  "
                             f"{c['delta']:+7.3f}  {c['response']!r}")
    else:
        for i in (0, 1):
            if sh["scorers"][i]:
                lines.append(f"  {lab[i]} scored by: " + ", ".join(f"{k} x{v}" for k, v in sh["scorers"][i].items()))
    return "\n".join(lines)


def report_json(rep: dict) -> dict:
    """The report without the raw reward lists (what --json writes)."""
    return {k: v for k, v in rep.items() if not k.startswith("_")}


# ---- the picture ------------------------------------------------------------------------------
def _bin_edges(values):
    """Bins centred on each value when there are few distinct values (rule rewards), else ~auto."""
    import numpy as np

    u = np.unique(values)
    if len(u) == 1:
        return np.array([u[0] - 0.5, u[0] + 0.5])
    if len(u) <= 30:
        mids = (u[1:] + u[:-1]) / 2
        return np.concatenate([[u[0] - (mids[0] - u[0])], mids, [u[-1] + (u[-1] - mids[-1])]])
    edges = np.histogram_bin_edges(values, bins="auto")
    return edges if len(edges) <= 61 else np.histogram_bin_edges(values, bins=60)


def plot(before: Sequence[float], after: Sequence[float], path, labels: tuple[str, str] = ("before", "after"),
         title: str = "") -> None:
    """PNG of the two reward distributions: histogram (share of samples) and empirical CDFs with
    the KS distance (their largest vertical gap) marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    b, a = np.asarray(before, dtype=float), np.asarray(after, dtype=float)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    both = np.concatenate([b, a])
    if len(both):
        edges = _bin_edges(both)
        for v, lab, color in ((b, labels[0], "C0"), (a, labels[1], "C1")):
            if len(v):
                ax1.hist(v, bins=edges, weights=np.full(len(v), 1 / len(v)), alpha=0.45, color=color,
                         edgecolor=color, label=f"{lab} (n={len(v)})")
                xs = np.sort(v)
                ax2.step(np.concatenate([[xs[0]], xs]), np.concatenate([[0], np.arange(1, len(xs) + 1) / len(xs)]),
                         where="post", color=color, label=lab)
        if len(b) and len(a):
            grid = np.unique(both)
            fb = np.searchsorted(np.sort(b), grid, side="right") / len(b)
            fa = np.searchsorted(np.sort(a), grid, side="right") / len(a)
            i = int(np.argmax(np.abs(fb - fa)))
            ax2.vlines(grid[i], min(fb[i], fa[i]), max(fb[i], fa[i]), colors="k", linestyles="--",
                       label=f"KS D = {abs(fb[i] - fa[i]):.3f}")
    ax1.set_xlabel("reward")
    ax1.set_ylabel("share of samples")
    ax1.legend(fontsize=8)
    ax2.set_xlabel("reward")
    ax2.set_ylabel("cumulative share")
    ax2.legend(fontsize=8, loc="lower right")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_report(rep: dict, path) -> None:
    """`plot` for a `build_report` result, titled with the window and the KS figures."""
    sh = rep["shift"]
    ks = ("" if sh["ks_statistic"] is None else
          f"  KS {sh['ks_statistic']:.3f}, p {sh['ks_pvalue']:.2g}, mean {_f(sh['delta_mean'], '+.3f')}")
    plot(rep["_before"], rep["_after"], path, tuple(sh["labels"]),
         f"{rep['topic']} {rep['from']} .. {rep['to']}{ks}")


# ---- re-publishing ----------------------------------------------------------------------------
def ensure_topic(bootstrap: str, topic: str, like: str = "rl.scored", timeout_s: float = 30.0) -> str:
    """Create `topic` with the catalogue settings of `like` (partitions, retention, max record
    size) when it is missing; returns "created" or "exists". The broker does not auto-create."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic

    from steadyrl.topics import load_catalogue

    admin = AdminClient({"bootstrap.servers": bootstrap})
    if topic in admin.list_topics(timeout=timeout_s).topics:
        return "exists"
    spec = load_catalogue()[like]
    fut = admin.create_topics([NewTopic(topic, num_partitions=spec.partitions, replication_factor=1,
                                        config=spec.configs())], operation_timeout=timeout_s)[topic]
    try:
        fut.result()
    except KafkaException as e:
        if e.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
            raise
        return "exists"
    return "created"


def republish(bootstrap: str, topic: str, groups: Sequence[ScoredGroup], sources: Sequence[Record] | None = None,
              source_topic: str = "", timeout_s: float = 120.0) -> int:
    """Produce `groups` to `topic` (key: prompt_id) in one Kafka transaction: all land for
    read_committed readers, or, on any error, the transaction is aborted and the error raised.
    With `sources` (the records they came from, same order) each record keeps its source's
    timestamp, so the same window can be replayed from `topic`, and carries a header
    `replay_of: <source_topic>:<partition>:<offset>`. Returns the number produced.
    The topic must exist (`ensure_topic`)."""
    from confluent_kafka import KafkaException, Producer

    from steadyrl.bus.kafka import producer_config

    cfg = producer_config(bootstrap, "replay-cli", f"replay-cli-{uuid.uuid4().hex}")
    # one transaction for the whole replay: longer than a worker's 30 s batch
    cfg["transaction.timeout.ms"] = cfg["message.timeout.ms"] = int(timeout_s * 1000)
    p = Producer(cfg)
    errors: list = []

    def on_delivery(err, msg):
        if err is not None:
            errors.append(err)

    p.init_transactions(30)
    p.begin_transaction()
    try:
        for i, g in enumerate(groups):
            value, headers = codec.encode(g)
            ts = {}
            if sources is not None:
                src = sources[i]
                headers.append(("replay_of", f"{source_topic}:{src.partition}:{src.offset}".encode()))
                ts = {"timestamp": src.timestamp_ms}
            while True:
                try:
                    p.produce(topic, value, key=g.prompt_id, headers=headers, on_delivery=on_delivery, **ts)
                    break
                except BufferError:  # local queue full: let deliveries drain
                    p.poll(0.5)
            p.poll(0)
        p.flush(timeout_s)
        if errors:
            raise KafkaException(errors[0])
        p.commit_transaction(timeout_s)
    except Exception:
        p.abort_transaction(30)
        raise
    return len(groups)

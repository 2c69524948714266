"""Re-scoring a window and the reward-shift report (steadyrl.replay, docs/replay.md)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from steadyrl.model.scorers import Scorer, build_scorer
from steadyrl.replay.window import Record, Window, format_ms
from steadyrl.wire.contracts import RewardSource, ScoredGroup


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


def rescore(groups: Sequence[ScoredGroup], scorer: str | Scorer, rule_version: str = "1",
            batch_size: int = 32) -> Rescored:
    """Score every sample of `groups` again with `scorer` (a spec for build_scorer, or a built
    Scorer), in-process, reading the same text the reward worker sends (the prompt's last user
    message, the response, ground_truth, data_source, extra_info).

    Raises:
        ValueError / OSError: the spec cannot be built or its model loaded.
        steadyrl.model.scorers.ScorerError: a model scorer failed on a batch.
    """
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
    if not len(values):
        return None, None
    a = np.asarray(values, dtype=float)
    return float(a.mean()), float(a.std())


def _scorer_name(g: ScoredGroup) -> str:
    return f"{g.scorer} ({g.reward_source.value})"


def shift_report(before: Sequence[ScoredGroup], after: Sequence[ScoredGroup], *, paired: bool = False,
                 top: int = 10, labels: tuple[str, str] = ("before", "after"), text_chars: int = 60) -> dict[str, Any]:
    """How the rewards of `after` differ from those of `before`.

    Returns a JSON-able dict: labels, groups, n (samples), mean, std (population), delta_mean,
    delta_std, ks_statistic, ks_pvalue (None when a side is empty), scorers (samples per scorer
    id on each side). With `paired` (after[i] is before[i] scored again, same samples):
    changed (samples whose reward moved), by_recorded_scorer (per scorer id of `before`:
    samples, mean change, changed) and largest_changes, the `top` largest |after - before|:
    prompt_id, sample, before, after, delta, response (first `text_chars` characters).
    """
    from scipy.stats import ks_2samp  # lazy: heavy (scipy), only the shift's KS test needs it

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
        if len(before) != len(after) or any(len(x.rewards) != len(y.rewards)
                                            for x, y in zip(before, after, strict=True)):
            raise ValueError("paired report needs the same groups, with the same samples, on both sides")
        changes = []
        by: dict[str, list[float]] = {}
        for k, (x, y) in enumerate(zip(before, after, strict=True)):
            for j, (rb, ra) in enumerate(zip(x.rewards, y.rewards, strict=True)):
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


def _count_by(groups: Sequence[ScoredGroup], key: Callable[[ScoredGroup], str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for g in groups:
        out[key(g)] = out.get(key(g), 0) + len(g.rewards)
    return out


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n - 1] + "…"


def scorer_timeline(records: Sequence[Record]) -> list[dict[str, Any]]:
    """Runs of consecutive records (time order) scored by the same scorer and reward source:
    scorer, source, first_ms, last_ms, groups, samples, mean (reward)."""
    segs: list[dict[str, Any]] = []
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


def build_report(window: Window, rescored: Rescored | None = None, top: int = 10) -> dict[str, Any]:
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
        after = [g for g in rescored.groups if g is not None]   # the groups of `keep`, in order
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


def format_report(rep: dict[str, Any]) -> str:
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


def report_json(rep: dict[str, Any]) -> dict[str, Any]:
    """The report without the raw reward lists (what --json writes)."""
    return {k: v for k, v in rep.items() if not k.startswith("_")}

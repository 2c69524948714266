"""Where a run stands, read in one place: the learner's `GET /progress` and a service's
`/metrics` over HTTP, and the run folder's files (steadyrl.run.runfolder.RunDir) as one `RunView`.
`steadyrl status`, the live panel of `steadyrl up` (steadyrl/cli/panel.py) and the Python API
(steadyrl.api.Run) read through these, so what each shows is the same figure.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from steadyrl.run.runfolder import Counts, RunDir

#: (sample name, frozenset of (label, value)) -> value, as `parse_metrics` reads a /metrics page.
Metrics = dict[tuple[str, frozenset[tuple[str, str]]], float]

#: The name the summary gives the evaluation on `learner.eval_data` ("test accuracy"); the
#: harder splits go by their own names.
MAIN_SPLIT = "test"


def _get(url: str, http: httpx.Client | None, timeout_s: float) -> httpx.Response | None:
    try:
        return http.get(url) if http is not None else httpx.get(url, timeout=timeout_s)
    except httpx.HTTPError:
        return None


def fetch_progress(url: str, http: httpx.Client | None = None, timeout_s: float = 2.0) -> dict[str, Any]:
    """The learner's `GET <url>/progress` (run_id, phase, step, steps, reward_mean, tokens_per_s,
    done, ...); {} while it does not answer, answers other than 200, or not with a JSON object."""
    r = _get(f"{url}/progress", http, timeout_s)
    if r is None or r.status_code != 200:
        return {}
    try:
        p = r.json()
    except ValueError:
        return {}
    return dict(p) if isinstance(p, dict) else {}


def parse_metrics(text: str) -> Metrics:
    """Prometheus text -> {(sample name, frozenset(labels)): value}."""
    out: Metrics = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def fetch_metrics(url: str, http: httpx.Client | None = None, timeout_s: float = 2.0) -> Metrics:
    """A service's `GET <url>/metrics` as {(name, frozenset of labels): value}; {} while it
    does not answer."""
    r = _get(f"{url}/metrics", http, timeout_s)
    if r is None or r.status_code != 200:
        return {}
    try:
        return dict(parse_metrics(r.text))
    except ValueError:
        return {}


def eta_s(step: int, steps: int | None, history: list[dict[str, Any]], window: int = 10) -> float | None:
    """Seconds until step `steps`: the steps left times the median wall time of the last
    `window` steps (history rows' "seconds"); None before a step, or without a total."""
    seconds = [float(h["seconds"]) for h in history[-window:] if h.get("seconds") is not None]
    if steps is None or not seconds:
        return None
    return max(steps - step, 0) * statistics.median(seconds)


@dataclass
class RunView:
    """One run of a `steadyrl up` state dir as its files and its learner say (see `read_run`)."""

    run_id: str
    path: Path
    step: int
    finished: bool
    live: dict[str, Any]                     # /progress of this run; {} when the learner is not answering
    history: list[dict[str, Any]]
    checkpoint: str | None                   # checkpoints/LATEST
    counts: Counts
    in_flight: int
    held: int                                # batches the reward watch holds
    evals: dict[str, dict[str, float]] = field(default_factory=dict)   # split -> {"before"/"after": accuracy}

    @property
    def steps(self) -> int | None:
        """The run's total steps (the learner's /progress says it; None while it does not answer)."""
        steps = self.live.get("steps")
        return int(steps) if steps is not None else None

    @property
    def phase(self) -> str | None:
        """The learner's phase (starting, eval before, waiting, training, eval after, done); None
        while it does not answer."""
        phase = self.live.get("phase")
        return str(phase) if phase is not None else None

    @property
    def last(self) -> dict[str, Any] | None:
        """The last step's history row (reward_mean, seconds, time, ...); None before one."""
        return self.history[-1] if self.history else None

    @property
    def eta_s(self) -> float | None:
        """Seconds until the last step (`eta_s`); None when not known."""
        return None if self.finished else eta_s(self.step, self.steps, self.history)


def evaluations(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, dict[str, float]]:
    """split -> {"before": accuracy, "after": accuracy} from the state's eval_before/eval_after
    (`MAIN_SPLIT` for eval_data, the harder splits by name); a side not yet evaluated is absent."""
    out: dict[str, dict[str, float]] = {}
    for when, ev in (("before", before), ("after", after)):
        if not ev:
            continue
        if ev.get("accuracy") is not None:
            out.setdefault(MAIN_SPLIT, {})[when] = float(ev["accuracy"])
        for name, split in (ev.get("splits") or {}).items():
            if split.get("accuracy") is not None:
                out.setdefault(name, {})[when] = float(split["accuracy"])
    return out


def read_run(up_state_dir: str | Path, live: dict[str, Any] | None = None, run_id: str | None = None) -> RunView:
    """The run of `steadyrl up --state-dir up_state_dir` (`run_id`, else the one CURRENT names),
    with `live` (the learner's /progress) kept only when it is of that run. Raises
    FileNotFoundError (no run yet, no state.json), ValueError (an unreadable state.json)."""
    run = RunDir.of_up(up_state_dir, run_id)
    step = run.step
    live = live if live and live.get("run_id") == run.run_id else {}
    latest = run.checkpoints / "LATEST"
    try:
        checkpoint = latest.read_text().strip() or None
    except FileNotFoundError:
        checkpoint = None
    return RunView(run_id=run.run_id, path=run.path, step=step, finished=run.finished, live=live,
                   history=run.history, checkpoint=checkpoint, counts=run.counts,
                   in_flight=len(run.state.get("in_flight", {})), held=len(run.quarantined),
                   evals=evaluations(run.state.get("eval_before"), run.state.get("eval_after")))

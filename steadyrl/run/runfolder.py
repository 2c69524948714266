"""A learner run's folder: its layout, the names of its counters (`Count`), and the one reader
(`RunDir`).

A learner keeps each run in `<state_dir>/<run_id>/` (`state_dir` is the learner's
`--learner.state-dir`; under `steadyrl up` it is `<up state dir>/learner`):

    state.json       RunState: run_id, config, train, step, policy_uri, policy_sha256, offsets,
                     release_offsets, dlq_offset, feeder_position, fed, gate, in_flight, requeue, quarantined,
                     watch, counts, eval_before, eval_after, finished (before history.jsonl
                     also history and trained)
    history.jsonl    one line per step: step, reward_mean, reward_std, tokens, seconds, ...
    consumed.jsonl   the audit log: one line per trained group (step, prompt_id, topic,
                     partition, offset, policy_version, reward_mean; topic rl.scored or, for a
                     released group, rl.releases: absent in lines written before rl.releases)
    summary.json     written at the end of the run (reward per step, counts, evaluation)
    curve.png, checkpoints/, rollout-cache/

and `<state_dir>/CURRENT` names the run in progress. The learner writes these files
(services/learner/state.py) and counts under the names `Count` gives; `steadyrl up`,
`steadyrl export`, the harnesses (steadyrl.testing) and the benchmarks read them through
`RunDir`, so a renamed key or counter is renamed in one place. This module imports nothing
beyond the standard library (and steadyrl.files, which imports nothing more): the CLI may
use it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from enum import Enum, StrEnum
from pathlib import Path
from typing import Any

from steadyrl.files import read_step_lines


class Count(StrEnum):
    """What `RunState.counts` counts (its keys, as written to state.json and summary.json)."""

    stale_dropped = "stale_dropped"              # group older than max_staleness: prompt published again
    future_dropped = "future_dropped"            # group from weights a crash threw away: published again
    dlq = "dlq"                                  # prompt named on rl.dlq: published again (same id, new seed)
    dlq_ignored = "dlq_ignored"                  # rl.dlq record that did not count (learner/dlq_check.py)
    rejected = "rejected"                        # rl.scored record refused (codec, invalid tokens): to rl.dlq
    foreign = "foreign"                          # a group of another run
    duplicate = "duplicate"                      # a group already trained, held, or waiting
    released = "released"                        # a quarantined group a person let through
    released_in_flight = "released_in_flight"    # ... reaching a learner resumed from before the hold
    release_on_scored = "release_on_scored"      # an rl.scored group with the release header: not a release
    quarantined = "quarantined"                  # groups held on rl.quarantine
    quarantined_batches = "quarantined_batches"
    evicted = "evicted"                          # groups evicted from the full train buffer
    cache_scored = "cache_scored"                # trained groups scored from the cache
    oom_fallback = "oom_fallback"                # steps retried in the safe mode
    reward_watch_alerts = "reward_watch_alerts"
    reward_watch_rebaselined = "reward_watch_rebaselined"
    abandoned = "abandoned"                      # prompts refused past their budget: never trained, replaced
    republished = "republished"                  # prompts in flight too long (records lost): published again
    bad_rows = "bad_rows"                        # dataset rows left out (services/learner/rows.py)
    bad_eval_rows = "bad_eval_rows"              # evaluation rows left out (services/learner/rows.py)
    flat_reward_steps = "flat_reward_steps"      # steps whose groups all scored alike: no signal (learner/flat.py)


#: Every key the learner writes into `state.json`'s "counts". A name outside this list read
#: through `Counts` raises instead of reading as 0.
COUNT_KEYS = tuple(c.value for c in Count)


def _name(key: str | Enum) -> str:
    """A count's name: the string itself, or an enum member's value."""
    if isinstance(key, Enum):
        name: str = key.value
        return name
    return key


class Counts(Mapping[str, int]):
    """A run's counts as the learner names them (`COUNT_KEYS`).

    A known count the learner never incremented reads 0; a name it never writes (a typo,
    such as "stale" for "stale_dropped") raises KeyError, through `[]` and `get` alike, so a
    harness cannot report a silent 0. Keys may be strings or enum members with those values.
    Iterating gives the counts recorded in the file (unknown ones included, as written).
    """

    def __init__(self, raw: Mapping[str, int] | None = None):
        self._raw = {str(_name(k)): int(v) for k, v in (raw or {}).items()}

    def __getitem__(self, key: str | Enum) -> int:
        name = _name(key)
        if name in self._raw:
            return self._raw[name]
        if name in COUNT_KEYS:
            return 0
        raise KeyError(f"{name!r} is not a learner count (known: {', '.join(COUNT_KEYS)})")

    def get(self, key: str | Enum, default: object = None) -> int:
        """Like `self[key]`: a known count is always there (0 when never counted) and an unknown
        name raises KeyError; `default` is taken for Mapping's signature and never returned."""
        return self[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)

    def __repr__(self) -> str:
        return f"Counts({self._raw!r})"

    def line(self) -> str:
        """The non-zero counts as "name n, name n" by name ("" when all are zero or none)."""
        return ", ".join(f"{k} {v}" for k, v in sorted(self._raw.items()) if v)

    def as_dict(self) -> dict[str, int]:
        """The counts as recorded in state.json (absent ones are not filled in)."""
        return dict(self._raw)


def current(state_dir: str | Path) -> str | None:
    """The run id `<state_dir>/CURRENT` names, or None when there is none (no run started yet)."""
    try:
        return (Path(state_dir) / "CURRENT").read_text().strip() or None
    except FileNotFoundError:
        return None


def run_ids(state_dir: str | Path) -> list[str]:
    """Names of the run folders under the learner's `state_dir`, sorted (= by start time)."""
    d = Path(state_dir)
    return sorted(p.name for p in d.iterdir() if p.is_dir()) if d.is_dir() else []


def run_finished(state_dir: str | Path) -> bool:
    """Whether the run CURRENT names is marked finished in its state.json. False when anything
    is missing or unreadable (no CURRENT, no state.json yet, a torn file): what `steadyrl up`
    asks when the learner exits 0 (done, or only stopped from outside?)."""
    try:
        run = RunDir(state_dir)
        return bool(run.state["finished"])
    except (OSError, ValueError, KeyError):
        return False


class RunDir:
    """One learner run's folder, read on demand.

    Args:
        state_dir: the learner's state dir (the one holding CURRENT and the run folders).
        run_id: the run to read; None: the one CURRENT names.

    Raises:
        FileNotFoundError: run_id is None and there is no CURRENT.

    `state` (and what is derived from it) is read from disk on first use and kept; call
    `reload()` to read a run that is still going.
    """

    def __init__(self, state_dir: str | Path, run_id: str | None = None):
        self.state_dir = Path(state_dir)
        if run_id is None:
            run_id = current(self.state_dir)
            if run_id is None:
                raise FileNotFoundError(f"no run in {self.state_dir}: {self.state_dir / 'CURRENT'} is missing")
        self.run_id = run_id
        self.path = self.state_dir / run_id
        self._state: dict[str, Any] | None = None

    @classmethod
    def of_up(cls, up_state_dir: str | Path, run_id: str | None = None) -> RunDir:
        """The run of `steadyrl up --state-dir up_state_dir` (its learner state is `learner/`)."""
        return cls(Path(up_state_dir) / "learner", run_id)

    def __repr__(self) -> str:
        return f"RunDir({str(self.state_dir)!r}, {self.run_id!r})"

    # ---- state.json -------------------------------------------------------------------------
    def reload(self) -> RunDir:
        """Forget what was read, so the next access reads the files again. Returns self."""
        self._state = None
        return self

    @property
    def state(self) -> dict[str, Any]:
        """state.json as written (RunState's fields)."""
        if self._state is None:
            self._state = json.loads((self.path / "state.json").read_text())
        return self._state

    @property
    def step(self) -> int:
        """The last step trained (0 before the first)."""
        return int(self.state.get("step", 0))

    @property
    def finished(self) -> bool:
        """Whether the learner marked the run finished."""
        return bool(self.state.get("finished", False))

    @property
    def counts(self) -> Counts:
        """The run's counts, with the learner's own key names (see `Counts`)."""
        return Counts(self.state.get("counts"))

    @property
    def history(self) -> list[dict[str, Any]]:
        """Per step: step, reward_mean, reward_std, tokens, seconds, policy_versions, ...
        (history.jsonl; a run written before it: state.json's "history"), steps <= the saved
        step's only (a row appended just before a crash is not yet the run's)."""
        path = self.path / "history.jsonl"
        if not path.exists():
            return list(self.state.get("history", []))
        rows, _ = read_step_lines(path)
        by_step = {row["step"]: row for row in rows if row["step"] <= self.step}
        return [by_step[k] for k in sorted(by_step)]

    @property
    def quarantined(self) -> dict[str, dict[str, Any]]:
        """Prompts held by the reward watch: prompt_id -> what the learner keeps of it."""
        return dict(self.state.get("quarantined", {}))

    @property
    def policy_uri(self) -> str:
        """The newest policy version, relative to the policy root (a Hugging Face folder; a legacy
        run: a .safetensors file)."""
        uri: str = self.state.get("policy_uri", "")
        return uri

    # ---- the other files --------------------------------------------------------------------
    def consumed(self) -> list[dict[str, Any]]:
        """The audit log (consumed.jsonl), one dict per trained group, in file order; [] when
        nothing was trained yet."""
        try:
            text = (self.path / "consumed.jsonl").read_text()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def trained_ids(self) -> list[str]:
        """The prompt id of each line of the audit log, in order (a repeat means trained twice)."""
        return [c["prompt_id"] for c in self.consumed()]

    def summary(self) -> dict[str, Any]:
        """summary.json (written at the end of a run). Raises FileNotFoundError before then."""
        summary: dict[str, Any] = json.loads((self.path / "summary.json").read_text())
        return summary

    @property
    def curve(self) -> Path:
        """curve.png: reward per step and accuracy before/after."""
        return self.path / "curve.png"

    @property
    def checkpoints(self) -> Path:
        """The run's checkpoints/ folder (what `steadyrl ckpt verify` takes)."""
        return self.path / "checkpoints"

    @property
    def rollout_cache(self) -> Path:
        """The Arrow rollout cache (rollout-cache/<date>/<hour>/part-N.arrow)."""
        return self.path / "rollout-cache"

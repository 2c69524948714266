"""Reward watch: each batch's rewards against a reference window of earlier batches.

For a batch about to be trained, with the reference = the rewards of the last `window`
trained batches (at least `min_reference` of them, else nothing is judged):

    variance ratio   var(batch) / max(var(reference), var_floor); trips at >= `var_ratio` (3)
    extreme share    share of the batch above the reference's `quantile` (0.99) reward;
                     trips when > `extreme_share` (0.05; exactly 5 % passes)
    KS p-value       two-sample Kolmogorov-Smirnov test, batch vs reference (scipy), exported
                     as a metric only (a shift in the reward distribution, e.g. a changed scorer)

With `action: quarantine` (the default) a batch that trips a rule is not trained: the
learner writes it to `rl.quarantine`, sets the alert metric and trains on the next batch;
`steadyrl quarantine list | show | release | drop` lets a person decide. `observe` only
exports the figures and the alert; `off` judges nothing.

A held batch does not join the reference: the watch keeps comparing with what was trained.
But a shift that persists is the new normal, not a bad batch (a model's first successes on a
sparse 0/1 reward raise the variance from ~0 and put rewards above a q99 of 0). So when
`rebaseline_after` (3) of the last `rebaseline_window` (10) judged batches were held, those
held batches join the reference and the next batch is judged against it. A bad stretch
therefore costs at most a few held batches, never a stalled run; every held batch stays on
`rl.quarantine` for a person to release or drop.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator
from scipy.stats import ks_2samp


class WatchConfig(BaseModel):
    """`learner.reward_watch`: the rules' thresholds and what a trip does."""

    model_config = ConfigDict(extra="forbid")

    action: Literal["quarantine", "observe", "off"] = Field(
        "quarantine", description="quarantine: a batch that trips is held on rl.quarantine, not trained; "
                                  "observe: metrics and alert only; off: nothing is judged.")
    window: int = Field(20, ge=1, description="Trained batches in the reference.")
    min_reference: int = Field(3, ge=1, description="Reference batches needed before anything is judged.")
    var_ratio: float = Field(3.0, gt=1, description="Variance rise that trips (>=).")
    extreme_share: float = Field(0.05, ge=0, lt=1, description="Share of a batch above the reference quantile "
                                                               "that trips (>).")
    quantile: float = Field(0.99, gt=0, lt=1, description="Reference quantile marking an extreme reward.")
    var_floor: float = Field(1e-4, gt=0, description="Least reference variance used, reward units squared.")
    rebaseline_after: int = Field(3, ge=1, description="Held batches (within rebaseline_window judged ones) "
                                                       "after which they join the reference.")
    rebaseline_window: int = Field(10, ge=1, description="Judged batches over which held ones are counted.")

    @model_validator(mode="after")
    def _can_work(self) -> WatchConfig:
        if self.min_reference > self.window:
            raise ValueError(f"min_reference {self.min_reference} > window {self.window}: nothing would be judged")
        if self.rebaseline_after > self.rebaseline_window:
            raise ValueError(f"rebaseline_after {self.rebaseline_after} > rebaseline_window "
                             f"{self.rebaseline_window}: a lasting shift would be held forever")
        return self


@dataclass
class Verdict:
    """The watch's judgement of one batch (None figures: not judged, reference too short)."""

    var_ratio: float | None = None
    extreme_share: float | None = None
    ks_pvalue: float | None = None
    trips: list[str] = field(default_factory=list)   # "variance", "extremes"


class RewardWatch:
    """Rolling reference of trained batches' rewards, and the rules above (see WatchConfig)."""

    def __init__(self, cfg: WatchConfig | None = None, **overrides: Any):
        self.cfg = (cfg or WatchConfig()).model_copy(update=overrides)
        self.batches: deque[np.ndarray] = deque(maxlen=self.cfg.window)
        self.judged = 0                                     # batches judged so far
        self.held: list[tuple[int, np.ndarray]] = []        # (judged number, rewards) of recent held batches

    def judge(self, rewards: list[float]) -> Verdict:
        """Compare one batch (all its samples' rewards, (n,)) with the reference."""
        c = self.cfg
        if c.action == "off" or len(self.batches) < c.min_reference or not rewards:
            return Verdict()

        self.judged += 1
        batch, ref = np.asarray(rewards, dtype=np.float64), np.concatenate(self.batches)
        ratio = float(batch.var() / max(ref.var(), c.var_floor))
        share = float((batch > np.quantile(ref, c.quantile)).mean())
        v = Verdict(ratio, share, float(ks_2samp(batch, ref).pvalue))
        if ratio >= c.var_ratio:
            v.trips.append("variance")
        if share > c.extreme_share:
            v.trips.append("extremes")
        return v

    def add(self, rewards: list[float]) -> None:
        """Append a trained batch to the reference."""
        if rewards:
            self.batches.append(np.asarray(rewards, dtype=np.float64))

    def hold(self, rewards: list[float]) -> bool:
        """Record a held (quarantined) batch. Returns True when it made `rebaseline_after`
        held batches within the last `rebaseline_window` judged ones: they then join the
        reference (the shift persisted) and the count starts again."""
        c = self.cfg
        self.held = [(n, r) for n, r in self.held if n > self.judged - c.rebaseline_window]
        self.held.append((self.judged, np.asarray(rewards, dtype=np.float64)))
        if len(self.held) < c.rebaseline_after:
            return False
        for _, r in self.held:
            self.batches.append(r)
        self.held = []
        return True

    def state(self) -> dict[str, Any]:
        """JSON-able reference and held batches (saved with the learner's run state)."""
        return {"batches": [b.tolist() for b in self.batches], "judged": self.judged,
                "held": [[n, r.tolist()] for n, r in self.held]}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from `state()` of an earlier watch (empty: start afresh)."""
        self.batches.clear()
        for b in state.get("batches", []):
            self.batches.append(np.asarray(b, dtype=np.float64))
        self.judged = state.get("judged", 0)
        self.held = [(n, np.asarray(r, dtype=np.float64)) for n, r in state.get("held", [])]

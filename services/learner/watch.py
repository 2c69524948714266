"""Reward watch: each batch's rewards against a reference window of earlier batches.

For a batch about to be trained, with the reference = the rewards of the last `window`
batches (at least `min_reference` of them, else nothing is judged):

    variance ratio   var(batch) / max(var(reference), var_floor); trips at >= `var_ratio` (3)
    extreme share    share of the batch above the reference's `quantile` (0.99) reward;
                     trips when > `extreme_share` (0.05; exactly 5 % passes)
    KS p-value       two-sample Kolmogorov-Smirnov test, batch vs reference (scipy), exported
                     as a metric only (a shift in the reward distribution, e.g. a changed scorer)

The learner exports these per step and raises an alert metric when one trips. Quarantining
the batch (`rl.quarantine`, `steadyrl quarantine ...`) is not built yet: today the watch
observes and the batch is trained.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Verdict:
    """The watch's judgement of one batch (None figures: not judged, reference too short)."""

    var_ratio: float | None = None
    extreme_share: float | None = None
    ks_pvalue: float | None = None
    trips: list[str] = field(default_factory=list)   # "variance", "extremes"


class RewardWatch:
    """Rolling reference of trained batches' rewards, and the rules above.

    Args:
        window: batches in the reference.
        min_reference: batches needed before anything is judged.
        var_ratio: variance rise that trips (>=).
        extreme_share: share of a batch above the reference quantile that trips (>).
        quantile: the reference quantile that marks an extreme reward (0.99: the top 1 %).
        var_floor: least reference variance used (a constant reference would make any
            spread an infinite rise).
    """

    def __init__(self, window: int = 20, min_reference: int = 3, var_ratio: float = 3.0,
                 extreme_share: float = 0.05, quantile: float = 0.99, var_floor: float = 1e-4):
        self.batches: deque[np.ndarray] = deque(maxlen=window)
        self.min_reference, self.var_ratio, self.extreme_share = min_reference, var_ratio, extreme_share
        self.quantile, self.var_floor = quantile, var_floor

    def judge(self, rewards: list[float]) -> Verdict:
        """Compare one batch (all its samples' rewards) with the reference."""
        if len(self.batches) < self.min_reference or not rewards:
            return Verdict()
        from scipy.stats import ks_2samp

        batch, ref = np.asarray(rewards, dtype=np.float64), np.concatenate(self.batches)
        ratio = float(batch.var() / max(ref.var(), self.var_floor))
        share = float((batch > np.quantile(ref, self.quantile)).mean())
        v = Verdict(ratio, share, float(ks_2samp(batch, ref).pvalue))
        if ratio >= self.var_ratio:
            v.trips.append("variance")
        if share > self.extreme_share:
            v.trips.append("extremes")
        return v

    def add(self, rewards: list[float]) -> None:
        """Append a trained batch to the reference."""
        if rewards:
            self.batches.append(np.asarray(rewards, dtype=np.float64))

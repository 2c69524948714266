"""Screening a batch before it is trained: the reward watch (services/learner/watch.py) and,
when it trips, the quarantine (steadyrl/run/quarantine.py).

Released groups were judged already and a person let them through: only the others are
judged. With `reward_watch.action: quarantine` a batch that trips is written to
rl.quarantine (one record per group, key: batch id) and leaves the run; the feeder publishes
other prompts in its place. With `observe` it is trained, and the alert stays on the metrics.

A batch whose update was not finite (the trainer skipped the step: `NonFiniteStep`) goes the
same way, every group of it, with rule `non_finite` (`nonfinite`).
"""

from __future__ import annotations

import logging

from prometheus_client import Counter, Gauge

from steadyrl.rl.trainer import NonFiniteStep
from steadyrl.run.quarantine import batch_id as make_batch_id
from steadyrl.run.runfolder import Count
from steadyrl.wire.contracts import QuarantinedGroup

from .config import LearnerSection
from .intake import GROUPS
from .outbox import Outbox
from .state import Held, Ready, RunState
from .watch import RewardWatch

log = logging.getLogger("steadyrl.learner")

REWARD_WATCH = Gauge("steadyrl_learner_reward_watch", "Reward watch figures of the last batch vs the reference "
                     "window (services/learner/watch.py)", ["figure"])  # var_ratio, extreme_share, ks_pvalue
REWARD_ALERT = Gauge("steadyrl_learner_reward_alert", "1 while the last batch tripped a reward-watch rule", ["rule"])
QUARANTINED = Counter("steadyrl_learner_quarantined_batches", "Batches the reward watch held on rl.quarantine")
NONFINITE_STEPS = Counter("steadyrl_learner_nonfinite_steps", "Steps skipped because the loss or gradient norm "
                          "was not finite (weights and optimizer kept; the batch held on rl.quarantine)")
REBASELINES = Counter("steadyrl_learner_reward_watch_rebaselines", "Times held batches joined the reward watch's "
                      "reference (a shift that persisted)")


class Screen:
    """Judges batches of the train buffer against the reward watch's reference window."""

    def __init__(self, lc: LearnerSection, st: RunState, outbox: Outbox):
        self.lc, self.st, self.outbox = lc, st, outbox
        self.watch = RewardWatch(lc.reward_watch)
        self.watch.restore(st.watch)

    def held(self, take: list[str], ready: dict[str, Ready]) -> bool:
        """Judge the batch `take` (prompt ids in `ready`); True when it was held on
        rl.quarantine (its groups removed from `ready` and from the run). The caller saves the
        state when True."""
        st = self.st
        fresh = [pid for pid in take if not st.in_flight[pid].released]
        rewards = [r for pid in fresh for r in ready[pid].group.rewards]
        verdict = self.watch.judge(rewards)
        figures = {"var_ratio": verdict.var_ratio, "extreme_share": verdict.extreme_share,
                   "ks_pvalue": verdict.ks_pvalue}
        for name, value in figures.items():
            if value is not None:
                REWARD_WATCH.labels(name).set(value)
        for rule in ("variance", "extremes"):
            REWARD_ALERT.labels(rule).set(1 if rule in verdict.trips else 0)
        if not verdict.trips:
            self.watch.add(rewards)
            return False
        st.count(Count.reward_watch_alerts)
        if self.lc.reward_watch.action != "quarantine":
            log.warning("reward watch: batch unlike the reference window (observing: trained)",
                        extra={"step": st.step + 1, "rules": verdict.trips, **figures})
            self.watch.add(rewards)
            return False
        self.quarantine(fresh, ready, verdict.trips, figures)
        if self.watch.hold(rewards):
            REBASELINES.inc()
            st.count(Count.reward_watch_rebaselined)
            log.warning("reward watch: the shift persisted; the held batches join the reference",
                        extra={"step": st.step + 1, "after": self.lc.reward_watch.rebaseline_after})
        return True

    def quarantine(self, pids: list[str], ready: dict[str, Ready], rules: list[str],
                   figures: dict[str, float | None]) -> str:
        """Write the groups of `pids` (in `ready`) to rl.quarantine, one record each (flushed),
        and take them out of the run. Returns the batch id."""
        st = self.st
        batch_id = make_batch_id(st.run_id, st.step + 1, pids)
        for i, pid in enumerate(pids):
            self.outbox.produce("rl.quarantine", batch_id, QuarantinedGroup(
                batch_id=batch_id, run_id=st.run_id, step=st.step + 1, index=i, count=len(pids), rules=rules,
                group=ready[pid].group, **figures))
        self.outbox.flush()  # on rl.quarantine before it leaves the run
        for pid in pids:
            del ready[pid]
            st.quarantined[pid] = Held(**st.in_flight.pop(pid).model_dump(), batch_id=batch_id)
        st.count(Count.quarantined_batches)
        st.count(Count.quarantined, len(pids))
        QUARANTINED.inc()
        GROUPS.labels("quarantined").inc(len(pids))
        log.warning("batch quarantined, not trained", extra={
            "batch_id": batch_id, "step": st.step + 1, "rules": rules, "groups": len(pids), **figures})
        return batch_id

    def nonfinite(self, batch: dict[str, Ready], err: NonFiniteStep) -> str:
        """The step on `batch` (prompt id -> its group, taken from the train buffer) was skipped
        as not finite: hold every group on rl.quarantine (rule non_finite), count and log it.
        Returns the batch id."""
        NONFINITE_STEPS.inc()
        batch_id = self.quarantine(list(batch), dict(batch), ["non_finite"], {})
        log.warning("non-finite step skipped: weights and optimizer kept, batch quarantined", extra={
            "step": err.step, "what": err.what, "value": str(err.value), "epoch": err.epoch,
            "minibatch": err.minibatch, "rolled_back": err.rolled_back, "batch_id": batch_id})
        return batch_id

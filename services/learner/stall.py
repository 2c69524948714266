"""When the learner has stalled: the rule behind /readyz's `progress` check and
`steadyrl_learner_stalled`.

Stalled means all of:

    the loop is waiting for groups or training (not loading or done),
    prompts are in flight (it is waiting for something), and
    the seconds since the last step -- or, before this process's first step, since its loop
    started waiting -- exceed max(stall_factor x the median seconds between the last 20
    steps, stall_min_s)   (learner.stall_factor 5, learner.stall_min_s 120)

or, while it evaluates (phase "eval before" or "eval after"):

    the seconds since the evaluation's last progress (a batch of rows done, or its start)
    exceed max(stall_factor x the median seconds between its last 20 batches, stall_min_s)

and the reason names where the evaluation stopped (`eval before, split test, 32 of 200
rows`). The median comes from the run's history, so a resumed learner judges with the run's
own pace; before any step the limit is stall_min_s. The gauges are computed when Prometheus
scrapes (`set_function`), so a stall shows while the loop is stuck. A loop stuck for good also
stops beating its heartbeat: /livez fails after liveness_timeout_s, and `steadyrl up` (or
Kubernetes) restarts it.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from prometheus_client import Gauge

WINDOW = 20
JUDGED = ("waiting", "training")
#: The evaluation's phases: judged by its own progress (Stall.evaluating), not by steps.
EVALUATING = ("eval before", "eval after")

STALLED = Gauge("steadyrl_learner_stalled", "1 while the learner is stalled: waiting or training, prompts in "
                "flight, and no step for longer than max(stall_factor x median step seconds, stall_min_s)")
LAST_STEP = Gauge("steadyrl_learner_last_step_timestamp_seconds", "Unix time of the last step (before this "
                  "process's first: when its loop started waiting; NaN before that)")
MEDIAN_STEP = Gauge("steadyrl_learner_median_step_seconds", "Median wall seconds between steps over the last 20 "
                    "steps of the run (NaN before the first)")


class Stall:
    """The stall rule (see the module doc) over the steps it is told of.

    Args:
        factor, min_s: learner.stall_factor and learner.stall_min_s.
        history: the run's per-step rows so far (their "seconds": time between steps).
        clock: unix seconds (tests pass a fake one).
    """

    def __init__(self, factor: float, min_s: float, history: list[dict[str, Any]],
                 clock: Callable[[], float] = time.time):
        self.factor, self.min_s, self.clock = factor, min_s, clock
        self.seconds: deque[float] = deque((float(h["seconds"]) for h in history[-WINDOW:] if "seconds" in h),
                                           maxlen=WINDOW)
        self.last_step: float | None = None      # unix time of this process's last step
        self.waiting_since: float | None = None  # when the loop first started waiting
        self.eval_seconds: deque[float] = deque(maxlen=WINDOW)   # between the evaluation's batches
        self.eval_at: float | None = None        # unix time of the evaluation's last progress
        self.eval_where = ""                     # where the evaluation is (its last progress)

    def evaluating(self, where: str, start: bool = False) -> None:
        """The evaluation progressed: a batch done, or (`start`) a split or the whole evaluation
        begins; `where` names the point reached (shown in a stall's reason)."""
        now = self.clock()
        if not start and self.eval_at is not None:
            self.eval_seconds.append(now - self.eval_at)
        self.eval_at, self.eval_where = now, where

    def waiting(self) -> None:
        """The loop starts waiting for groups (the first call counts)."""
        if self.waiting_since is None:
            self.waiting_since = self.clock()

    def stepped(self, seconds: float) -> None:
        """A step was made, `seconds` after the previous one."""
        self.seconds.append(float(seconds))
        self.last_step = self.clock()

    def since(self) -> float | None:
        """Unix time the rule counts from: the last step, else when the loop started waiting."""
        return self.last_step if self.last_step is not None else self.waiting_since

    def median(self) -> float | None:
        seconds = list(self.seconds)  # one copy: the HTTP thread reads while the loop appends
        return statistics.median(seconds) if seconds else None

    def limit_s(self) -> float:
        median = self.median()
        return max(self.factor * median, self.min_s) if median is not None else self.min_s

    def eval_limit_s(self) -> float:
        seconds = list(self.eval_seconds)
        return max(self.factor * statistics.median(seconds), self.min_s) if seconds else self.min_s

    def check(self, phase: str, in_flight: int) -> tuple[bool, str]:
        """(stalled, why): the rule for the loop in `phase` with `in_flight` prompts published."""
        if phase in EVALUATING:
            if self.eval_at is None:
                return False, f"phase {phase}: not started"
            age, limit = self.clock() - self.eval_at, self.eval_limit_s()
            stalled = age > limit
            return stalled, (f"{'stalled: ' if stalled else ''}evaluation at {self.eval_where}: {age:.0f} s since "
                             f"its last progress (limit {limit:.0f} s), phase {phase}")
        since = self.since()
        if phase not in JUDGED or since is None:
            return False, f"phase {phase}: not judged"
        age, limit = self.clock() - since, self.limit_s()
        what = "the last step" if self.last_step is not None else "waiting started"
        if in_flight <= 0:
            return False, f"no prompts in flight; {age:.0f} s since {what}"
        stalled = age > limit
        return stalled, (f"{'stalled: ' if stalled else ''}{age:.0f} s since {what} (limit {limit:.0f} s), "
                         f"{in_flight} prompts in flight, phase {phase}")

    def export(self, phase: Callable[[], str], in_flight: Callable[[], int]) -> None:
        """Compute the three gauges from this rule at every scrape."""
        nan = float("nan")
        STALLED.set_function(lambda: float(self.check(phase(), in_flight())[0]))
        LAST_STEP.set_function(lambda: s if (s := self.since()) is not None else nan)
        MEDIAN_STEP.set_function(lambda: m if (m := self.median()) is not None else nan)

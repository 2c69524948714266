"""The stall rule (services/learner/stall.py): /readyz's `progress` check and the gauges
steadyrl_learner_stalled, _last_step_timestamp_seconds and _median_step_seconds, computed at
scrape time from the same rule."""

import math
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY

from steadyrl.services.learner.main import progress_check
from steadyrl.services.learner.stall import Stall


class Clock:
    def __init__(self, t=1_000.0):
        self.t = t

    def __call__(self):
        return self.t


def test_before_the_first_step_the_limit_is_stall_min_s_from_when_waiting_started():
    clock = Clock()
    s = Stall(5, 120, [], clock)
    assert s.check("waiting", 8) == (False, "phase waiting: not judged")   # not waiting yet: nothing to count from
    s.waiting()
    clock.t += 120
    assert s.check("waiting", 8)[0] is False
    clock.t += 1
    stalled, why = s.check("waiting", 8)
    assert stalled and why.startswith("stalled: 121 s since waiting started (limit 120 s)")


def test_the_limit_is_stall_factor_times_the_median_of_the_last_20_steps():
    clock = Clock()
    s = Stall(5, 120, [{"seconds": 1000.0}] * 5 + [{"seconds": 40.0}] * 20, clock)   # only the last 20 count
    assert s.median() == 40.0 and s.limit_s() == 200.0
    s.waiting()
    s.stepped(60.0)                                                 # median of 19 x 40 and 60: 40
    clock.t += 200
    assert s.check("training", 3)[0] is False
    clock.t += 1
    assert s.check("training", 3)[0] is True
    assert Stall(5, 120, [{"seconds": 2.0}] * 3, clock).limit_s() == 120.0   # fast steps: stall_min_s holds


@pytest.mark.parametrize("phase, in_flight", [("eval before", 8), ("eval after", 8), ("done", 8), ("starting", 8),
                                              ("loading", 8), ("waiting", 0)])
def test_loading_evaluating_done_or_nothing_in_flight_is_never_a_stall(phase, in_flight):
    clock = Clock()
    s = Stall(5, 120, [], clock)
    s.waiting()
    clock.t += 10_000
    assert s.check(phase, in_flight)[0] is False


def test_readyz_progress_and_the_gauges_follow_the_rule():
    clock = Clock(1_700_000_000.0)
    stall = Stall(5, 120, [{"seconds": 30.0}], clock)
    learner = SimpleNamespace(stall=stall, progress={"phase": "waiting"},
                              state=SimpleNamespace(in_flight={"a": 1, "b": 2}))
    stall.export(lambda: learner.progress["phase"], lambda: len(learner.state.in_flight))

    def gauge(name):
        return REGISTRY.get_sample_value(name)

    assert math.isnan(gauge("steadyrl_learner_last_step_timestamp_seconds"))    # not waiting yet
    assert gauge("steadyrl_learner_median_step_seconds") == 30.0
    stall.waiting()
    stall.stepped(50.0)
    assert gauge("steadyrl_learner_last_step_timestamp_seconds") == 1_700_000_000.0
    assert gauge("steadyrl_learner_median_step_seconds") == 40.0
    assert progress_check(learner)[0] is True and gauge("steadyrl_learner_stalled") == 0.0
    clock.t += 201                                                  # limit max(5 x 40, 120) = 200
    ok, detail = progress_check(learner)
    assert not ok and "201 s since the last step (limit 200 s), 2 prompts in flight" in detail
    assert gauge("steadyrl_learner_stalled") == 1.0
    learner.progress["phase"] = "eval after"
    assert progress_check(learner)[0] is True and gauge("steadyrl_learner_stalled") == 0.0


def test_the_learner_exports_its_stall_rule_and_checkpoint_settings(make_learner):
    lrn = make_learner(stall_factor=3, stall_min_s=60, checkpoint_every=7)
    assert (lrn.stall.factor, lrn.stall.min_s) == (3, 60)
    assert REGISTRY.get_sample_value("steadyrl_learner_checkpoint_every") == 7.0
    assert REGISTRY.get_sample_value("steadyrl_learner_last_verified_checkpoint_step") == 0.0
    assert REGISTRY.get_sample_value("steadyrl_learner_stalled") == 0.0    # phase starting


def test_an_evaluation_that_stops_progressing_is_a_stall_named_where_it_stopped():
    """Issue 46: the learner's evaluation hung (a reward that never returned) and nothing said so."""
    clock = Clock()
    s = Stall(5, 120, [], clock)
    assert s.check("eval before", 0) == (False, "phase eval before: not started")
    s.evaluating("eval before, starting", start=True)
    clock.t += 119
    assert s.check("eval before", 0)[0] is False                    # before any batch: stall_min_s
    s.evaluating("eval before, split test, 0 of 96 rows", start=True)
    for done in (32, 64, 96):                                       # a batch each 40 s: limit 5 x 40 = 200
        clock.t += 40
        s.evaluating(f"eval before, split test, {done} of 96 rows")
    s.evaluating("eval before, split hard, 0 of 64 rows", start=True)
    clock.t += 200
    assert s.check("eval before", 0)[0] is False
    clock.t += 1
    stalled, why = s.check("eval before", 0)                       # prompts in flight or not
    assert stalled and why == ("stalled: evaluation at eval before, split hard, 0 of 64 rows: 201 s since its last "
                               "progress (limit 200 s), phase eval before")
    assert s.check("waiting", 0)[0] is False                        # the step rule's phases are judged by steps

"""Reward watch rules at their exact thresholds."""

import numpy as np
import pytest

from steadyrl.services.learner.watch import RewardWatch


def _watch(ref, **kw):
    w = RewardWatch(min_reference=3, **kw)
    for _ in range(3):
        w.add(ref)
    return w


REF = [0.0, 1.0] * 50          # variance 0.25, q99 = 1.0


def test_nothing_is_judged_before_the_reference_is_long_enough():
    w = RewardWatch(min_reference=3)
    w.add(REF)
    w.add(REF)
    assert w.judge([5.0] * 10).trips == [] and w.judge([5.0] * 10).var_ratio is None


def test_variance_rise_trips_at_exactly_3x():
    w = _watch(REF)
    a = np.sqrt(3 * 0.25)  # values +-a have variance exactly 3 x 0.25
    at = w.judge([0.5 - a, 0.5 + a] * 50)
    assert at.var_ratio == pytest.approx(3.0) and at.trips[:1] == ["variance"]
    below = w.judge([0.5 - a * 0.99, 0.5 + a * 0.99] * 50)
    assert "variance" not in below.trips


def test_extremes_trip_above_5_percent_of_the_batch():
    w = _watch(REF)
    five = [0.0, 1.0] * 47 + [0.5] + [2.0] * 5                 # 5 of 100 above q99: exactly 5 %
    assert w.judge(five).extreme_share == 0.05 and "extremes" not in w.judge(five).trips
    six = [0.0, 1.0] * 47 + [2.0] * 6                           # 6 %
    assert "extremes" in w.judge(six).trips


def test_ks_pvalue_sees_a_shift_and_not_a_resample():
    rng = np.random.default_rng(0)
    w = _watch(list(rng.normal(0, 1, 200)))
    assert w.judge(list(rng.normal(0, 1, 200))).ks_pvalue > 0.05
    assert w.judge(list(rng.normal(1, 1, 200))).ks_pvalue < 1e-6


def test_a_constant_reference_uses_the_variance_floor():
    w = _watch([0.0] * 64, var_floor=1e-4)
    v = w.judge([0.0] * 63 + [0.01])
    assert v.var_ratio == pytest.approx(np.var([0.0] * 63 + [0.01]) / 1e-4)


def test_held_batches_join_the_reference_at_the_third_within_ten_judged():
    w = _watch(REF)
    bad = [5.0, 0.0] * 50
    for _ in range(2):
        assert w.judge(bad).trips and not w.hold(bad)
    assert len(w.batches) == 3                      # held batches stay out of the reference
    assert w.judge(bad).trips and w.hold(bad)       # the third: the shift persisted
    assert len(w.batches) == 6 and w.held == []
    assert "extremes" not in w.judge(bad).trips     # judged against the new normal now


def test_held_batches_older_than_the_window_do_not_count():
    w = _watch(REF)
    bad = [5.0, 0.0] * 50
    w.judge(bad)
    assert not w.hold(bad)                          # judged #1
    for _ in range(8):                              # judged #2..#9, trained
        w.judge(REF)
    w.judge(bad)
    assert not w.hold(bad)                          # #10: #1 is 9 back, inside the window of 10
    w.judge(bad)                                    # #11: #1 is 10 back, outside; #10 and #11 remain
    assert not w.hold(bad) and [n for n, _ in w.held] == [10, 11]
    w.judge(bad)
    assert w.hold(bad)                              # #12: three within ten


def test_state_round_trip_gives_the_same_verdicts():
    import json

    w = _watch(REF)
    w.judge([5.0] * 10)
    w.hold([5.0] * 10)
    w2 = RewardWatch()
    w2.restore(json.loads(json.dumps(w.state())))
    batch = [0.0, 0.5, 1.0, 3.0] * 10
    assert w2.judge(batch) == w.judge(batch) and w2.judged == w.judged and len(w2.held) == 1


def test_action_off_judges_nothing():
    w = _watch(REF, action="off")
    assert w.judge([9.0] * 100).trips == []

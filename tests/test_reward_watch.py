"""Reward watch rules at their exact thresholds."""

import numpy as np
import pytest

from services.learner.watch import RewardWatch


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

"""The learner's train buffer bound at its exact size, and both eviction policies."""

import pytest

from steadyrl.services.learner.buffer import evictions, mean_abs_advantage


def _waiting(n, released=()):
    # seq i, rewards with spread i (group i has mean |advantage| i / 2)
    return {f"p{i}": (i, [0.0, float(i)], f"p{i}" in released) for i in range(n)}


def test_at_the_bound_nothing_is_evicted_one_above_one_is():
    assert evictions(_waiting(8), 8, "fifo") == []
    assert evictions(_waiting(9), 8, "fifo") == ["p0"]
    assert evictions(_waiting(10), 8, "fifo") == ["p0", "p1"]


def test_priority_evicts_the_least_signal_first_and_oldest_on_ties():
    w = {"old_flat": (1, [1.0, 1.0, 1.0], False), "new_flat": (5, [0.0, 0.0, 0.0], False),
         "spread": (0, [0.0, 1.0, 0.0], False)}
    assert evictions(w, 1, "priority") == ["old_flat", "new_flat"]
    assert evictions(w, 2, "fifo") == ["spread"]
    assert mean_abs_advantage([0.0, 1.0, 0.0]) == pytest.approx(4 / 9)


def test_released_groups_are_never_evicted():
    assert evictions(_waiting(10, released={"p0", "p1"}), 8, "fifo") == ["p2", "p3"]


def test_unknown_policy_is_an_error():
    with pytest.raises(ValueError, match="fifo or priority"):
        evictions(_waiting(3), 1, "lifo")

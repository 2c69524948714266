"""Circuit breaker state machine, stepped by an injected clock (no sleeping)."""

import pytest

from steadyrl.breaker import CircuitBreaker, State


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _breaker(**kw):
    clock, changes = Clock(), []
    b = CircuitBreaker("test", clock=clock, on_change=lambda old, new, why: changes.append((old, new)), **kw)
    return b, clock, changes


def test_opens_after_exactly_three_consecutive_failures():
    b, _, changes = _breaker(failure_threshold=3, reset_timeout_s=30)
    for _ in range(2):
        assert b.allow()
        b.record_failure("timeout")
    assert b.state is State.closed and b.failures == 2
    b.record_success()  # a success in between resets the count
    for _ in range(2):
        b.record_failure("500")
    assert b.state is State.closed
    b.record_failure("500")
    assert b.state is State.open and changes == [(State.closed, State.open)]
    assert not b.allow()


def test_half_opens_after_the_reset_timeout_lets_one_trial_through_and_closes_on_success():
    b, clock, changes = _breaker(failure_threshold=3, reset_timeout_s=30)
    for _ in range(3):
        b.record_failure()
    clock.t += 29.999
    assert not b.allow() and b.state is State.open
    clock.t += 0.001
    assert b.allow() and b.state is State.half_open
    assert not b.allow()  # only one trial in flight
    b.record_success()
    assert b.state is State.closed and b.allow()
    assert changes == [(State.closed, State.open), (State.open, State.half_open), (State.half_open, State.closed)]


def test_a_failed_trial_opens_again_for_a_full_reset_timeout():
    b, clock, _ = _breaker(failure_threshold=1, reset_timeout_s=10)
    b.record_failure()
    clock.t += 10
    assert b.allow()
    b.record_failure("still down")
    assert b.state is State.open
    clock.t += 9.9
    assert not b.allow()
    clock.t += 0.1
    assert b.allow() and b.state is State.half_open


def test_a_healthy_probe_half_opens_before_the_timeout():
    b, _, changes = _breaker(failure_threshold=1, reset_timeout_s=3600)
    b.record_failure()
    b.probe_succeeded()
    assert b.state is State.half_open and b.allow()
    b.probe_succeeded()  # not open: nothing changes
    assert changes[-1] == (State.open, State.half_open) and len(changes) == 2


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="failure_threshold must be >= 1"):
        CircuitBreaker("x", failure_threshold=0)

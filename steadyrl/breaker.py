"""Circuit breaker: stop calling a dependency that keeps failing, probe it, come back.

States (Nygard, *Release It!*, "Circuit Breaker"):

    closed     calls go through; `failure_threshold` consecutive failures -> open
    open       calls are refused (the caller falls back) until `reset_timeout_s` has
               passed or a health probe succeeds -> half_open
    half_open  one trial call goes through: success -> closed, failure -> open again

The clock is injectable (`clock=`, seconds, monotonic), so tests step time by hand. Every
state change is logged as an event and reported to `on_change(old, new, why)`. Thread-safe.

We write our own rather than use pybreaker/aiobreaker: the workers are threaded (not
asyncio), and those libraries read the wall clock directly, which makes the open ->
half_open timing untestable without sleeping.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from enum import StrEnum

log = logging.getLogger(__name__)


class State(StrEnum):
    closed = "closed"
    open = "open"
    half_open = "half_open"


class CircuitBreaker:
    """A consecutive-failure circuit breaker with an injectable clock.

    Args:
        name: used in log events and metrics labels.
        failure_threshold: consecutive failures that open the breaker (>= 1).
        reset_timeout_s: seconds open before a trial call is let through.
        clock: monotonic seconds (default time.monotonic).
        on_change: called as on_change(old: State, new: State, why: str) after each change.

    Raises ValueError for a threshold below 1 or a negative timeout.
    """

    def __init__(self, name: str, failure_threshold: int = 3, reset_timeout_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[State, State, str], None] | None = None):
        if failure_threshold < 1 or reset_timeout_s < 0:
            raise ValueError(f"failure_threshold must be >= 1 and reset_timeout_s >= 0, got "
                             f"{failure_threshold}, {reset_timeout_s}")
        self.name, self.failure_threshold, self.reset_timeout_s = name, failure_threshold, reset_timeout_s
        self.clock, self.on_change = clock, on_change
        self.state = State.closed
        self.failures = 0            # consecutive, while closed
        self.opened_at = 0.0
        self._trial_in_flight = False
        self._lock = threading.Lock()

    def _move(self, new: State, why: str) -> None:
        old, self.state = self.state, new
        if new is State.open:
            self.opened_at = self.clock()
        if new is not State.half_open:
            self._trial_in_flight = False
        log.warning("circuit breaker %s -> %s", old.value, new.value,
                    extra={"breaker": self.name, "from": old.value, "to": new.value, "why": why})
        if self.on_change is not None:
            self.on_change(old, new, why)

    def allow(self) -> bool:
        """May a call go out now? In half_open, True once (the trial) until it is recorded."""
        with self._lock:
            if self.state is State.open and self.clock() - self.opened_at >= self.reset_timeout_s:
                self._move(State.half_open, f"open for {self.reset_timeout_s:g} s")
            if self.state is State.closed:
                return True
            if self.state is State.half_open and not self._trial_in_flight:
                self._trial_in_flight = True
                return True
            return False

    def record_success(self) -> None:
        """A call succeeded: closes the breaker (from half_open or open) and resets the count."""
        with self._lock:
            self.failures = 0
            if self.state is not State.closed:
                self._move(State.closed, "call succeeded")

    def record_failure(self, why: str = "") -> None:
        """A call failed (timeout, error): counts toward opening; a failed trial re-opens."""
        with self._lock:
            if self.state is State.half_open:
                self._move(State.open, f"trial call failed: {why}")
            elif self.state is State.closed:
                self.failures += 1
                if self.failures >= self.failure_threshold:
                    self._move(State.open, f"{self.failures} consecutive failures, last: {why}")
            # open: a call that was already out when the breaker opened; nothing changes

    def probe_succeeded(self) -> None:
        """A background health probe found the dependency healthy: open -> half_open now."""
        with self._lock:
            if self.state is State.open:
                self._move(State.half_open, "health probe succeeded")

"""The budget of a held record: a record that keeps failing while its dependency answers
others goes to rl.dlq as `retries_exhausted` once `max_attempts` tries have counted and
`max_hold_s` seconds have passed since its first counted failure (steadyrl/bus/stage.py's
module doc has the whole rule). Budgets live in memory: a restart or a rebalance that moves the
partition starts them again."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import Gauge

from steadyrl.bus.records import Meta, RetryLater

if TYPE_CHECKING:
    from confluent_kafka import TopicPartition

RETRYING = Gauge("steadyrl_stage_retrying_records", "Records failing while their dependency answers (their tries "
                 "count against the budget)", ["stage"])
RETRYING_OLDEST = Gauge("steadyrl_stage_retrying_oldest_seconds", "Time since the first counted failure of the "
                        "oldest record still retrying", ["stage"])


@dataclass
class Budget:
    """One record failing while its dependency answers: when it first counted, how many tries
    counted, the last error, and whether it is tried alone. In memory only."""

    first_s: float            # time.monotonic() of the first counted failure
    attempts: int = 0
    error: str = ""
    alone: bool = False       # an own failure, or its budget spent: tried in a call of its own


class Budgets:
    """The budgets of one stage's held records, by (topic, partition, offset); thread-safe.
    `done_s` is when the handler last did a record (the evidence that the dependency answers)."""

    def __init__(self, stage: str, max_hold_s: float, max_attempts: int):
        self.stage, self.max_hold_s, self.max_attempts = stage, max_hold_s, max_attempts
        self.done_s = -math.inf  # time.monotonic()
        self._budgets: dict[tuple[str, int, int], Budget] = {}
        self._lock = threading.Lock()

    def spent(self, b: Budget, now: float) -> bool:
        """Both limits reached: max_attempts counted tries and max_hold_s seconds."""
        return b.attempts >= self.max_attempts and now - b.first_s >= self.max_hold_s

    def get(self, key: tuple[str, int, int]) -> Budget | None:
        with self._lock:
            return self._budgets.get(key)

    def count(self, meta: Meta, why: RetryLater, alone: bool, now: float) -> Budget | None:
        """Note a held record's try. Returns its Budget when the record goes to rl.dlq (spent,
        failing alone, with the evidence that the dependency answers others), else None (held)."""
        if not why.counts:
            return None  # the dependency is down: no try counts
        with self._lock:
            b = self._budgets.setdefault((meta.topic, meta.partition, meta.offset), Budget(now))
            b.attempts += 1
            b.error = str(why)
            spent = self.spent(b, now)
            if alone and spent and (why.own or self.done_s >= b.first_s):
                return b  # forgotten once committed past: a DLQ record a held one before it kept back comes again
            b.alone = b.alone or why.own or spent
            return None

    def forget(self, key: tuple[str, int, int]) -> None:
        with self._lock:
            self._budgets.pop(key, None)

    def forget_partitions(self, tps: set[tuple[str, int]]) -> None:
        with self._lock:
            for key in [k for k in self._budgets if (k[0], k[1]) in tps]:
                del self._budgets[key]

    def forget_committed(self, offsets: list[TopicPartition]) -> None:
        """Drop the budgets of records below the committed offsets (TopicPartitions)."""
        nxt = {(tp.topic, tp.partition): tp.offset for tp in offsets}
        with self._lock:
            for key in [k for k in self._budgets if k[2] < nxt.get((k[0], k[1]), -1)]:
                del self._budgets[key]
        self.show(time.monotonic())

    def show(self, now: float) -> None:
        """Set the retrying gauges: how many records are retrying, and for how long the oldest."""
        with self._lock:
            firsts = [b.first_s for b in self._budgets.values()]
        RETRYING.labels(self.stage).set(len(firsts))
        RETRYING_OLDEST.labels(self.stage).set(now - min(firsts) if firsts else 0)

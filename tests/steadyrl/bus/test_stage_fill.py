"""How the stage fills a batch (Stage._next_batch), on a stand-in consumer that hands out
records in the pieces a real fetch does (no broker).

Found on SmolLM2 (issue 22): the 8 prompts of a learner step reached the rollout worker as
1, then 5, then 2 records; the batch started with 6 and the last 2 waited 11.5 s for the
actor's first call to end, so a step took two actor calls instead of one.
"""

import time

from steadyrl.bus import stage as stage_mod
from steadyrl.bus.stage import Stage


class _Consumer:
    """consume(n, timeout) as librdkafka's: up to n records, or what came within timeout.

    `pieces` is what each call hands out (a list of record counts); a call past the last
    piece waits its whole timeout and returns nothing. Records are plain ints."""

    def __init__(self, pieces: list[int]):
        self.pieces, self.calls, self.next = list(pieces), [], 0

    def consume(self, n: int, timeout: float):
        self.calls.append((n, timeout))
        if not self.pieces:
            time.sleep(timeout)
            return []
        k = min(self.pieces.pop(0), n)
        out = list(range(self.next, self.next + k))
        self.next += k
        return out


def _stage(consumer: _Consumer, batch_size: int = 8) -> Stage:
    st = Stage.__new__(Stage)  # only what _next_batch reads
    st.consumer, st.batch_size, st.batch_timeout_s = consumer, batch_size, 0.5
    return st


def test_a_batch_fills_from_every_piece_that_comes_in_time(monkeypatch):
    """1 + 5 + 2 records, each piece within the fill wait of the last: one batch of 8."""
    monkeypatch.setattr(stage_mod, "FILL_MAX_S", 30.0)  # a stall of the test machine ends no fill here
    c = _Consumer([0, 1, 5, 2])  # nothing fetched yet, then the pieces
    assert _stage(c)._next_batch() == list(range(8))
    assert [n for n, _ in c.calls] == [8, 1, 7, 2]  # and no call after the batch is full


def test_a_gap_with_nothing_new_starts_the_batch():
    """After 3 records nothing comes within FILL_WAIT_S: the batch starts with 3 (latency at a
    low rate stays one fill wait)."""
    c = _Consumer([3])
    assert _stage(c)._next_batch() == [0, 1, 2]
    assert len(c.calls) == 2 and c.calls[-1][0] == 5 and c.calls[-1][1] <= stage_mod.FILL_WAIT_S


def test_the_fill_stops_at_fill_max_s_while_records_trickle_in(monkeypatch):
    """One record per call, forever: the batch starts within FILL_MAX_S of its first record."""
    monkeypatch.setattr(stage_mod, "FILL_MAX_S", 0.03)

    class Trickle(_Consumer):
        def consume(self, n, timeout):
            self.calls.append((n, timeout))
            time.sleep(min(timeout, 0.004))
            self.next += 1
            return [self.next]

    c = Trickle([])
    t0 = time.monotonic()
    got = _stage(c, batch_size=1000)._next_batch()
    assert time.monotonic() - t0 < 0.03 + 0.5   # the cap, with room for a loaded machine
    assert 2 <= len(got) < 1000
    assert all(t <= stage_mod.FILL_WAIT_S + 1e-9 for _, t in c.calls[1:])


class _Rec:
    """A consumed record: its partition of topic t, no error."""

    def __init__(self, partition: int):
        self.p = partition

    def topic(self):
        return "t"

    def partition(self):
        return self.p

    def error(self):
        return None


def test_records_of_a_partition_revoked_while_the_batch_filled_are_left_to_its_new_owner():
    """Regression (found in review): the revoke callback runs inside consume(); records taken from
    partition 1 before it was revoked in a later fill call were transformed and their offsets
    sent, while the new owner redid them."""
    from types import SimpleNamespace

    st = _stage(None)
    st._assigned, st._busy, st._revoked_during_batch = {("t", 0), ("t", 1)}, False, set()
    st.budgets, st.stage_id = SimpleNamespace(forget_partitions=lambda parts: None), "unit"
    pieces = [[_Rec(0), _Rec(1)], [_Rec(0)], []]

    class Revoking:
        def consume(self, n, timeout):
            out = pieces.pop(0) if pieces else []
            if not pieces:   # the rebalance, during the fill's last call
                st._on_revoke(None, [SimpleNamespace(topic="t", partition=1)])
            return out

    st.consumer = Revoking()
    got = st._take_batch()
    assert [m.partition() for m in got] == [0, 0]

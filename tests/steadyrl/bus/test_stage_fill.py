"""How a batch fills (steadyrl.bus.stage.fill_batch), on a stand-in consumer that hands out
records in the pieces a real fetch does (no broker); and which of them a Stage keeps when a
partition is revoked meanwhile."""

import time

import pytest

from steadyrl.bus.stage import FILL_WAIT_S, Stage, fill_batch
from steadyrl.wire.contracts import RolloutGroup


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


def _fill(consumer: _Consumer, batch_size: int = 8, fill_max_s: float = 30.0) -> list:
    """One batch from `consumer`, the stage's waits (FILL_WAIT_S); a FILL_MAX_S of 30 s by
    default, so a stall of the test machine ends no fill."""
    return fill_batch(consumer.consume, batch_size, 0.5, FILL_WAIT_S, fill_max_s)


def test_a_batch_fills_from_every_piece_that_comes_in_time():
    """1 + 5 + 2 records, each piece within the fill wait of the last: one batch of 8."""
    c = _Consumer([0, 1, 5, 2])  # nothing fetched yet, then the pieces
    assert _fill(c) == list(range(8))
    assert [n for n, _ in c.calls] == [8, 1, 7, 2]  # and no call after the batch is full


def test_a_gap_with_nothing_new_starts_the_batch():
    """After 3 records nothing comes within FILL_WAIT_S: the batch starts with 3 (latency at a
    low rate stays one fill wait)."""
    c = _Consumer([3])
    assert _fill(c) == [0, 1, 2]
    assert len(c.calls) == 2 and c.calls[-1][0] == 5 and c.calls[-1][1] <= FILL_WAIT_S


def test_nothing_fetched_and_nothing_coming_is_an_empty_batch_after_the_first_wait():
    c = _Consumer([])
    assert fill_batch(c.consume, 8, 0.05, FILL_WAIT_S, 30.0) == []
    assert c.calls == [(8, 0), (1, 0.05)]


def test_the_fill_stops_at_fill_max_s_while_records_trickle_in():
    """One record per call, forever: the batch starts within fill_max_s of its first record."""

    class Trickle(_Consumer):
        def consume(self, n, timeout):
            self.calls.append((n, timeout))
            time.sleep(min(timeout, 0.004))
            self.next += 1
            return [self.next]

    c = Trickle([])
    t0 = time.monotonic()
    got = _fill(c, batch_size=1000, fill_max_s=0.03)
    assert time.monotonic() - t0 < 0.03 + 0.5   # the cap, with room for a loaded machine
    assert 2 <= len(got) < 1000
    assert all(t <= FILL_WAIT_S + 1e-9 for _, t in c.calls[1:])


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


@pytest.fixture
def stage():
    """A Stage built by its constructor on a broker that is not there (nothing listens on port
    1; its clients never connect), its consumer replaced by the test's."""
    st = Stage(name="fill-unit", bootstrap="127.0.0.1:1", topic_prefix="unit.", instance_id="w0",
               input_topic="rl.rollouts", input_contract=RolloutGroup, group_id="g", handle=lambda value, meta: [])
    st.consumer.close()
    yield st
    st.consumer = _Closable()
    st.close()


class _Closable:
    def close(self):
        pass


def test_records_of_a_partition_revoked_while_the_batch_filled_are_left_to_its_new_owner(stage):
    """Regression (found in review): the revoke callback runs inside consume(); records taken from
    partition 1 before it was revoked in a later fill call were transformed and their offsets
    sent, while the new owner redid them."""
    from types import SimpleNamespace

    stage._on_assign(None, [SimpleNamespace(topic="t", partition=0), SimpleNamespace(topic="t", partition=1)])
    pieces = [[_Rec(0), _Rec(1)], [_Rec(0)], []]

    class Revoking(_Closable):
        def consume(self, n, timeout):
            out = pieces.pop(0) if pieces else []
            if not pieces:   # the rebalance, during the fill's last call
                stage._on_revoke(None, [SimpleNamespace(topic="t", partition=1)])
            return out

    stage.consumer = Revoking()
    got = stage._take_batch()
    assert [m.partition() for m in got] == [0, 0]

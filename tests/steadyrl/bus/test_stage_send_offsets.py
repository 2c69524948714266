"""The stage's send_offsets_to_transaction (steadyrl.bus.txn.TransactionalProducer): a call that
never returns (librdkafka#5456, seen after a broker restart in bench/chaos.py) ends the stage
instead of stalling it for good; a loss of every broker renews the producer first."""

import threading
import time

import pytest

from steadyrl.bus.kafka import TXN_TIMEOUT_S
from steadyrl.bus.stage import ProducerWedged, Stage
from steadyrl.wire.contracts import RolloutGroup


class _Producer:
    """Stands in for the transactional producer; send_offsets blocks until `release` is set."""

    def __init__(self, block: bool):
        self.block, self.release, self.calls = block, threading.Event(), []

    def begin_transaction(self):
        self.calls.append("begin")

    def send_offsets_to_transaction(self, offsets, meta, timeout):
        self.calls.append(("send_offsets", timeout))
        if self.block:
            self.release.wait(30)

    def commit_transaction(self, timeout):
        self.calls.append("commit")

    def abort_transaction(self, timeout):
        self.calls.append("abort")

    def produce(self, *a, **kw):
        pass

    def poll(self, timeout=0):
        return 0

    def flush(self, timeout=0):
        return 0


class _Consumer:
    def consumer_group_metadata(self):
        return object()

    def close(self):
        pass


def _stage(producer) -> Stage:
    st = Stage(name="t", bootstrap="127.0.0.1:1", topic_prefix="unit.", instance_id="w0", input_topic="rl.rollouts",
               input_contract=RolloutGroup, group_id="g", handle=lambda value, meta: [])
    real = (st.producer._producer, st.consumer)
    st.producer._producer, st.consumer = producer, _Consumer()
    st.producer._generation += 1  # what the discarded real producer reports (port 1 down) no longer counts
    for client in real:  # never connected (nothing listens on port 1)
        getattr(client, "close", lambda: None)()
    return st


def test_send_offsets_that_never_returns_raises_producer_wedged_after_the_deadline():
    from confluent_kafka import TopicPartition

    producer = _Producer(block=True)
    st = _stage(producer)
    st.producer.timeout_s, st.producer.grace_s = 0.2, 0.3
    t0 = time.monotonic()
    try:
        with pytest.raises(ProducerWedged, match="did not return within 0.5 s"):
            st._commit_transaction([], [TopicPartition("unit.rl.rollouts", 0, 5)])
        assert 0.45 <= time.monotonic() - t0 < 3
        assert producer.calls == ["begin", ("send_offsets", 0.2)]  # never committed, not aborted
    finally:
        producer.release.set()


def test_send_offsets_that_returns_commits_as_before():
    from confluent_kafka import TopicPartition

    producer = _Producer(block=False)
    st = _stage(producer)
    st._commit_transaction([], [TopicPartition("unit.rl.rollouts", 0, 5)])
    assert producer.calls == ["begin", ("send_offsets", TXN_TIMEOUT_S), "commit"]


def test_an_error_of_send_offsets_reaches_the_stage(monkeypatch):
    """Errors raised in the call's thread are raised in the stage's (abort-and-rewind path)."""
    from confluent_kafka import KafkaError, KafkaException, TopicPartition

    class Abortable(_Producer):
        def send_offsets_to_transaction(self, offsets, meta, timeout):
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "coordinator gone", txn_requires_abort=True))

    producer = Abortable(block=False)
    st = _stage(producer)
    monkeypatch.setattr(st, "_rewind", lambda: producer.calls.append("rewind"))
    st._commit_transaction([], [TopicPartition("unit.rl.rollouts", 0, 5)])
    assert producer.calls == ["begin", "abort", "rewind"]


def test_send_offsets_caught_by_a_broker_loss_is_wedged_a_grace_after_the_broker_answers():
    """After a broker restart the call never returns (librdkafka#5511): once a broker answers
    again the stage waits TXN_GRACE_S, not the whole TXN_TIMEOUT_S + TXN_GRACE_S."""
    from confluent_kafka import TopicPartition

    class Restarted(_Producer):
        answers = False

        def list_topics(self, topic=None, timeout=-1):
            from confluent_kafka import KafkaError, KafkaException

            if not self.answers:
                raise KafkaException(KafkaError(KafkaError._TRANSPORT, "down"))

    producer = Restarted(block=True)
    st = _stage(producer)
    st.producer.timeout_s, st.producer.grace_s = 30.0, 1.0

    def broker_back():
        time.sleep(0.2)
        st.producer._broker_lost.set()  # every broker lost while the call is in flight
        time.sleep(0.8)
        producer.answers = True

    threading.Thread(target=broker_back, daemon=True).start()
    t0 = time.monotonic()
    try:
        with pytest.raises(ProducerWedged):
            st._commit_transaction([], [TopicPartition("unit.rl.rollouts", 0, 5)])
        took = time.monotonic() - t0
        assert 1.9 <= took < 4, took  # 1 s down + 1 s grace (+ the 0.5 s polling step), not 31 s
    finally:
        producer.release.set()


def test_the_producer_error_callback_flags_a_loss_of_every_broker_only():
    from confluent_kafka import KafkaError

    p = _stage(_Producer(block=False)).producer
    p._on_error(KafkaError(KafkaError._TRANSPORT, "one connection refused"), p._generation)
    assert not p._broker_lost.is_set()
    p._on_error(KafkaError(KafkaError._ALL_BROKERS_DOWN, "2/2 brokers are down"), p._generation - 1)
    assert not p._broker_lost.is_set()  # a replaced producer's event
    p._on_error(KafkaError(KafkaError._ALL_BROKERS_DOWN, "2/2 brokers are down"), p._generation)
    assert p._broker_lost.is_set()


def test_a_loss_noticed_during_the_transform_renews_the_producer_before_the_transaction(monkeypatch):
    """Regression (review): the flag set by a poll inside the transform was checked only at the
    next loop, so the transaction began on the stale producer and hung (then the process exited)."""
    from confluent_kafka import TopicPartition

    producer = _Producer(block=False)
    st = _stage(producer)
    st.producer._broker_lost.set()
    monkeypatch.setattr(st.producer, "renew", lambda stop: producer.calls.append("renew") or True)
    st._commit_transaction([], [TopicPartition("unit.rl.rollouts", 0, 5)])
    assert producer.calls == ["renew", "begin", ("send_offsets", TXN_TIMEOUT_S), "commit"]


def test_stopping_while_waiting_for_the_broker_commits_nothing(monkeypatch):
    from confluent_kafka import TopicPartition

    producer = _Producer(block=False)
    st = _stage(producer)
    st.producer._broker_lost.set()
    monkeypatch.setattr(st.producer, "renew", lambda stop: False)
    st._commit_transaction([], [TopicPartition("unit.rl.rollouts", 0, 5)])
    assert producer.calls == []


def test_not_ready_while_every_broker_is_lost():
    st = _stage(_Producer(block=False))
    st.producer._broker_lost.set()
    ok, why = st._check_broker()
    assert not ok and "every broker was lost" in why
    st.producer._broker_lost.clear()
    assert "every broker" not in st._check_broker()[1]

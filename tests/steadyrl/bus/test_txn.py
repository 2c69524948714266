"""TransactionalProducer without a broker: the transaction rule (retriable -> retry, abortable ->
abort and TransactionAborted, fatal -> raised), the context manager of one-off writers, close()
aborting an open transaction, renewal, and the one transaction timeout."""

from __future__ import annotations

import threading

import pytest
from confluent_kafka import KafkaError, KafkaException

from steadyrl.bus import txn
from steadyrl.bus.kafka import TXN_TIMEOUT_S, producer_config
from steadyrl.bus.txn import TransactionAborted, TransactionalProducer


def _error(code=KafkaError._TIMED_OUT, *, retriable=False, abortable=False, fatal=False) -> KafkaException:
    return KafkaException(KafkaError(code, "test", fatal=fatal, retriable=retriable, txn_requires_abort=abortable))


class _Raw:
    """Stands in for confluent_kafka.Producer: records calls; `fail[name]` is a list of
    exceptions its next calls of `name` raise, one each."""

    def __init__(self):
        self.calls: list = []
        self.fail: dict[str, list[BaseException]] = {}
        self.produced: list = []

    def _do(self, name, *record):
        self.calls.append(name)
        if self.fail.get(name):
            raise self.fail[name].pop(0)

    def init_transactions(self, timeout):
        self._do("init")

    def begin_transaction(self):
        self._do("begin")

    def produce(self, topic, value, **kw):
        self._do("produce")
        self.produced.append((topic, value, kw))

    def send_offsets_to_transaction(self, offsets, meta, timeout):
        self._do("send_offsets")

    def commit_transaction(self, timeout):
        self._do("commit")

    def abort_transaction(self, timeout):
        self._do("abort")

    def list_topics(self, topic=None, timeout=-1):
        self._do("list_topics")

    def poll(self, timeout=0):
        return 0

    def flush(self, timeout=0):
        return 0


@pytest.fixture
def producer(monkeypatch):
    """A TransactionalProducer whose confluent producer is a _Raw (no broker); no backoff sleeps."""
    monkeypatch.setattr(txn.time, "sleep", lambda s: None)
    p = TransactionalProducer("127.0.0.1:1", "unit-producer", "unit-txn")
    p._producer, p._generation = _Raw(), p._generation + 1  # the real one never connected (port 1)
    return p


def test_one_timeout_ties_transaction_timeout_ms_to_the_send_offsets_deadline():
    cfg = producer_config("b:1", "c", "t")
    assert cfg["transaction.timeout.ms"] == cfg["message.timeout.ms"] == int(TXN_TIMEOUT_S * 1000)
    p = TransactionalProducer("127.0.0.1:1", "c", "t")
    assert p.timeout_s == TXN_TIMEOUT_S and p._config["transaction.timeout.ms"] == int(p.timeout_s * 1000)
    long = TransactionalProducer("127.0.0.1:1", "c", "t2", timeout_s=120)
    assert long._config["transaction.timeout.ms"] == long._config["message.timeout.ms"] == 120_000
    assert "transaction.timeout.ms" not in producer_config("b:1", "c")  # idempotent only


def test_a_retriable_commit_is_retried(producer):
    producer._producer.fail["commit"] = [_error(retriable=True), _error(retriable=True)]
    producer.begin_transaction()
    producer.commit_transaction()
    assert producer._producer.calls == ["begin", "commit", "commit", "commit"]
    assert not producer.in_transaction


def test_a_retriable_error_on_every_try_is_raised_as_it_is(producer):
    producer._producer.fail["commit"] = [_error(retriable=True) for _ in range(txn.ATTEMPTS)]
    producer.begin_transaction()
    with pytest.raises(KafkaException) as e:
        producer.commit_transaction()
    assert not isinstance(e.value, TransactionAborted)
    assert producer._producer.calls.count("commit") == txn.ATTEMPTS and "abort" not in producer._producer.calls


@pytest.mark.parametrize("call", ["send_offsets", "commit", "produce"])
def test_an_abortable_error_aborts_and_raises_transaction_aborted(producer, call):
    producer._producer.fail[call] = [_error(abortable=True)]
    producer.begin_transaction()
    with pytest.raises(TransactionAborted) as e:
        producer.produce("t", b"v", "k")
        producer.send_offsets_to_transaction([], object())
        producer.commit_transaction()
    assert isinstance(e.value, KafkaException) and e.value.args[0].txn_requires_abort()
    assert producer._producer.calls[-2:] == [call, "abort"] and not producer.in_transaction
    producer.begin_transaction()  # the next transaction can begin


def test_a_fatal_error_is_raised_and_nothing_is_retried(producer):
    producer._producer.fail["commit"] = [_error(KafkaError._FENCED, fatal=True)]
    producer.begin_transaction()
    with pytest.raises(KafkaException) as e:
        producer.commit_transaction()
    assert not isinstance(e.value, TransactionAborted) and e.value.args[0].code() == KafkaError._FENCED
    assert producer._producer.calls == ["begin", "commit"]


def test_the_context_manager_commits_or_aborts_and_raises(producer):
    with producer.transaction():
        producer.produce("t", b"v", "k", [("h", b"1")], timestamp_ms=1234)
    assert producer._producer.calls == ["begin", "produce", "commit"]
    assert producer._producer.produced == [("t", b"v", {"key": "k", "headers": [("h", b"1")], "on_delivery": None,
                                                        "timestamp": 1234})]
    producer._producer.calls.clear()
    with pytest.raises(ValueError, match="boom"), producer.transaction():
        producer.produce("t", b"v")
        raise ValueError("boom")
    assert producer._producer.calls == ["begin", "produce", "abort"] and not producer.in_transaction
    producer._producer.calls.clear()
    producer._producer.fail["commit"] = [_error(abortable=True)]
    with pytest.raises(TransactionAborted), producer.transaction():
        producer.produce("t", b"v")
    assert producer._producer.calls == ["begin", "produce", "commit", "abort"]  # aborted once


def test_a_full_local_queue_is_drained_and_the_record_queued_again(producer):
    producer._producer.fail["produce"] = [BufferError("queue full")]
    producer.begin_transaction()
    producer.produce("t", b"v")
    assert producer._producer.calls == ["begin", "produce", "produce"] and len(producer._producer.produced) == 1


def test_close_aborts_an_open_transaction_only(producer):
    producer.close()
    assert producer._producer.calls == []
    producer.begin_transaction()
    producer.close()
    assert producer._producer.calls == ["begin", "abort"] and not producer.in_transaction


def test_close_leaves_a_wedged_producers_transaction_to_its_successor_and_never_raises(producer):
    producer.begin_transaction()
    producer._wedged = True
    producer.close()
    assert producer._producer.calls == ["begin"]
    producer._wedged = False
    producer._producer.fail["abort"] = [_error(KafkaError._FENCED, fatal=True)]
    producer.close()  # logged, not raised
    assert producer._producer.calls == ["begin", "abort"]


def test_renew_waits_for_a_broker_then_fences_with_a_new_producer(producer, monkeypatch):
    old, fresh = producer._producer, _Raw()
    old.fail["list_topics"] = [_error(KafkaError._TRANSPORT), _error(KafkaError._TRANSPORT)]
    beats, renewed = [], []
    producer._beat, producer._on_renewed = lambda: beats.append(1), lambda: renewed.append(1)
    monkeypatch.setattr(producer, "_new_producer", lambda: fresh)
    producer._broker_lost.set()
    assert producer.begin_transaction()
    assert old.calls == ["list_topics"] * 3 and len(beats) == 2
    assert fresh.calls == ["init", "begin"] and producer._producer is fresh
    assert renewed == [1] and not producer.broker_lost


def test_renew_gives_up_when_stopped_while_no_broker_answers(producer):
    producer._producer.fail["list_topics"] = [_error(KafkaError._TRANSPORT)]
    producer._broker_lost.set()
    stop = threading.Event()
    stop.set()
    raw = producer._producer
    assert not producer.begin_transaction(stop)
    assert producer._producer is raw and raw.calls == ["list_topics"] and producer.broker_lost
    assert not producer.in_transaction

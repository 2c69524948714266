"""One transactional producer: the transaction rule every steadyrl writer follows.

Each call of confluent-kafka's transactional API raises `KafkaException` on failure, and its
`args[0]` (a `KafkaError`) says what to do (librdkafka INTRODUCTION.md, "Transactional
Producer"; confluent-kafka `examples/eos_transactions.py`). `TransactionalProducer` does it:

- **retriable** (`err.retriable()`, e.g. a timeout while the coordinator moves): the same call
  again after a backoff (0.1 s doubling, at most 5 s; `ATTEMPTS` tries in all);
- **abortable** (`err.txn_requires_abort()`): the transaction failed, the producer did not. It
  is aborted here and `TransactionAborted` is raised: nothing of it is visible to
  read_committed readers; the caller rewinds its input (a stage seeks back to the committed
  offsets) or gives up (a one-off writer). `TransactionAborted` is a `KafkaException`;
- **fatal** (anything else, e.g. fenced by a newer producer with the same transactional.id):
  the `KafkaException` is raised as is and the process must exit. Its successor's
  init_transactions fences it and aborts what it left open.

Two librdkafka defects are covered here as well:

- **renewal after every broker was lost** (confluentinc/librdkafka#5511): the producer keeps
  a stale group coordinator and never looks it up again, so its next
  send_offsets_to_transaction hangs. The error callback flags `_ALL_BROKERS_DOWN`
  (`broker_lost`); `renew` (called by `begin_transaction`, or by a caller between
  transactions) waits until a broker answers a metadata request and builds a new producer
  with the same transactional.id, whose init_transactions fences the old one.
- **the send-offsets deadline** (#5456, open: the coordinator request has no timeout):
  send_offsets_to_transaction runs in a thread; past `timeout_s` + `grace_s` (or `grace_s`
  after a broker answers again, when the loss caught the call in flight) it raises
  `ProducerWedged`: the process must exit.

A stage (consume-transform-produce; steadyrl.bus.stage):

    p = TransactionalProducer(bootstrap, "reward-0-producer", "steadyrl-reward-reward-0")
    p.init_transactions()
    while running:
        msgs = consumer.consume(...)
        try:
            p.begin_transaction()
            for m in msgs:
                p.produce(out_topic, value, key, headers)
            p.send_offsets_to_transaction(next_offsets, consumer.consumer_group_metadata())
            p.commit_transaction()
        except TransactionAborted:
            rewind(consumer)              # seek back to the committed offsets; redo the batch

A one-off writer (steadyrl replay --to-topic, steadyrl quarantine release):

    p.init_transactions()
    with p.transaction():                 # commit at the end; on any error abort, and raise
        p.produce(topic, value, key, headers)
    p.close()
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from confluent_kafka import KafkaError, KafkaException, Message, Producer, TopicPartition

from steadyrl.bus.kafka import TXN_TIMEOUT_S, producer_config

log = logging.getLogger(__name__)

#: After a wedge is suspected, how long more a call may take (seconds): past
#: TXN_TIMEOUT_S + TXN_GRACE_S, or TXN_GRACE_S after a broker answers again, it is wedged.
TXN_GRACE_S = 5.0
#: Tries of a call that fails with a retriable error (the backoff doubles from 0.1 s to 5 s).
ATTEMPTS = 10

_T = TypeVar("_T")


class ProducerWedged(RuntimeError):
    """A transactional producer call did not return by its deadline: the process must exit."""


class TransactionAborted(KafkaException):
    """The transaction failed with an abortable error and was aborted: none of it is visible.

    `args[0]` is the `KafkaError`. The producer can begin the next transaction; the caller
    rewinds its input (or gives up)."""


class TransactionalProducer:
    """A transactional confluent-kafka producer that applies the transaction rule (module doc).

    Args:
        bootstrap: bootstrap servers ("host:port,...").
        client: client.id (labels its librdkafka statistics, steadyrl_kafka_*).
        transactional_id: stable per writer: a producer with the same id fences this one.
        timeout_s: transaction.timeout.ms and message.timeout.ms, in seconds (default
            steadyrl.bus.kafka.TXN_TIMEOUT_S); also the timeout given to
            send_offsets_to_transaction and the base of its deadline.
        stats_interval_s: librdkafka statistics interval (seconds).
        call_timeout_s: timeout of init/commit/abort (seconds; retriable timeouts are retried).
        probe_topic: topic whose metadata tells that a broker answers (None: all topics).
        beat: called about every 0.5 s while waiting (a liveness heartbeat).
        on_renewed: called after each renewal (a metric).

    Not thread-safe: one thread makes the calls (librdkafka's transactional API is serial).
    """

    def __init__(self, bootstrap: str, client: str, transactional_id: str, *, timeout_s: float = TXN_TIMEOUT_S,
                 stats_interval_s: float = 5.0, call_timeout_s: float = 60.0, probe_topic: str | None = None,
                 beat: Callable[[], None] = lambda: None, on_renewed: Callable[[], None] = lambda: None):
        self.client, self.transactional_id = client, transactional_id
        self.timeout_s, self.grace_s, self.call_timeout_s = timeout_s, TXN_GRACE_S, call_timeout_s
        self._config = producer_config(bootstrap, client, transactional_id, stats_interval_s, timeout_s)
        self._probe_topic, self._beat, self._on_renewed = probe_topic, beat, on_renewed
        # Set by the current producer's error_cb when all its broker connections are down;
        # _generation tells the current producer from replaced ones (their late events are served too).
        self._broker_lost = threading.Event()
        self._generation = 0
        self._in_txn = False   # begun, neither committed nor aborted
        self._wedged = False   # a call did not return by its deadline: the producer is unusable
        self._producer = self._new_producer()

    # ---- state ---------------------------------------------------------------------------
    @property
    def broker_lost(self) -> bool:
        """True from a loss of every broker until the producer is renewed."""
        return self._broker_lost.is_set()

    @property
    def in_transaction(self) -> bool:
        """True between begin_transaction and its commit or abort."""
        return self._in_txn

    def _new_producer(self) -> Producer:
        """A producer of `_config` whose error_cb flags a loss of every broker, as long as it is
        the current one."""
        self._generation += 1
        generation, log_error = self._generation, self._config["error_cb"]

        def error_cb(err: KafkaError) -> None:
            log_error(err)
            self._on_error(err, generation)

        return Producer({**self._config, "error_cb": error_cb})

    def _on_error(self, err: KafkaError, generation: int) -> None:
        if err.code() == KafkaError._ALL_BROKERS_DOWN and generation == self._generation:
            self._broker_lost.set()

    # ---- the transactional API -------------------------------------------------------------
    def init_transactions(self) -> None:
        """Register the transactional.id: fences older producers with it and aborts their open
        transaction. Once, before the first transaction.

        Raises:
            KafkaException: a fatal error, or a retriable one on every try.
        """
        self._call("init_transactions", lambda: self._producer.init_transactions(self.call_timeout_s))

    def begin_transaction(self, stop: threading.Event | None = None) -> bool:
        """Begin a transaction; first `renew` the producer if every broker was lost since the last.

        Returns False (nothing begun) only when `stop` was set while waiting for a broker.

        Raises:
            KafkaException: fatal (e.g. a transaction is open already).
        """
        if self._broker_lost.is_set() and not self.renew(stop):
            return False
        self._call("begin_transaction", self._producer.begin_transaction)
        self._in_txn = True
        return True

    def produce(self, topic: str, value: bytes | None, key: str | bytes | None = None,
                headers: list[tuple[str, bytes]] | None = None, *, timestamp_ms: int | None = None,
                on_delivery: Callable[[KafkaError | None, Message], None] | None = None) -> None:
        """Queue one record in the open transaction (`timestamp_ms`: its own create time; None:
        now). A full local queue is drained (poll) and the record queued again.

        Raises:
            TransactionAborted: the transaction had failed; it was aborted.
            KafkaException: a local error (e.g. a record above message.max.bytes, unknown topic).
        """
        kw: dict[str, Any] = {"key": key, "headers": headers, "on_delivery": on_delivery}
        if timestamp_ms is not None:
            kw["timestamp"] = timestamp_ms
        while True:
            try:
                return self._call("produce", lambda: self._producer.produce(topic, value, **kw))
            except BufferError:  # local queue full: serve delivery reports, then retry
                self._producer.poll(0.1)

    def send_offsets_to_transaction(self, offsets: list[TopicPartition], group_metadata: Any) -> None:
        """Add a consumer's next offsets (`TopicPartition`s: last offset + 1) to the transaction,
        with a deadline librdkafka itself does not keep (#5456).

        The call runs in a daemon thread while this one polls (serving error_cb) and beats. Past
        `timeout_s` + `grace_s` from the first try, or `grace_s` after a broker answers again
        when every broker was lost meanwhile (#5511: it would never return), it is wedged.

        Raises:
            ProducerWedged: the call did not return by its deadline (nothing is aborted: the
                process must exit; its successor fences this producer).
            TransactionAborted: an abortable error; the transaction was aborted.
            KafkaException: fatal.
        """
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s + self.grace_s

        def attempt() -> None:
            nonlocal deadline
            deadline = self._within_deadline(
                "send_offsets_to_transaction",
                lambda: self._producer.send_offsets_to_transaction(offsets, group_metadata, self.timeout_s),
                t0, deadline)

        self._call("send_offsets_to_transaction", attempt)

    def commit_transaction(self) -> None:
        """Commit the open transaction (flushing its records first).

        Raises:
            TransactionAborted: an abortable error; the transaction was aborted.
            KafkaException: fatal, or retriable on every try (the transaction stays open).
        """
        self._call("commit_transaction", lambda: self._producer.commit_transaction(self.call_timeout_s))
        self._in_txn = False

    def abort_transaction(self) -> None:
        """Abort the open transaction: its records are never visible to read_committed readers
        and its offsets are not committed.

        Raises:
            KafkaException: fatal, or retriable on every try.
        """
        self._call("abort_transaction", lambda: self._producer.abort_transaction(self.call_timeout_s),
                   abortable=False)
        self._in_txn = False

    @contextmanager
    def transaction(self) -> Iterator[TransactionalProducer]:
        """`with p.transaction(): p.produce(...)`: begin, then commit when the block ends. Any
        exception in the block or from the commit aborts the transaction (when it can still be
        aborted) and is raised: all of it lands for read_committed readers, or none."""
        self.begin_transaction()
        try:
            yield self
            self.commit_transaction()
        except BaseException:
            if self._in_txn and not self._wedged:
                try:
                    self.abort_transaction()
                except Exception as e:  # noqa: BLE001 - fatal (fenced): the successor or the broker aborts it
                    log.warning("abort failed", extra={"producer": self.client, "error": str(e)})
            raise

    def poll(self, timeout_s: float = 0.0) -> int:
        """Serve delivery reports and callbacks (error_cb, stats_cb); returns the events served."""
        return self._producer.poll(timeout_s)

    def flush(self, timeout_s: float) -> int:
        """Wait for outstanding records to be delivered; returns how many are left."""
        return self._producer.flush(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Abort the open transaction, if any (a wedged producer's is left to its successor's
        init_transactions, or to the broker after transaction.timeout.ms), then flush. The abort
        is bounded by `timeout_s` + `grace_s`. Never raises: failures are logged."""
        if self._in_txn and self._wedged:
            log.warning("wedged producer: its open transaction is aborted by its successor",
                        extra={"producer": self.client})
        elif self._in_txn:
            try:
                self._within_deadline("abort_transaction", lambda: self._producer.abort_transaction(timeout_s),
                                      time.monotonic(), time.monotonic() + timeout_s + self.grace_s)
                self._in_txn = False
                log.info("open transaction aborted on close", extra={"producer": self.client})
            except Exception as e:  # noqa: BLE001 - fatal (fenced), or wedged: the successor or the broker aborts it
                log.warning("abort on close failed", extra={"producer": self.client, "error": str(e)})
        with contextlib.suppress(Exception):  # close() never raises: what is left, is left
            self._producer.flush(timeout_s)

    # ---- renewal ---------------------------------------------------------------------------
    def broker_answers(self, timeout_s: float = 1.0) -> bool:
        """True when a broker answers a metadata request within `timeout_s` seconds."""
        try:
            self._producer.list_topics(self._probe_topic, timeout=timeout_s)
            return True
        except KafkaException:
            return False

    def renew(self, stop: threading.Event | None = None) -> bool:
        """Replace the producer after every broker was lost; no transaction may be open.

        Waits (beating) until a broker answers a metadata request, then builds a producer with
        the same transactional.id: its init_transactions bumps the epoch, fencing the old one,
        whose coordinator state librdkafka would never refresh (#5511). Returns False when
        `stop` was set while waiting (nothing replaced), else True.

        Raises:
            KafkaException: init_transactions of the new producer failed (fatal).
        """
        log.warning("every broker was lost; replacing the transactional producer once one answers",
                    extra={"producer": self.client})
        t0 = time.monotonic()
        while not self.broker_answers():
            if stop is not None and stop.is_set():
                return False
            self._beat()
            (stop or threading.Event()).wait(0.2)
        old, self._producer = self._producer, self._new_producer()  # old events no longer count
        self._broker_lost.clear()
        self.init_transactions()  # fences the old one
        del old
        self._on_renewed()
        log.info("transactional producer replaced", extra={"producer": self.client,
                                                           "waited_s": round(time.monotonic() - t0, 2)})
        return True

    # ---- the rule ----------------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[[], _T], abortable: bool = True) -> _T:
        """`fn()` under the rule: retriable -> again after a backoff; abortable (inside a
        transaction) -> abort, raise TransactionAborted; anything else raised."""
        for i in range(ATTEMPTS):
            try:
                return fn()
            except KafkaException as e:
                err = e.args[0]
                if err.retriable() and i + 1 < ATTEMPTS:
                    log.info("retriable transaction error; retrying", extra={"producer": self.client, "call": what,
                                                                            "error": str(err), "try": i + 1})
                    time.sleep(min(0.1 * 2 ** i, 5))
                    continue
                if abortable and self._in_txn and err.txn_requires_abort():
                    log.warning("transaction aborted", extra={"producer": self.client, "call": what,
                                                              "error": str(err)})
                    self.abort_transaction()
                    raise TransactionAborted(err) from e
                raise  # fatal: the process must exit; its successor fences this producer
        raise AssertionError("unreachable")

    def _within_deadline(self, what: str, fn: Callable[[], object], t0: float, deadline: float) -> float:
        """Run `fn` in a daemon thread until it returns, polling and beating meanwhile; returns
        the deadline (shortened to `grace_s` after a broker answers again following a loss of
        every broker). Raises what `fn` raised, or ProducerWedged past the deadline."""
        box: dict[str, BaseException] = {}
        done = threading.Event()

        def call() -> None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - handed to the calling thread below, re-raised there
                box["error"] = e
            finally:
                done.set()

        threading.Thread(target=call, name=f"{self.client}-{what}", daemon=True).start()
        while not done.wait(max(0.0, min(0.5, deadline - time.monotonic()))):
            self._producer.poll(0)  # serves error_cb: a loss of every broker sets _broker_lost
            self._beat()
            now = time.monotonic()
            if now < deadline and self._broker_lost.is_set() and self.broker_answers():
                deadline = min(deadline, now + self.grace_s)  # back after a loss: give it the grace only
            if now >= deadline:
                waited = round(now - t0, 1)
                self._wedged = True
                log.error(f"{what} did not return; the process must exit",
                          extra={"producer": self.client, "waited_s": waited,
                                 "broker_lost": self._broker_lost.is_set()})
                raise ProducerWedged(f"{what} did not return within {waited:g} s (librdkafka#5456)")
        if "error" in box:
            raise box["error"]
        return deadline

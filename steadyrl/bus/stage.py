"""A consume-transform-produce stage: the delivery rules of every steadyrl worker.

Guarantee (mode="transactional"): each input record yields its outputs (or its DLQ record)
exactly once as seen by read_committed consumers, across crashes (SIGKILL included),
restarts and rebalances. Assumptions: outputs are produced only by this stage's producer,
the instance's `transactional.id` is stable across its restarts (else the open transaction
of a dead instance is aborted only after `transaction.timeout.ms`), and downstream reads
with isolation.level=read_committed.

Guarantee (mode="at_least_once"): outputs are delivered (acks=all, idempotent producer)
before the input offsets are committed; after a crash some outputs may repeat.

The loop is flat, as in confluent-kafka's eos example:

    consume batch -> pause -> transform in a worker thread while polling -> resume
    -> begin txn -> produce outputs + DLQ records -> send offsets -> commit
    (abort + rewind to committed offsets if the transaction requires abort)

A record the codec refuses, or whose handler raises, goes to `rl.dlq` with its reason in
the same transaction as the batch's outputs. A handler that raises `RetryLater` makes the
whole batch wait: nothing is committed, the consumer rewinds, and the batch is retried
after a backoff. A batch handler may instead hold single records by returning a
`RetryLater` as their result: each partition is then committed up to its first held
record (outputs of records after it are not produced), the consumer rewinds to it, and the
held records are tried again with the next batch, after the backoff once a batch holds
nothing else -- held, never dropped, order kept per partition. Nothing a record contains can crash the loop.

A transactional producer that lived through the loss of every broker (a broker restart) is
replaced once a broker answers again, before the next transaction: librdkafka keeps a stale
group coordinator and its next send_offsets_to_transaction would hang for good
(confluentinc/librdkafka#5456, #5511). The new producer's init_transactions fences the old one;
the consumer keeps its partitions. A transaction caught in flight by the loss ends the
process once the broker is back (ProducerWedged), leaving the group so a restart takes over at once.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Literal

from prometheus_client import Counter, Gauge, Histogram

from steadyrl import codec
from steadyrl.bus.kafka import consumer_config, producer_config
from steadyrl.contracts import Contract, DLQReason
from steadyrl.http import Health
from steadyrl.topics import load_catalogue, topic_name

log = logging.getLogger(__name__)

RECORDS = Counter("steadyrl_stage_records", "Input records handled", ["stage", "outcome"])
DLQ = Counter("steadyrl_stage_dlq_records", "Records sent to the DLQ", ["stage", "reason"])
TXNS = Counter("steadyrl_stage_transactions", "Transactions finished", ["stage", "result"])
BATCH_SECONDS = Histogram("steadyrl_stage_batch_seconds", "Transform time of one batch", ["stage"],
                          buckets=(0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300))
LAST_COMMIT = Gauge("steadyrl_stage_last_commit_timestamp_seconds", "Unix time of the last commit", ["stage"])
BUSY = Gauge("steadyrl_stage_busy", "1 while a batch is being transformed (partitions paused)", ["stage"])
RENEWALS = Counter("steadyrl_stage_producer_renewals", "Transactional producers replaced after the broker was lost",
                   ["stage"])


#: Timeout of send_offsets_to_transaction: transaction.timeout.ms (steadyrl.bus.kafka), after
#: which the coordinator aborts the transaction anyway. Past it plus the grace the call is
#: taken as wedged (see Stage._send_offsets).
TXN_TIMEOUT_S = 30.0
TXN_GRACE_S = 5.0

#: After the first record of a batch, how long to wait for more before starting (seconds).
FILL_WAIT_S = 0.005


class ProducerWedged(RuntimeError):
    """A transactional producer call did not return by its deadline: the process must exit."""


class RetryLater(Exception):
    """Raised by a handler when the batch cannot be processed now (e.g. a dependency is down).

    Nothing is committed; the batch is re-read and retried after `backoff_s`.
    """

    def __init__(self, message: str, backoff_s: float = 1.0):
        super().__init__(message)
        self.backoff_s = backoff_s


@dataclass(frozen=True)
class Meta:
    """Where an input record came from."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    timestamp_ms: int


@dataclass
class Output:
    """One record to produce: `topic` is the catalogue name (e.g. "rl.scored")."""

    topic: str
    key: str | bytes | None
    value: Contract


#: A handler turns one accepted input into zero or more outputs. It must be a pure
#: function of its input (it may run again for the same record after a crash).
Handler = Callable[[Contract, Meta], list[Output]]
#: A batch handler does the same for every accepted record of a batch at once (one
#: result list per record, in order, or a RetryLater to hold that record, or a
#: codec.Rejected to send it to rl.dlq with its reason); the rollout worker uses it to send
#: one request and to refuse groups its gate emptied, the reward worker to hold groups it
#: cannot score yet.
BatchHandler = Callable[[list[tuple[Contract, Meta]]], "list[list[Output] | RetryLater]"]


class Stage:
    """One consumer-group member that transforms `input_topic` records into outputs.

    Args:
        name: stage name; labels metrics and DLQ records (`stage` = `name/instance_id`).
        bootstrap, topic_prefix, instance_id: from the service config.
        input_topic: catalogue name of the input (e.g. "rl.rollouts").
        input_contract: the contract expected on it.
        group_id: consumer group (all instances of a service share one).
        handle: the transform (see `Handler`), or
        handle_batch: the transform of a whole batch (see `BatchHandler`). When it raises
            (other than RetryLater), each record is retried alone so only the failing one
            goes to the DLQ.
        mode: "transactional" (exactly-once) or "at_least_once".
        batch_size: max records per transaction.
        batch_timeout_s: longest wait for the next record before the loop ticks (seconds).
        health: heartbeat and readiness checks (added: broker, assignment).
        stats_interval_s: librdkafka statistics interval.
        max_record_bytes: larger input values go to the DLQ as oversize (default: the
            input topic's max_message_bytes from the catalogue).
        pause_after_s: a transform running longer than this gets its partitions paused
            while the loop keeps polling.
    """

    def __init__(self, *, name: str, bootstrap: str, topic_prefix: str, instance_id: str,
                 input_topic: str, input_contract: type[Contract], group_id: str, handle: Handler | None = None,
                 handle_batch: BatchHandler | None = None,
                 mode: Literal["transactional", "at_least_once"] = "transactional",
                 batch_size: int = 16, batch_timeout_s: float = 0.5, health: Health | None = None,
                 stats_interval_s: float = 5.0, max_poll_interval_s: float = 300.0,
                 max_record_bytes: int | None = None, pause_after_s: float = 0.5):
        from confluent_kafka import Consumer

        if (handle is None) == (handle_batch is None):
            raise ValueError("give exactly one of handle or handle_batch")
        self.name, self.mode, self.handle, self.handle_batch = name, mode, handle, handle_batch
        self.prefix = topic_prefix
        self.stage_id = f"{name}/{instance_id}"
        self.input_contract = input_contract
        self.input_topic = topic_name(input_topic, topic_prefix)
        catalogue = load_catalogue()
        self.max_bytes = max_record_bytes or catalogue[input_topic].max_message_bytes
        self.batch_size, self.batch_timeout_s = batch_size, batch_timeout_s
        self.pause_after_s = pause_after_s
        self.health = health or Health()
        client = f"{name}-{instance_id}"
        consumer_cfg = consumer_config(bootstrap, f"{client}-consumer", group_id, stats_interval_s,
                                       max_poll_interval_s)
        txn_id = f"steadyrl-{name}-{instance_id}" if mode == "transactional" else None
        self._producer_config = producer_config(bootstrap, f"{client}-producer", txn_id, stats_interval_s)
        # Set by the current producer's error_cb when all its broker connections are down
        # (see _renew_producer); _generation tells the current producer from replaced ones.
        self._broker_lost = threading.Event()
        self._generation = 0
        self._stop = threading.Event()  # run()'s, once running
        self.consumer = Consumer(consumer_cfg)
        self.producer = self._new_producer()
        self._stats_client = f"{client}-consumer"
        self._assigned: set[tuple[str, int]] = set()
        self._revoked_during_batch: set[tuple[str, int]] = set()
        self._busy = False
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-transform")
        self._delivery_errors: list[str] = []
        self.health.add_check("assignment", self._check_assignment)
        self.health.add_check("broker", self._check_broker)

    def _new_producer(self):
        """A producer of `_producer_config` whose error_cb flags a loss of every broker, as long
        as it is the current one (events of a replaced producer can still be served)."""
        from confluent_kafka import Producer

        self._generation += 1
        generation, log_error = self._generation, self._producer_config["error_cb"]

        def error_cb(err) -> None:
            log_error(err)
            self._on_producer_error(err, generation)

        return Producer({**self._producer_config, "error_cb": error_cb})

    def _on_producer_error(self, err, generation: int) -> None:
        from confluent_kafka import KafkaError

        if err.code() == KafkaError._ALL_BROKERS_DOWN and generation == self._generation:
            self._broker_lost.set()

    # ---- readiness -------------------------------------------------------------------
    def _check_assignment(self) -> tuple[bool, str]:
        n = len(self._assigned)
        return n > 0, f"{n} partitions of {self.input_topic} assigned"

    def _check_broker(self) -> tuple[bool, str]:
        from steadyrl.bus.kafka import STATS

        if self._broker_lost.is_set() and self.mode == "transactional":  # statistics freeze meanwhile
            return False, "every broker was lost; the transactional producer is replaced once one answers"

        up = STATS.brokers_up(self._stats_client)
        if up is None:
            return bool(self._assigned), "no statistics yet; assignment implies a reachable broker"
        return up > 0, f"{up} brokers up"

    # ---- rebalance callbacks (run inside poll/consume) ---------------------------------
    def _on_assign(self, consumer, partitions) -> None:
        self._assigned |= {(p.topic, p.partition) for p in partitions}
        log.info("partitions assigned", extra={"stage": self.stage_id,
                                               "partitions": sorted(p.partition for p in partitions)})

    def _on_revoke(self, consumer, partitions) -> None:
        gone = {(p.topic, p.partition) for p in partitions}
        self._assigned -= gone
        if self._busy:
            self._revoked_during_batch |= gone
        log.info("partitions revoked", extra={"stage": self.stage_id,
                                              "partitions": sorted(p.partition for p in partitions)})

    # ---- the loop ----------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Run until `stop` is set; then abort any open transaction and close the clients.

        Raises confluent_kafka.KafkaException on a fatal producer error (the process should
        exit and be restarted; the next instance resumes from committed offsets).
        """
        self._stop = stop
        if self.mode == "transactional":
            self.producer.init_transactions(60)
        self.consumer.subscribe([self.input_topic], on_assign=self._on_assign,
                                on_revoke=self._on_revoke, on_lost=self._on_revoke)
        log.info("stage running", extra={"stage": self.stage_id, "mode": self.mode,
                                         "input": self.input_topic})
        try:
            while not stop.is_set():
                self.health.beat()
                self.producer.poll(0)  # serves error_cb first: a loss of every broker sets _broker_lost
                if self._broker_lost.is_set() and self.mode == "transactional":
                    self._renew_producer(stop)
                    continue
                msgs = [m for m in self._next_batch() if self._usable(m)]
                if msgs:
                    self._process(msgs)
        finally:
            self.close()

    def _broker_answers(self, timeout_s: float = 1.0) -> bool:
        from confluent_kafka import KafkaException

        try:
            self.producer.list_topics(self.input_topic, timeout=timeout_s)
            return True
        except KafkaException:
            return False

    def _renew_producer(self, stop: threading.Event) -> bool:
        """Replace the transactional producer after every broker was lost; no transaction is open.

        Waits (still beating) until a broker answers a metadata request, then builds a producer
        with the same transactional.id: its init_transactions bumps the epoch, fencing the old
        one, whose coordinator state librdkafka would never refresh (#5511), so its next
        send_offsets_to_transaction would hang (#5456). The consumer and its partitions stay
        (unless the wait outlasts max.poll.interval.ms: the member then rejoins at the committed
        offsets). Returns False when `stop` was set while waiting (nothing replaced).
        """
        log.warning("every broker was lost; replacing the transactional producer once one answers",
                    extra={"stage": self.stage_id})
        t0 = time.monotonic()
        while not self._broker_answers():
            if stop.is_set():
                return False
            self.health.beat()  # the consumer is not polled: a record it returned now would be skipped
            stop.wait(0.2)
        old, self.producer = self.producer, self._new_producer()  # old events no longer count
        self._broker_lost.clear()
        self.producer.init_transactions(60)  # fences the old one
        del old
        RENEWALS.labels(self.name).inc()
        log.info("transactional producer replaced", extra={"stage": self.stage_id,
                                                           "waited_s": round(time.monotonic() - t0, 2)})
        return True

    def _next_batch(self) -> list:
        """Up to batch_size records: whatever is already fetched, else wait for the first; then,
        when the batch is not full, at most FILL_WAIT_S more for the rest.

        Never waits longer for a batch to fill, so latency at low rates is about one
        transaction, and batches grow by themselves under load.
        """
        msgs = self.consumer.consume(self.batch_size, timeout=0)
        if not msgs:
            msgs = self.consumer.consume(1, timeout=self.batch_timeout_s)
        if msgs and len(msgs) < self.batch_size:
            # Records one producer flushed together (a learner step's prompts, a transaction's
            # rollouts) often come in two fetches: a moment for the second makes one batch, one
            # actor call and one transaction of them instead of two.
            msgs += self.consumer.consume(self.batch_size - len(msgs), timeout=FILL_WAIT_S)
        return msgs

    def _usable(self, m) -> bool:
        if m.error() is None:
            return True
        log.warning("consume error", extra={"stage": self.stage_id, "error": str(m.error())})
        return False

    def _process(self, msgs: list) -> None:
        self._revoked_during_batch = set()
        t0 = time.monotonic()
        try:
            tagged, held = self._transform_while_polling(msgs)
        except RetryLater as e:
            log.warning("batch deferred", extra={"stage": self.stage_id, "why": str(e)})
            self._rewind()
            time.sleep(e.backoff_s)
            return
        BATCH_SECONDS.labels(self.name).observe(time.monotonic() - t0)
        batch_parts = {(m.topic(), m.partition()) for m in msgs}
        if batch_parts & self._revoked_during_batch:
            # Another member owns some of these partitions now: it will redo them.
            log.info("partitions revoked mid-batch; dropping batch", extra={"stage": self.stage_id})
            self._rewind()
            return
        offsets = self._next_offsets(msgs)
        progressed = True
        if held:  # commit each partition only up to its first held record
            first = {}
            for m in msgs:
                tp = (m.topic(), m.partition())
                first[tp] = min(first.get(tp, m.offset()), m.offset())
            tagged = [t for t in tagged if t[0] not in held or t[1] < held[t[0]][0]]
            for tp in offsets:
                if (tp.topic, tp.partition) in held:
                    tp.offset = held[(tp.topic, tp.partition)][0]
            progressed = bool(tagged) or any(tp.offset > first[(tp.topic, tp.partition)] for tp in offsets)
        outputs = [out for _, _, out in tagged]
        if progressed:  # a batch held at its very start moves nothing: no empty transaction
            if self.mode == "transactional":
                self._commit_transaction(outputs, offsets)
            else:
                self._commit_at_least_once(outputs, offsets)
        if held:
            why = next(iter(held.values()))[1]
            RECORDS.labels(self.name, "held").inc(sum(1 for m in msgs if (m.topic(), m.partition()) in held
                                                      and m.offset() >= held[(m.topic(), m.partition())][0]))
            log.warning("records held", extra={"stage": self.stage_id, "partitions": len(held), "why": str(why)})
            self._rewind()
            if not progressed:  # only held records left: wait before trying them again
                time.sleep(max(e.backoff_s for _, e in held.values()))

    def _transform_while_polling(self, msgs: list):
        """Run the transform in a worker thread; if it takes longer than `pause_after_s`,
        pause the assignment and keep polling until it is done (max.poll.interval.ms never
        trips). Fast transforms are not paused: pausing drops prefetched records."""
        from concurrent.futures import TimeoutError as FutureTimeout

        from confluent_kafka import TopicPartition

        self._busy = True
        BUSY.labels(self.name).set(1)
        fut = self._pool.submit(self._transform, msgs)
        paused: set[tuple[str, int]] = set()
        try:
            try:
                return fut.result(timeout=self.pause_after_s)
            except FutureTimeout:
                pass
            while True:
                self.health.beat()
                now = {(p.topic, p.partition) for p in self.consumer.assignment()}
                if now - paused:  # first time, or assigned mid-batch: keep them paused
                    self.consumer.pause([TopicPartition(t, p) for t, p in now - paused])
                    paused |= now
                stray = self.consumer.poll(0)
                if stray is not None and stray.error() is None:
                    # Fetched before the pause took effect: put it back for the next batch.
                    self.consumer.seek(TopicPartition(stray.topic(), stray.partition(), stray.offset()))
                self.producer.poll(0)
                try:
                    return fut.result(timeout=0.1)
                except FutureTimeout:
                    continue
        finally:
            self._busy = False
            BUSY.labels(self.name).set(0)
            if paused:
                self.consumer.resume(self.consumer.assignment())

    def _transform(self, msgs: list):
        """Returns (outputs tagged with their input record, held): outputs are
        ((topic, partition), offset, (out_topic, key, value)); held maps (topic, partition)
        to (first held offset, its RetryLater)."""
        out: list = []
        held: dict[tuple[str, int], tuple[int, RetryLater]] = {}
        accepted: list[tuple[Contract, Meta, object]] = []
        for m in msgs:
            meta = Meta(m.topic(), m.partition(), m.offset(), m.key(), m.timestamp()[1])
            try:
                accepted.append((codec.decode(m.value(), m.headers(), self.input_contract, self.max_bytes), meta, m))
            except codec.Rejected as rej:
                out.append(((meta.topic, meta.partition), meta.offset, self._dlq(rej, meta, m.value())))
        if not accepted:
            return out, held
        try:
            results = self._call([(v, meta) for v, meta, _ in accepted])
        except RetryLater:
            raise
        except Exception:  # isolate the record(s) that fail: one call per record
            results = []
            for v, meta, m in accepted:
                try:
                    results.append(self._call([(v, meta)])[0])
                except RetryLater:
                    raise
                except Exception as e:  # the handler's bug must not stop the stage
                    log.exception("handler failed", extra={"stage": self.stage_id, "offset": meta.offset})
                    rej = codec.Rejected(DLQReason.handler_error, f"{type(e).__name__}: {e}",
                                         codec.header_value(m.headers()))
                    results.append(self._dlq(rej, meta, m.value()))
        for (_, meta, m), res in zip(accepted, results):
            tp = (meta.topic, meta.partition)
            if isinstance(res, RetryLater):
                if tp not in held or meta.offset < held[tp][0]:
                    held[tp] = (meta.offset, res)
                continue
            if isinstance(res, codec.Rejected):  # the handler refused this record (a data gate)
                out.append((tp, meta.offset, self._dlq(res, meta, m.value())))
                continue
            if isinstance(res, tuple):  # a DLQ record
                out.append((tp, meta.offset, res))
                continue
            RECORDS.labels(self.name, "ok").inc()
            out.extend((tp, meta.offset, (topic_name(o.topic, self.prefix), o.key, o.value)) for o in res)
        return out, held

    def _call(self, items: list[tuple[Contract, Meta]]) -> list[list[Output]]:
        if self.handle_batch is not None:
            results = self.handle_batch(items)
            if len(results) != len(items):
                raise RuntimeError(f"batch handler returned {len(results)} results for {len(items)} records")
            return results
        return [self.handle(v, meta) for v, meta in items]

    def _dlq(self, rej: codec.Rejected, meta: Meta, value: bytes | None):
        RECORDS.labels(self.name, "dlq").inc()
        DLQ.labels(self.name, rej.reason.value).inc()
        log.warning("record to DLQ", extra={"stage": self.stage_id, "reason": rej.reason.value,
                                            "detail": rej.detail, "topic": meta.topic,
                                            "partition": meta.partition, "offset": meta.offset})
        rec = codec.dlq_record(rej, stage=self.stage_id, topic=meta.topic, partition=meta.partition,
                               offset=meta.offset, key=meta.key, value=value)
        return topic_name("rl.dlq", self.prefix), meta.key, rec

    @staticmethod
    def _next_offsets(msgs: list) -> list:
        from confluent_kafka import TopicPartition

        last: dict[tuple[str, int], int] = {}
        for m in msgs:
            k = (m.topic(), m.partition())
            last[k] = max(last.get(k, -1), m.offset())
        return [TopicPartition(t, p, o + 1) for (t, p), o in last.items()]

    def _produce(self, outputs, on_delivery=None) -> None:
        for topic, key, value in outputs:
            payload, headers = codec.encode(value)
            while True:
                try:
                    self.producer.produce(topic, payload, key=key, headers=headers, on_delivery=on_delivery)
                    break
                except BufferError:  # local queue full: serve delivery reports, then retry
                    self.producer.poll(0.1)

    def _commit_transaction(self, outputs, offsets) -> None:
        from confluent_kafka import KafkaException

        # A loss noticed while the batch was transformed (the polls in _transform_while_polling
        # serve error_cb too): replace the producer before this transaction, not after it hangs.
        if self._broker_lost.is_set() and not self._renew_producer(self._stop):
            return  # stopping: nothing committed, the batch is redone by whoever reads it next
        try:
            self.producer.begin_transaction()
            self._produce(outputs)
            self._send_offsets(offsets)
            self._commit_with_retry()
        except KafkaException as e:
            err = e.args[0]
            if err.txn_requires_abort():
                log.warning("transaction aborted", extra={"stage": self.stage_id, "error": str(err)})
                self.producer.abort_transaction(60)
                TXNS.labels(self.name, "aborted").inc()
                self._rewind()
                return
            raise  # fatal: exit; the restarted instance fences this one and resumes
        TXNS.labels(self.name, "committed").inc()
        # The transaction committed the offsets, not this consumer: store them so librdkafka's
        # statistics (consumer_lag_stored -> steadyrl_kafka_consumer_lag) see the progress.
        try:
            self.consumer.store_offsets(offsets=offsets)
        except Exception:  # a partition revoked meanwhile: its new owner reports its lag
            pass
        LAST_COMMIT.labels(self.name).set(time.time())

    def _send_offsets(self, offsets) -> None:
        """send_offsets_to_transaction with a deadline librdkafka itself does not keep.

        While the group coordinator is down (a broker restart) the call can block past its
        timeout for good (confluentinc/librdkafka#5456, open): bench/chaos.py left stages stuck
        in it, the pipeline stalled and SIGTERM could not stop them. It runs in a daemon thread;
        past TXN_TIMEOUT_S + TXN_GRACE_S the producer is wedged and ProducerWedged is raised:
        the process exits and `steadyrl up` restarts it (the new instance fences this one).
        When every broker was lost during the call, it is taken as wedged TXN_GRACE_S after a
        broker answers again: after a broker restart it never returns (#5511).
        """
        box: dict = {}
        done = threading.Event()
        meta = self.consumer.consumer_group_metadata()

        def call():
            try:
                self.producer.send_offsets_to_transaction(offsets, meta, TXN_TIMEOUT_S)
            except BaseException as e:  # handed to the stage's thread below
                box["error"] = e
            finally:
                done.set()

        threading.Thread(target=call, name=f"{self.name}-send-offsets", daemon=True).start()
        t0 = time.monotonic()
        deadline = t0 + TXN_TIMEOUT_S + TXN_GRACE_S
        while not done.wait(max(0.0, min(0.5, deadline - time.monotonic()))):
            self.producer.poll(0)  # serves error_cb: a loss of every broker sets _broker_lost
            self.health.beat()
            now = time.monotonic()
            if now < deadline and self._broker_lost.is_set() and self._broker_answers():
                deadline = min(deadline, now + TXN_GRACE_S)  # back after a loss: give it the grace only
            if now >= deadline:
                waited = round(now - t0, 1)
                log.error("send_offsets_to_transaction did not return; exiting so the stage is restarted",
                          extra={"stage": self.stage_id, "waited_s": waited,
                                 "broker_lost": self._broker_lost.is_set()})
                raise ProducerWedged(f"send_offsets_to_transaction did not return within {waited:g} s "
                                     f"(librdkafka#5456)")
        if "error" in box:
            raise box["error"]

    def _commit_with_retry(self, attempts: int = 10) -> None:
        from confluent_kafka import KafkaException

        for i in range(attempts):
            try:
                self.producer.commit_transaction(60)
                return
            except KafkaException as e:
                if e.args[0].retriable() and i + 1 < attempts:
                    time.sleep(min(0.1 * 2 ** i, 5))
                    continue
                raise

    def _commit_at_least_once(self, outputs, offsets) -> None:
        self._delivery_errors.clear()

        def on_delivery(err, msg):
            if err is not None:
                self._delivery_errors.append(str(err))

        self._produce(outputs, on_delivery)
        left = self.producer.flush(300)
        if left or self._delivery_errors:
            log.error("outputs not delivered; rewinding", extra={"stage": self.stage_id, "left": left,
                                                                 "errors": self._delivery_errors[:3]})
            self._rewind()
            return
        self.consumer.commit(offsets=offsets, asynchronous=False)
        TXNS.labels(self.name, "committed").inc()
        LAST_COMMIT.labels(self.name).set(time.time())

    def _rewind(self) -> None:
        """Seek every assigned partition back to its committed offset."""
        assignment = self.consumer.assignment()
        if not assignment:
            return
        for tp in self.consumer.committed(assignment, timeout=30):
            if tp.offset < 0:  # nothing committed yet: start of the log (auto.offset.reset=earliest)
                from confluent_kafka import OFFSET_BEGINNING

                tp.offset = OFFSET_BEGINNING
            self.consumer.seek(tp)

    def close(self) -> None:
        """Abort an open transaction, flush, and close the consumer (leaving the group)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        try:
            self.producer.flush(10)
        except Exception:
            pass
        try:
            self.consumer.close()
        except Exception as e:
            log.warning("consumer close failed", extra={"stage": self.stage_id, "error": str(e)})
        log.info("stage stopped", extra={"stage": self.stage_id})

"""A consume-transform-produce stage: the delivery rules of every steadyrl worker.

Guarantee: each input record yields its outputs (or its DLQ record) exactly once as seen by
read_committed consumers, across crashes (SIGKILL included), restarts and rebalances.
Assumptions: outputs are produced only by this stage's producer, the instance's
`transactional.id` is stable across its restarts (else the open transaction of a dead
instance is aborted only after `transaction.timeout.ms`), and downstream reads with
isolation.level=read_committed.

The loop is flat, as in confluent-kafka's `examples/eos_transactions.py`:

    consume batch -> transform in a worker thread (pausing and polling when it is slow)
    -> begin txn -> produce outputs + DLQ records -> send offsets -> commit
    abortable error: the producer aborts, the stage rewinds to the committed offsets
    fatal error, wedged producer: raised, the process exits and its successor fences it

What each transactional error means, and the librdkafka defects around a broker restart
(producer renewal, the send-offsets deadline), live in steadyrl.bus.txn.TransactionalProducer.

A record the codec refuses, or whose handler raises, goes to `rl.dlq` with its reason in
the same transaction as the batch's outputs; so does an output that cannot be encoded, or
is above its topic's record limit (checked before produce, so it never aborts the
transaction): the rest of the batch proceeds. A handler holds a record by returning a
`RetryLater` as its result, or every record of its call by raising one: each partition is
then committed up to its first held record (outputs of records after it are not
produced), the consumer rewinds to it, and the held records are tried again with the next
batch, after the backoff once a batch holds nothing else -- order kept per partition.

No record is held forever while its dependency serves others (the budget):

    RetryLater(counts=False)  the dependency did not answer, or is down for everything
                              (unreachable, timed out, breaker open): held without limit
    RetryLater(counts=True)   it answered and failed this record (a 5xx, "behind"): the try
                              counts. Once `max_attempts` tries have counted and `max_hold_s`
                              passed since the first, the record is tried alone; failing
                              alone again, it goes to rl.dlq (`retries_exhausted`, with the
                              last error) -- if another record was done (outputs or a
                              refusal) since its first counted failure, the evidence that the
                              dependency answers others. Without that evidence it is held.
    RetryLater(own=True)      counts, and the handler just saw the dependency serve other work
                              (a known-good request passed): the record is tried alone from
                              the next try, and needs no other evidence once its budget is spent

The budget lives in memory, per (topic, partition, offset): a restart or a rebalance starts
it again (at most `max_hold_s` more per restart). Nothing a record contains can crash the
loop.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeAlias, cast

from confluent_kafka import OFFSET_BEGINNING, Consumer, Message, TopicPartition
from prometheus_client import Counter, Gauge, Histogram

from steadyrl.bus.budget import Budgets
from steadyrl.bus.kafka import MAX_RECORD_BYTES, STATS, consumer_config
from steadyrl.bus.records import (
    DLQ_ERROR_CHARS,
    RECORD_FRAMING_BYTES,
    BatchHandler,
    Handler,
    Held,
    Meta,
    Output,
    Pending,
    RetryLater,
    Transformed,
    record_bytes,
    refusal_reason,
)
from steadyrl.bus.topics import load_catalogue, topic_name
from steadyrl.bus.txn import ProducerWedged, TransactionAborted, TransactionalProducer
from steadyrl.http import Health
from steadyrl.wire import codec
from steadyrl.wire.contracts import Contract, DLQReason

__all__ = ["DLQ_ERROR_CHARS", "RECORD_FRAMING_BYTES", "BatchHandler", "Handler", "Held", "Meta", "Output",
           "Pending", "ProducerWedged", "RetryLater", "Stage", "Transformed", "record_bytes", "refusal_reason"]

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
#: While a batch is not full, how long each wait for more records lasts (seconds): the batch
#: starts after a wait that brings nothing, or FILL_MAX_S after its first record.
FILL_WAIT_S = 0.005
FILL_MAX_S = 0.05
#: What the handler gives for one record: its outputs, a RetryLater that holds it, or a
#: codec.Rejected that sends it to rl.dlq.
Result: TypeAlias = list[Output] | RetryLater | codec.Rejected


def fill_batch(consume: Callable[..., list[Message]], batch_size: int, first_wait_s: float,
               fill_wait_s: float, fill_max_s: float) -> list[Message]:
    """Up to `batch_size` records from `consume(n, timeout=seconds)` (a Consumer's `consume`).

    Takes what is already fetched, else waits up to `first_wait_s` for a first record; then,
    while the batch is not full, waits of `fill_wait_s` for more, as long as each brings some,
    for at most `fill_max_s` after the first wait (all in seconds). So records one producer sent
    together but that arrive in several fetches (a learner step's prompts, a transaction's
    rollouts) make one batch, a batch starts at most about `fill_wait_s` after its last record,
    and batches grow by themselves under load. Returns [] when nothing came.
    """
    msgs = consume(batch_size, timeout=0)
    if not msgs:
        msgs = consume(1, timeout=first_wait_s)
    deadline = time.monotonic() + fill_max_s
    while msgs and len(msgs) < batch_size and (left := deadline - time.monotonic()) > 0:
        more = consume(batch_size - len(msgs), timeout=min(fill_wait_s, left))
        if not more:
            break
        msgs += more
    return msgs


def _where(m: Message) -> tuple[str, int, int]:
    """(topic, partition, offset) of a consumed record: librdkafka sets all three on every record
    it delivers (None only on an error event, which `_usable` keeps out of a batch)."""
    topic, partition, offset = m.topic(), m.partition(), m.offset()
    assert topic is not None and partition is not None and offset is not None, "an error event, not a record"
    return topic, partition, offset


class Stage:
    """One consumer-group member that transforms `input_topic` records into outputs, exactly once.

    Args:
        name: stage name; labels metrics and DLQ records (`stage` = `name/instance_id`).
        bootstrap, topic_prefix, instance_id: from the service config; the transactional.id
            is `steadyrl-{name}-{instance_id}`.
        input_topic: catalogue name of the input (e.g. "rl.rollouts").
        input_contract: the contract expected on it.
        more_inputs: further input topics (catalogue name -> contract), consumed by the same
            group and transaction (the rollout worker's rl.episodes); the handler tells the
            records apart by their contract.
        group_id: consumer group (all instances of a service share one).
        handle: the transform (see `Handler`), or
        handle_batch: the transform of a whole batch (see `BatchHandler`). When it raises
            (other than RetryLater), each record is retried alone so only the failing one
            goes to the DLQ.
        batch_size: max records per transaction.
        batch_timeout_s: longest wait for the next record before the loop ticks (seconds).
        health: heartbeat and readiness checks (added: assignment, broker).
        stats_interval_s: librdkafka statistics interval (seconds).
        max_poll_interval_s: max.poll.interval.ms of the consumer (seconds).
        max_record_bytes: larger input values go to the DLQ as oversize (default: the
            input topic's max_message_bytes from the catalogue).
        pause_after_s: a transform running longer than this gets its partitions paused
            while the loop keeps polling (rebalance callbacks are served then: a revocation
            waits for at most this long).
        max_hold_s, max_attempts: the budget of a record whose tries count (module doc): it is
            dropped only after both, `max_hold_s` seconds since its first counted failure and
            `max_attempts` counted tries (then one more, alone).

    Raises:
        ValueError: neither or both of handle and handle_batch.
    """

    def __init__(self, *, name: str, bootstrap: str, topic_prefix: str, instance_id: str,
                 input_topic: str, input_contract: type[Contract], group_id: str, handle: Handler | None = None,
                 handle_batch: BatchHandler | None = None, batch_size: int = 16, batch_timeout_s: float = 0.5,
                 health: Health | None = None, stats_interval_s: float = 5.0, max_poll_interval_s: float = 300.0,
                 max_record_bytes: int | None = None, pause_after_s: float = 0.5, max_hold_s: float = 900.0,
                 max_attempts: int = 5, more_inputs: dict[str, type[Contract]] | None = None):
        if (handle is None) == (handle_batch is None):
            raise ValueError("give exactly one of handle or handle_batch")
        self.name, self.handle, self.handle_batch = name, handle, handle_batch
        self.prefix = topic_prefix
        self.stage_id = f"{name}/{instance_id}"
        self.input_contract = input_contract
        self.input_topic = topic_name(input_topic, topic_prefix)
        catalogue = load_catalogue()
        self.max_bytes = max_record_bytes or catalogue[input_topic].max_message_bytes
        # full topic name -> (contract, record limit) of every input
        self._inputs = {self.input_topic: (input_contract, self.max_bytes)}
        for t, c in (more_inputs or {}).items():
            self._inputs[topic_name(t, topic_prefix)] = (c, max_record_bytes or catalogue[t].max_message_bytes)
        self._output_limits = {t: spec.max_message_bytes for t, spec in catalogue.items()}
        self.batch_size, self.batch_timeout_s = batch_size, batch_timeout_s
        self.pause_after_s = pause_after_s
        self.health = health or Health()
        client = f"{name}-{instance_id}"
        self._stop = threading.Event()  # run()'s, once running
        self.consumer = Consumer(consumer_config(bootstrap, f"{client}-consumer", group_id, stats_interval_s,
                                                 max_poll_interval_s))
        self.producer = TransactionalProducer(bootstrap, f"{client}-producer", f"steadyrl-{name}-{instance_id}",
                                              stats_interval_s=stats_interval_s, probe_topic=self.input_topic,
                                              beat=self.health.beat, on_renewed=RENEWALS.labels(name).inc)
        self._stats_client = f"{client}-consumer"
        self._assigned: set[tuple[str, int]] = set()
        self._revoked_during_batch: set[tuple[str, int]] = set()
        self._busy = False
        # Budgets by (topic, partition, offset): written by the transform thread, pruned by the
        # rebalance callbacks and after commits (the loop's thread), hence the lock.
        self.budgets = Budgets(name, max_hold_s=max_hold_s, max_attempts=max_attempts)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-transform")
        self.health.add_check("assignment", self._check_assignment)
        self.health.add_check("broker", self._check_broker)

    # ---- readiness -------------------------------------------------------------------
    def _check_assignment(self) -> tuple[bool, str]:
        n = len(self._assigned)
        return n > 0, f"{n} partitions of {self.input_topic} assigned"

    def _check_broker(self) -> tuple[bool, str]:
        if self.producer.broker_lost:  # statistics freeze meanwhile
            return False, "every broker was lost; the transactional producer is replaced once one answers"
        up = STATS.brokers_up(self._stats_client)
        if up is None:
            return bool(self._assigned), "no statistics yet; assignment implies a reachable broker"
        return up > 0, f"{up} brokers up"

    # ---- rebalance callbacks (run inside poll/consume) ---------------------------------
    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._assigned |= {(p.topic, p.partition) for p in partitions}
        # a budget from an earlier ownership of these partitions is stale
        self.budgets.forget_partitions({(p.topic, p.partition) for p in partitions})
        log.info("partitions assigned", extra={"stage": self.stage_id,
                                               "partitions": sorted(p.partition for p in partitions)})

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        gone = {(p.topic, p.partition) for p in partitions}
        self._assigned -= gone
        self.budgets.forget_partitions(gone)
        if self._busy:
            self._revoked_during_batch |= gone
        log.info("partitions revoked", extra={"stage": self.stage_id,
                                              "partitions": sorted(p.partition for p in partitions)})

    # ---- the loop ----------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Run until `stop` is set; then close (aborting a transaction an error left open).

        Raises:
            confluent_kafka.KafkaException: a fatal producer error (the process should exit and
                be restarted; the next instance fences this one and resumes from the committed
                offsets).
            ProducerWedged: a producer call did not return by its deadline (the same).
        """
        self._stop = stop
        self.producer.init_transactions()  # fences a predecessor, aborting its open transaction
        self.consumer.subscribe(list(self._inputs), on_assign=self._on_assign,
                                on_revoke=self._on_revoke, on_lost=self._on_revoke)
        log.info("stage running", extra={"stage": self.stage_id, "input": self.input_topic})
        try:
            while not stop.is_set():
                self.health.beat()
                self.producer.poll(0)  # serves error_cb first: a loss of every broker is flagged
                if self.producer.broker_lost:
                    # Renewed before reading on (the consumer is not polled meanwhile); the
                    # consumer keeps its partitions.
                    self.producer.renew(stop)
                    continue
                msgs = self._take_batch()
                if msgs:
                    self._process(msgs)
        finally:
            self.close()

    def _next_batch(self) -> list[Message]:
        """The next batch of up to batch_size records (`fill_batch`)."""
        return fill_batch(self.consumer.consume, self.batch_size, self.batch_timeout_s, FILL_WAIT_S, FILL_MAX_S)

    def _take_batch(self) -> list[Message]:
        """The next batch's usable records of partitions this member still owns: one revoked
        while the batch filled (the rebalance callbacks run inside consume) is another member's
        now, and its records are left to it."""
        return [m for m in self._next_batch() if self._usable(m) and (m.topic(), m.partition()) in self._assigned]

    def _usable(self, m: Message) -> bool:
        if m.error() is None:
            return True
        log.warning("consume error", extra={"stage": self.stage_id, "error": str(m.error())})
        return False

    def _process(self, msgs: list[Message]) -> None:
        self._revoked_during_batch = set()
        t0 = time.monotonic()
        batch = self._transform_while_polling(msgs)
        BATCH_SECONDS.labels(self.name).observe(time.monotonic() - t0)
        if {(m.topic(), m.partition()) for m in msgs} & self._revoked_during_batch:
            # Another member owns some of these partitions now: it will redo them.
            log.info("partitions revoked mid-batch; dropping batch", extra={"stage": self.stage_id})
            self.budgets.forget_partitions(self._revoked_during_batch)  # the transform may have noted them again
            self._rewind()
            return
        outputs = [p for p in batch.pending if not batch.is_held(p.source, p.offset)]
        offsets, progressed = self._offsets_to_commit(msgs, batch, bool(outputs))
        # a batch held at its very start moves nothing: no empty transaction
        if progressed and self._commit_transaction(outputs, offsets):
            self.budgets.forget_committed(offsets)
        if batch.held:
            why = next(iter(batch.held.values())).why
            RECORDS.labels(self.name, "held").inc(sum(1 for t, p, o in map(_where, msgs)
                                                      if batch.is_held((t, p), o)))
            log.warning("records held", extra={"stage": self.stage_id, "partitions": len(batch.held),
                                               "why": str(why)})
            self._rewind()
            if not progressed:  # only held records left: wait before trying them again
                self._backoff(max(h.why.backoff_s for h in batch.held.values()))

    def _backoff(self, seconds: float) -> None:
        """Wait `seconds` before held records are tried again, beating the heartbeat about every
        second (a dependency down for longer than the liveness window is not a dead stage: a
        Retry-After may say 60 s); a stop ends the wait at once."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0 and not self._stop.wait(min(left, 1.0)):
            self.health.beat()

    @staticmethod
    def _offsets_to_commit(msgs: list[Message], batch: Transformed,
                           has_outputs: bool) -> tuple[list[TopicPartition], bool]:
        """The next offset of each partition of `msgs` (its last offset + 1; a held partition:
        its first held offset), and whether committing them moves anything (an output, or an
        offset past the batch's first of that partition)."""
        first: dict[tuple[str, int], int] = {}
        last: dict[tuple[str, int], int] = {}
        for m in msgs:
            topic, partition, offset = _where(m)
            tp = (topic, partition)
            first[tp] = min(first.get(tp, offset), offset)
            last[tp] = max(last.get(tp, -1), offset)
        offsets = [TopicPartition(t, p, batch.held[(t, p)].offset if (t, p) in batch.held else o + 1)
                   for (t, p), o in last.items()]
        progressed = not batch.held or has_outputs or any(tp.offset > first[(tp.topic, tp.partition)]
                                                          for tp in offsets)
        return offsets, progressed

    def _commit_transaction(self, outputs: list[Pending], offsets: list[TopicPartition]) -> bool:
        """begin -> produce -> send offsets -> commit; True when committed. An abortable error:
        the producer aborted the transaction, the consumer rewinds and the batch is redone.
        Fatal errors and ProducerWedged are raised (the process exits)."""
        try:
            # Renews the producer first if every broker was lost: the polls during a long
            # transform are often where that is noticed.
            if not self.producer.begin_transaction(self._stop):
                # stopping while waiting for a broker: nothing begun; the batch is redone by its next reader
                return False
            for out in outputs:  # encoded and size-checked by the transform
                self.producer.produce(out.topic, out.value, out.key, out.headers)
            self.producer.send_offsets_to_transaction(offsets, self.consumer.consumer_group_metadata())
            self.producer.commit_transaction()
        except TransactionAborted as e:
            log.warning("transaction aborted", extra={"stage": self.stage_id, "error": str(e.args[0])})
            TXNS.labels(self.name, "aborted").inc()
            self._rewind()
            return False
        TXNS.labels(self.name, "committed").inc()
        # The transaction committed the offsets, not this consumer: store them so librdkafka's
        # statistics (consumer_lag_stored -> steadyrl_kafka_consumer_lag) see the progress.
        with contextlib.suppress(Exception):  # a partition revoked meanwhile: its new owner reports its lag
            self.consumer.store_offsets(offsets=offsets)
        LAST_COMMIT.labels(self.name).set(time.time())
        return True

    def _transform_while_polling(self, msgs: list[Message]) -> Transformed:
        """Run the transform in a worker thread; if it takes longer than `pause_after_s`,
        pause the assignment and keep polling until it is done (max.poll.interval.ms never
        trips). Until then the loop only waits, beating the heartbeat about every second:
        pausing drops prefetched records, and after a resume the consumer took ~0.3 s (up to
        0.9 s) to deliver records already committed (measured on rl.episodes, docs/agents.md)."""
        self._busy = True
        BUSY.labels(self.name).set(1)
        fut = self._pool.submit(self._transform, msgs)
        paused: set[tuple[str, int]] = set()
        try:
            deadline = time.monotonic() + self.pause_after_s
            while (left := deadline - time.monotonic()) > 0:
                try:
                    return fut.result(timeout=min(left, 1.0))
                except FutureTimeout:
                    self.health.beat()
            while True:
                self.health.beat()
                now = {(p.topic, p.partition) for p in self.consumer.assignment()}
                if now - paused:  # first time, or assigned mid-batch: keep them paused
                    self.consumer.pause([TopicPartition(t, p) for t, p in now - paused])
                    paused |= now
                stray = self.consumer.poll(0)
                if stray is not None and stray.error() is None:
                    # Fetched before the pause took effect: put it back for the next batch.
                    tp = TopicPartition(stray.topic(), stray.partition(), stray.offset())  # type: ignore[arg-type]
                    self.consumer.seek(tp)  # (a delivered message has all three)
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

    def _transform(self, msgs: list[Message]) -> Transformed:
        """Decode, call the handler (alone for records whose budget says so), and collect the
        encoded outputs and DLQ records (as Pending) and the held records."""
        batch = Transformed()
        accepted: list[tuple[Contract, Meta, Message]] = []  # (value, meta, the message)
        for m in msgs:
            meta = Meta(*_where(m), m.key(), m.timestamp()[1])
            try:
                contract, limit = self._inputs.get(meta.topic, (self.input_contract, self.max_bytes))
                accepted.append((codec.decode(m.value(), m.headers(), contract, limit), meta, m))
            except codec.Rejected as rej:
                batch.pending.append(self._dlq(rej, meta, m.value()))
        if not accepted:
            return batch
        results, alone = self._handler_results(accepted)
        now = time.monotonic()
        if any(not isinstance(r, RetryLater) for r in results):
            self.budgets.done_s = now  # the dependency answers: the evidence a spent budget needs
        for (_, meta, m), res, solo in zip(accepted, results, alone, strict=True):
            tp = (meta.topic, meta.partition)
            if isinstance(res, RetryLater):
                spent = self.budgets.count(meta, res, solo, now)
                if spent is None:
                    batch.hold(tp, meta.offset, res)
                else:
                    seen = "the dependency served other work" if res.own else "other records were done"
                    batch.pending.append(self._dlq(codec.Rejected(
                        DLQReason.retries_exhausted, f"failed {spent.attempts} tries over "
                        f"{now - spent.first_s:.0f} s while {seen}; last error: {spent.error}",
                        codec.header_value(m.headers())), meta, m.value()))
                continue
            self.budgets.forget((meta.topic, meta.partition, meta.offset))
            # outputs: encoded and checked here, before produce
            out = res if isinstance(res, codec.Rejected) else self._encode(res, tp, meta.offset)
            if isinstance(out, codec.Rejected):  # refused (a data gate), the handler raised, or an output cannot go out
                if out.schema_header is None:
                    out.schema_header = codec.header_value(m.headers())
                batch.pending.append(self._dlq(out, meta, m.value()))
            else:
                RECORDS.labels(self.name, "ok").inc()
                batch.pending.extend(out)
        self.budgets.show(now)
        return batch

    def _handler_results(self, accepted: list[tuple[Contract, Meta, Message]]) -> tuple[list[Result], list[bool]]:
        """The handler's result for each accepted record, and whether it was tried alone. Records
        whose budget says so (an own failure, or spent) get a call of their own after the
        others' call; once a call finds the dependency down (a RetryLater that does not count)
        the rest of them are held with it, untried."""
        now = time.monotonic()
        budgets = [self.budgets.get((meta.topic, meta.partition, meta.offset)) for _, meta, _ in accepted]
        alone = [b is not None and (b.alone or self.budgets.spent(b, now)) for b in budgets]
        results: list[Result | None] = [None] * len(accepted)
        together = [i for i, solo in enumerate(alone) if not solo]
        down: RetryLater | None = None
        if together:
            got = self._results([accepted[i] for i in together])
            for i, r in zip(together, got, strict=True):
                results[i] = r
            if all(isinstance(r, RetryLater) and not r.counts for r in got):
                down = cast(RetryLater, got[0])   # as every one of them is
        for i in (i for i, solo in enumerate(alone) if solo):
            result = down if down is not None else self._results([accepted[i]])[0]
            results[i] = result
            if isinstance(result, RetryLater) and not result.counts:
                down = result
        return cast(list[Result], results), alone   # every one set: the call together's, then each alone

    def _results(self, items: list[tuple[Contract, Meta, Message]]) -> list[Result]:
        """The handler's result for each record of one call: outputs, a codec.Rejected or a
        RetryLater (one raised holds every record of the call). A handler that raises anything
        else is called again for each record alone, so only the failing one goes to the DLQ."""
        try:
            return self._call([(v, meta) for v, meta, _ in items])
        except RetryLater as e:
            return [e] * len(items)
        except Exception as e:  # the handler's bug must not stop the stage
            if len(items) > 1:  # isolate the record(s) that fail: one call per record
                return [r for item in items for r in self._results([item])]
            log.exception("handler failed", extra={"stage": self.stage_id, "offset": items[0][1].offset})
            return [codec.Rejected(DLQReason.handler_error, f"{type(e).__name__}: {e}")]

    def _call(self, items: list[tuple[Contract, Meta]]) -> list[Result]:
        if self.handle_batch is not None:
            results = self.handle_batch(items)
            if len(results) != len(items):
                raise RuntimeError(f"batch handler returned {len(results)} results for {len(items)} records")
            return results
        assert self.handle is not None
        out: list[Result] = []
        for v, meta in items:
            try:
                out.append(self.handle(v, meta))
            except RetryLater as e:  # holds this record only
                out.append(e)
        return out

    def _encode(self, outputs: Any, tp: tuple[str, int], offset: int) -> list[Pending] | codec.Rejected:
        """One record's outputs encoded and checked against their topics' record limits; the
        first that fails refuses the record (none of its outputs is produced)."""
        if not isinstance(outputs, list) or not all(isinstance(o, Output) for o in outputs):
            return codec.Rejected(DLQReason.handler_error, f"the handler returned {type(outputs).__name__} "
                                                           f"{str(outputs)[:200]}, not a list of Output")
        pending = []
        for o in outputs:
            try:
                value, headers = codec.encode(o.value)
            except Exception as e:  # noqa: BLE001 - a non-finite number (the codec refuses it), not a contract, ...
                return codec.Rejected(refusal_reason(str(e)), f"an output to {o.topic} cannot be encoded: "
                                                              f"{type(e).__name__}: {e}")
            limit = self._output_limits.get(o.topic, MAX_RECORD_BYTES)
            size = record_bytes(value, o.key, headers)
            if size + RECORD_FRAMING_BYTES > limit:  # the broker would refuse it and abort the transaction
                return codec.Rejected(DLQReason.output_oversize,
                                      f"an output to {o.topic} is {size} bytes (value, key and headers); the "
                                      f"topic takes at most {limit - RECORD_FRAMING_BYTES} (max.message.bytes "
                                      f"{limit} less {RECORD_FRAMING_BYTES} of framing)")
            pending.append(Pending(tp, offset, topic_name(o.topic, self.prefix), o.key, value, headers))
        return pending

    def _dlq(self, rej: codec.Rejected, meta: Meta, value: bytes | None) -> Pending:
        RECORDS.labels(self.name, "dlq").inc()
        DLQ.labels(self.name, rej.reason.value).inc()
        log.warning("record to DLQ", extra={"stage": self.stage_id, "reason": rej.reason.value,
                                            "detail": rej.detail, "topic": meta.topic,
                                            "partition": meta.partition, "offset": meta.offset})
        if len(rej.detail) > DLQ_ERROR_CHARS:  # rl.dlq's own limit must never refuse a DLQ record
            rej = codec.Rejected(rej.reason, rej.detail[:DLQ_ERROR_CHARS] + " [...]", rej.schema_header)
        rec = codec.dlq_record(rej, stage=self.stage_id, topic=meta.topic, partition=meta.partition,
                               offset=meta.offset, key=meta.key, value=value)
        encoded, headers = codec.encode(rec)
        return Pending((meta.topic, meta.partition), meta.offset, topic_name("rl.dlq", self.prefix), meta.key,
                       encoded, headers)

    def _rewind(self) -> None:
        """Seek every assigned partition back to its committed offset."""
        assignment = self.consumer.assignment()
        if not assignment:
            return
        for tp in self.consumer.committed(assignment, timeout=30):
            if tp.offset < 0:  # nothing committed yet: start of the log (auto.offset.reset=earliest)
                tp.offset = OFFSET_BEGINNING
            self.consumer.seek(tp)

    def close(self) -> None:
        """Abort the open transaction, if any (run() leaves one open only when an error escaped
        it: its records never become visible and its offsets are not committed), flush, and
        close the consumer (leaving the group). Never raises."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.producer.close()
        try:
            self.consumer.close()
        except Exception as e:  # noqa: BLE001 - close() never raises: the failure is logged
            log.warning("consumer close failed", extra={"stage": self.stage_id, "error": str(e)})
        log.info("stage stopped", extra={"stage": self.stage_id})

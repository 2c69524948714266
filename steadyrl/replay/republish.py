"""Re-publishing a window to another topic, in one transaction (steadyrl replay --to-topic)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from confluent_kafka import KafkaError, KafkaException, Message
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic  # confluent_kafka.admin re-exports it without naming it

from steadyrl.bus.kafka import client_config
from steadyrl.bus.topics import load_catalogue
from steadyrl.bus.txn import TransactionalProducer
from steadyrl.replay.window import Record
from steadyrl.wire import codec
from steadyrl.wire.contracts import ScoredGroup


def ensure_topic(bootstrap: str, topic: str, like: str = "rl.scored", timeout_s: float = 30.0) -> str:
    """Create `topic` with the catalogue settings of `like` (partitions, retention, max record
    size) when it is missing; returns "created" or "exists". The broker does not auto-create."""
    admin = AdminClient(client_config(bootstrap))
    if topic in admin.list_topics(timeout=timeout_s).topics:
        return "exists"
    spec = load_catalogue()[like]
    fut = admin.create_topics([NewTopic(topic, num_partitions=spec.partitions, replication_factor=1,
                                        config=spec.configs())], operation_timeout=timeout_s)[topic]
    try:
        fut.result()
    except KafkaException as e:
        if e.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
            raise
        return "exists"
    return "created"


def republish(bootstrap: str, topic: str, groups: Sequence[ScoredGroup], sources: Sequence[Record] | None = None,
              source_topic: str = "", timeout_s: float = 120.0) -> int:
    """Produce `groups` to `topic` (key: prompt_id) in one Kafka transaction: all land for
    read_committed readers, or, on any error, the transaction is aborted and the error raised.
    With `sources` (the records they came from, same order) each record keeps its source's
    timestamp, so the same window can be replayed from `topic`, and carries a header
    `replay_of: <source_topic>:<partition>:<offset>`. Returns the number produced.
    The topic must exist (`ensure_topic`). `timeout_s` is the transaction's timeout
    (transaction.timeout.ms: one transaction for the whole replay, longer than a worker's).

    Raises:
        KafkaException: a broker error or a record not delivered (TransactionAborted, a
            KafkaException, when the transaction failed and was aborted).
    """
    p = TransactionalProducer(bootstrap, "replay-cli", f"replay-cli-{uuid.uuid4().hex}", timeout_s=timeout_s,
                              call_timeout_s=max(60.0, timeout_s))
    errors: list[KafkaError] = []

    def on_delivery(err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            errors.append(err)

    try:
        p.init_transactions()
        with p.transaction():
            for i, g in enumerate(groups):
                value, headers = codec.encode(g)
                ts = None
                if sources is not None:
                    src = sources[i]
                    headers.append(("replay_of", f"{source_topic}:{src.partition}:{src.offset}".encode()))
                    ts = src.timestamp_ms
                p.produce(topic, value, g.prompt_id, headers, timestamp_ms=ts, on_delivery=on_delivery)
                p.poll(0)
            p.flush(timeout_s)
            if errors:
                raise KafkaException(errors[0])
    finally:
        p.close()
    return len(groups)

"""Kafka client configuration and librdkafka statistics as Prometheus metrics.

Each delivery rule sits beside the config key that enforces it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from prometheus_client import REGISTRY, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:  # confluent_kafka is imported where a client is made: steadyrl.config imports this module
    from confluent_kafka import Consumer, KafkaError

log = logging.getLogger(__name__)

#: Largest record any steadyrl topic accepts (schemas/topics.yaml max_message_bytes).
MAX_RECORD_BYTES = 16 * 1024 * 1024

#: transaction.timeout.ms of a transactional producer, in seconds: it must cover one whole
#: transaction (produce + send offsets + commit), and a crashed instance that never comes back
#: has its open transaction aborted by the broker after it. steadyrl.bus.txn waits on
#: send_offsets_to_transaction for the same time (plus a grace) before it calls the producer
#: wedged, so both read this one value.
TXN_TIMEOUT_S = 30.0


class KafkaAuth(BaseModel):
    """How this process authenticates to the brokers: one process, one principal.

    PLAINTEXT (the default) is the local broker on loopback. With SASL_PLAINTEXT or SASL_SSL the
    client logs in with SCRAM as `username`, the password read from `password_file` (a secret:
    never in the repo or the config file); the principal's ACLs (steadyrl/local/acl.py) decide what it
    may read and write. A service reads it from its config's `kafka:` section or the environment
    (`STEADYRL_KAFKA__USERNAME`, `STEADYRL_KAFKA__PASSWORD_FILE`, ...); a command (`steadyrl
    topics`, `quarantine`, `replay`, `acl`) from the environment (`KafkaAuth.from_env`).

    Raises pydantic.ValidationError (ConfigError at a service's start) when a SASL protocol lacks
    a username or a readable, non-empty password file, when credentials are given to PLAINTEXT,
    or when the CA file is unreadable.
    """

    model_config = ConfigDict(extra="forbid")

    security_protocol: Literal["PLAINTEXT", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT", description="security.protocol of every Kafka client of this process.")
    sasl_mechanism: Literal["SCRAM-SHA-512", "SCRAM-SHA-256"] = Field("SCRAM-SHA-512",
                                                                       description="SASL mechanism (SCRAM).")
    username: str | None = Field(None, description="The principal (User:<username>) this process acts as.")
    password_file: Path | None = Field(None, description="File holding the SCRAM password (a secret).")
    ssl_ca_file: Path | None = Field(None, description="CA bundle that signed the brokers' certificates "
                                                       "(SASL_SSL; None: the system's).")

    @model_validator(mode="after")
    def _credentials(self) -> KafkaAuth:
        if self.security_protocol == "PLAINTEXT":
            if self.username is not None or self.password_file is not None:
                raise ValueError("username/password_file are set but security_protocol is PLAINTEXT "
                                 "(set security_protocol: SASL_PLAINTEXT or SASL_SSL)")
        else:
            if not self.username:
                raise ValueError(f"security_protocol {self.security_protocol} needs username")
            if self.password_file is None:
                raise ValueError(f"security_protocol {self.security_protocol} needs password_file")
            try:
                if not self.password_file.read_text().strip():
                    raise ValueError(f"password_file {self.password_file} is empty")
            except OSError as e:
                raise ValueError(f"cannot read password_file {self.password_file}: {e.strerror}") from None
        if self.ssl_ca_file is not None and not self.ssl_ca_file.is_file():
            raise ValueError(f"ssl_ca_file {self.ssl_ca_file} is not a file")
        return self

    @classmethod
    def from_env(cls) -> KafkaAuth:
        """Read from `STEADYRL_KAFKA__<FIELD>` (upper case) environment variables."""
        return cls.model_validate({name: os.environ[f"STEADYRL_KAFKA__{name.upper()}"]
                                   for name in cls.model_fields if f"STEADYRL_KAFKA__{name.upper()}" in os.environ})

    def librdkafka(self) -> dict[str, Any]:
        """The librdkafka settings (security.protocol, sasl.*, ssl.ca.location); {} for PLAINTEXT."""
        if self.security_protocol == "PLAINTEXT" or self.password_file is None:  # (validated: never None here)
            return {}
        cfg: dict[str, Any] = {"security.protocol": self.security_protocol.lower(),
                               "sasl.mechanism": self.sasl_mechanism,
                               "sasl.username": self.username,
                               "sasl.password": self.password_file.read_text().strip()}
        if self.ssl_ca_file is not None:
            cfg["ssl.ca.location"] = str(self.ssl_ca_file)
        return cfg


_auth: KafkaAuth | None = None


def use_auth(auth: KafkaAuth) -> None:
    """Make `auth` the credentials of every Kafka client this process builds from now on (a
    service calls it once at start, with its config's `kafka` section)."""
    global _auth
    _auth = auth


def current_auth() -> KafkaAuth:
    """The process's credentials: those given to `use_auth`, else the environment's (read once).

    Raises pydantic.ValidationError if the environment's are invalid."""
    global _auth
    if _auth is None:
        _auth = KafkaAuth.from_env()
    return _auth


def client_config(bootstrap: str, auth: KafkaAuth | None = None) -> dict[str, Any]:
    """The base of every librdkafka client config (producer, consumer, AdminClient):
    `bootstrap.servers` and the credentials (`auth`, default `current_auth()`)."""
    return {"bootstrap.servers": bootstrap, **(auth if auth is not None else current_auth()).librdkafka()}


class KafkaStats(Collector):
    """Latest librdkafka statistics of every client in this process, as metrics.

    Feed it with `stats_cb` (librdkafka calls it from poll() every statistics.interval.ms).
    Exposes:
      steadyrl_kafka_consumer_lag{client,topic,partition}   messages (committed/stored -> high watermark)
      steadyrl_kafka_rebalances_total{client}               consumer group rebalances
      steadyrl_kafka_txn_state{client,state}                1 for the producer's current transaction state
      steadyrl_kafka_broker_rtt_seconds{client,broker}      average request round-trip time
      steadyrl_kafka_brokers_up{client}                     brokers in state UP
    """

    def __init__(self) -> None:
        self._latest: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def callback(self, client: str) -> Callable[[str], None]:
        """A `stats_cb` for one named client."""

        def _cb(stats_json: str) -> None:
            try:
                stats = json.loads(stats_json)
            except json.JSONDecodeError:
                return
            with self._lock:
                self._latest[client] = stats

        return _cb

    def latest(self, client: str) -> dict[str, Any] | None:
        with self._lock:
            return self._latest.get(client)

    def brokers_up(self, client: str) -> int | None:
        """Brokers in state UP for `client`, or None before the first statistics."""
        s = self.latest(client)
        if s is None:
            return None
        return sum(1 for b in s.get("brokers", {}).values()
                   if b.get("state") == "UP" and b.get("nodeid", -1) >= 0)

    def collect(self) -> Iterator[Metric]:
        lag = GaugeMetricFamily("steadyrl_kafka_consumer_lag", "Consumer lag in messages, per partition",
                                labels=["client", "topic", "partition"])
        reb = CounterMetricFamily("steadyrl_kafka_rebalances", "Consumer group rebalances", labels=["client"])
        txn = GaugeMetricFamily("steadyrl_kafka_txn_state", "Transactional producer state (1 = current)",
                                labels=["client", "state"])
        rtt = GaugeMetricFamily("steadyrl_kafka_broker_rtt_seconds", "Average broker round-trip time",
                                labels=["client", "broker"])
        up = GaugeMetricFamily("steadyrl_kafka_brokers_up", "Brokers in state UP", labels=["client"])
        with self._lock:
            items = list(self._latest.items())
        for client, s in items:
            for tname, t in s.get("topics", {}).items():
                for pid, p in t.get("partitions", {}).items():
                    # consumer_lag_stored: vs the offsets the application stored (transactional
                    # stages and the learner store what they committed or consumed); else vs
                    # the group's committed offset
                    value = p.get("consumer_lag_stored", -1)
                    value = value if value >= 0 else p.get("consumer_lag", -1)
                    if pid == "-1" or value < 0:
                        continue
                    lag.add_metric([client, tname, pid], value)
            if "cgrp" in s:
                reb.add_metric([client], s["cgrp"].get("rebalance_cnt", 0))
            if "eos" in s and s["eos"].get("txn_state"):
                txn.add_metric([client, s["eos"]["txn_state"]], 1)
            n_up = 0
            for b in s.get("brokers", {}).values():
                if b.get("nodeid", -1) < 0:
                    continue  # bootstrap placeholder
                n_up += b.get("state") == "UP"
                if b.get("rtt", {}).get("avg"):
                    rtt.add_metric([client, str(b["nodeid"])], b["rtt"]["avg"] / 1e6)
            up.add_metric([client], n_up)
        yield from (lag, reb, txn, rtt, up)


STATS = KafkaStats()
REGISTRY.register(STATS)


def _error_cb(client: str) -> Callable[[KafkaError], None]:
    def _cb(err: KafkaError) -> None:
        # Broker down/unreachable is transient: librdkafka reconnects by itself.
        log.warning("kafka client error", extra={"client": client, "error": str(err), "fatal": err.fatal()})

    return _cb


def producer_config(bootstrap: str, client: str, transactional_id: str | None = None,
                    stats_interval_s: float = 5.0, transaction_timeout_s: float = TXN_TIMEOUT_S) -> dict[str, Any]:
    """Config of an idempotent (and, with `transactional_id`, transactional) producer.

    `transaction_timeout_s` (seconds) sets transaction.timeout.ms and message.timeout.ms of a
    transactional producer; build those with steadyrl.bus.txn.TransactionalProducer, which
    keeps its own deadlines equal to it.
    """
    cfg: dict[str, Any] = client_config(bootstrap) | {
        "client.id": client,
        # No duplicates or reordering from retries; acks=all is implied.
        "enable.idempotence": True,
        "acks": "all",
        # Keep retrying through a broker restart for up to 5 minutes before failing a record.
        "message.timeout.ms": 300_000,
        "linger.ms": 5,
        "message.max.bytes": MAX_RECORD_BYTES,
        "statistics.interval.ms": int(stats_interval_s * 1000),
        "stats_cb": STATS.callback(client),
        "error_cb": _error_cb(client),
        "logger": logging.getLogger(f"rdkafka.{client}"),
    }
    if transactional_id:
        # Stable per instance: a restarted instance fences its predecessor and aborts its
        # open transaction at once (init_transactions).
        cfg["transactional.id"] = transactional_id
        # Must cover one whole transaction (produce + send offsets + commit); a crashed
        # instance that never comes back has its transaction aborted after this (TXN_TIMEOUT_S).
        cfg["transaction.timeout.ms"] = int(transaction_timeout_s * 1000)
        # librdkafka requires message.timeout.ms <= transaction.timeout.ms; a record not
        # delivered by then fails the transaction, which is aborted and retried.
        cfg["message.timeout.ms"] = int(transaction_timeout_s * 1000)
    return cfg


def consumer_config(bootstrap: str, client: str, group_id: str, stats_interval_s: float = 5.0,
                    max_poll_interval_s: float = 300.0) -> dict[str, Any]:
    """Config of a consumer-group member whose offsets are committed by the application."""
    return client_config(bootstrap) | {
        "client.id": client,
        "group.id": group_id,
        # KIP-848 group protocol (Kafka >= 4.0): incremental, broker-driven rebalances.
        "group.protocol": "consumer",
        # Only offsets we commit (inside a transaction, or after outputs are delivered) count.
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        # Never read outputs of aborted or open transactions.
        "isolation.level": "read_committed",
        # A new group starts at the beginning: no prompt published before it joined is skipped.
        "auto.offset.reset": "earliest",
        # We keep polling while paused, so this only trips if the process is truly stuck.
        "max.poll.interval.ms": int(max_poll_interval_s * 1000),
        # Large records: fetch sizes cover the largest topic's max.message.bytes.
        "fetch.max.bytes": MAX_RECORD_BYTES * 2,
        "max.partition.fetch.bytes": MAX_RECORD_BYTES,
        "receive.message.max.bytes": MAX_RECORD_BYTES * 2 + 1024 * 1024,
        "statistics.interval.ms": int(stats_interval_s * 1000),
        "stats_cb": STATS.callback(client),
        "error_cb": _error_cb(client),
        "logger": watch_offset_resets(logging.getLogger(f"rdkafka.{client}")),
    }


#: librdkafka's line when a consumer's position is gone from the log (retention, deleted
#: records, a group reset past the end): it moves to auto.offset.reset's end and says so
#: (facility OFFSET, "... t [0]: offset reset (at offset 2 ...) to offset BEGINNING ...:
#: fetch failed due to requested offset not available on the broker: Broker: Offset out of range")
_OFFSET_RESET = re.compile(r"(?P<topic>[^\s\[\]]+) \[(?P<partition>\d+)\]: offset reset \(at offset (?P<at>-?\d+)"
                           r".*? to offset (?P<to>\S+).*?: (?P<why>[^:]*(?:out of range|not available)[^:]*)")
OFFSET_RESETS = Counter("steadyrl_consumer_offset_resets", "A consumer's position was gone from the log (records "
                        "deleted by retention or by hand, or a group offset out of range): it moved to the earliest "
                        "record, and the records between were never read", ["topic"])


class _OffsetResetWatch(logging.Filter):
    """Counts and names each out-of-range offset reset librdkafka reports on this logger."""

    def filter(self, record: logging.LogRecord) -> bool:
        m = _OFFSET_RESET.search(record.getMessage())
        if m is not None:
            OFFSET_RESETS.labels(m["topic"]).inc()
            log.error("consumer offset out of range: records between it and the log's start were never read",
                      extra={"topic": m["topic"], "partition": int(m["partition"]), "at_offset": int(m["at"]),
                             "moved_to": m["to"], "why": m["why"].strip()})
        return True


def watch_offset_resets(logger: logging.Logger) -> logging.Logger:
    """`logger` (a librdkafka client's) with the offset-reset watch on it (once)."""
    if not any(isinstance(f, _OffsetResetWatch) for f in logger.filters):
        logger.addFilter(_OffsetResetWatch())
    return logger


def reader_config(bootstrap: str, client: str) -> dict[str, Any]:
    """Config of a throwaway read_committed reader (a CLI reading a topic once, by `assign`).

    Its group id is `{client}-{random hex}`, so no two readers share offsets, and it commits
    and stores none. Fetch sizes cover the largest record (MAX_RECORD_BYTES).
    """
    return client_config(bootstrap) | {
        "client.id": client,
        "group.id": f"{client}-{uuid.uuid4().hex}",
        "isolation.level": "read_committed",
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "fetch.max.bytes": MAX_RECORD_BYTES * 2,
        "max.partition.fetch.bytes": MAX_RECORD_BYTES,
        "receive.message.max.bytes": MAX_RECORD_BYTES * 2 + 1024 * 1024,
    }


_T = TypeVar("_T")


def retrying(call: Callable[..., _T], arg: Any, timeout_s: float) -> _T:
    """`call(arg, timeout=timeout_s)`, retried with backoff (0.1 s doubling, at most 2 s) on a
    retriable broker error (e.g. NOT_LEADER_FOR_PARTITION while a new topic's leaders are
    elected) until timeout_s has passed. For a client's offsets_for_times or
    get_watermark_offsets.

    Raises:
        KafkaException: a non-retriable error, or the last retriable one past timeout_s.
    """
    import tenacity  # lazy: heavy (tenacity); steadyrl.config imports this module
    from confluent_kafka import KafkaException  # lazy: heavy (confluent_kafka); steadyrl.config imports this

    def retriable(e: BaseException) -> bool:
        return isinstance(e, KafkaException) and e.args[0].retriable()

    for attempt in tenacity.Retrying(retry=tenacity.retry_if_exception(retriable), reraise=True,
                                     wait=tenacity.wait_exponential(multiplier=0.1, max=2),
                                     stop=tenacity.stop_after_delay(timeout_s)):
        with attempt:
            return call(arg, timeout=timeout_s)
    raise AssertionError("unreachable: tenacity returns or raises")


def read_ranges(consumer: Consumer, topic: str, ranges: dict[int, tuple[int, int]],
                timeout_s: float) -> Iterator[Any]:   # confluent_kafka Messages
    """Every message `consumer` delivers of `topic` with start <= offset < end in its partition,
    for `ranges`: partition -> (start, end) offsets; a partition with start >= end is not read.

    Assigns `consumer` (a `reader_config` one) to the starts and reads until each partition's
    position has passed its end, then pauses it: an end offset may be a transaction marker,
    never delivered, and read_committed skips aborted records, so counting records would never
    finish. Messages come in the order consumed (offset order within a partition); error
    messages (transient: broker reconnects) are skipped, the deadline bounds a lasting one.

    Raises:
        RuntimeError: not every partition was read to its end within timeout_s (the message
            names the partitions left and their end offsets).
    """
    from confluent_kafka import TopicPartition  # lazy: heavy (confluent_kafka); steadyrl.config imports this

    ranges = {p: r for p, r in ranges.items() if r[0] < r[1]}
    if ranges:
        consumer.assign([TopicPartition(topic, p, start) for p, (start, _) in ranges.items()])
    pending = set(ranges)
    deadline = time.monotonic() + timeout_s
    while pending:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{topic}: partitions {sorted(pending)} not read to their end offsets "
                               f"{ {p: ranges[p][1] for p in sorted(pending)} } within {timeout_s} s")
        for m in consumer.consume(500, timeout=0.5):
            if m.error() is not None:
                continue
            p, off = m.partition(), m.offset()
            if p in pending and off is not None and ranges[p][0] <= off < ranges[p][1]:
                yield m
        done = [tp for tp in consumer.position([TopicPartition(topic, p) for p in pending])
                if tp.offset >= ranges[tp.partition][1]]
        if done:
            consumer.pause(done)
            pending -= {tp.partition for tp in done}


def read_topic(bootstrap: str, topic: str, client: str, timeout_s: float = 60.0) -> list[Any]:
    """Every committed message of `topic` still kept: each partition from its low watermark to
    the end offset seen at the call (read_committed, see read_ranges), in offset order per
    partition. `client` names the reader (its group id is `client-<random hex>`).

    Raises:
        RuntimeError: the topic does not exist, or it was not read to its end within timeout_s.
    """
    from confluent_kafka import Consumer, TopicPartition  # lazy: heavy (confluent_kafka); config imports this

    c = Consumer(reader_config(bootstrap, client))
    try:
        md = c.list_topics(topic, timeout=timeout_s).topics.get(topic)
        if md is None or md.error is not None:
            raise RuntimeError(f"topic {topic} not found (run `steadyrl topics create`)")
        ranges = {p: retrying(c.get_watermark_offsets, TopicPartition(topic, p), timeout_s) for p in md.partitions}
        return list(read_ranges(c, topic, ranges, timeout_s))
    finally:
        c.close()

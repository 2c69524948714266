"""Kafka client configuration and librdkafka statistics as Prometheus metrics.

Each delivery rule sits beside the config key that enforces it.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

#: Largest record any steadyrl topic accepts (schemas/topics.yaml max_message_bytes).
MAX_RECORD_BYTES = 16 * 1024 * 1024


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

    def callback(self, client: str):
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

    def collect(self):
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


def _error_cb(client: str):
    def _cb(err) -> None:
        # Broker down/unreachable is transient: librdkafka reconnects by itself.
        log.warning("kafka client error", extra={"client": client, "error": str(err), "fatal": err.fatal()})

    return _cb


def producer_config(bootstrap: str, client: str, transactional_id: str | None = None,
                    stats_interval_s: float = 5.0) -> dict[str, Any]:
    """Config of an idempotent (and, with `transactional_id`, transactional) producer."""
    cfg: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
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
        # instance that never comes back has its transaction aborted after this.
        cfg["transaction.timeout.ms"] = 30_000
        # librdkafka requires message.timeout.ms <= transaction.timeout.ms; a record not
        # delivered by then fails the transaction, which is aborted and retried.
        cfg["message.timeout.ms"] = 30_000
    return cfg


def consumer_config(bootstrap: str, client: str, group_id: str, stats_interval_s: float = 5.0,
                    max_poll_interval_s: float = 300.0) -> dict[str, Any]:
    """Config of a consumer-group member whose offsets are committed by the application."""
    return {
        "bootstrap.servers": bootstrap,
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
        "logger": logging.getLogger(f"rdkafka.{client}"),
    }

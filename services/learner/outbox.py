"""The learner's one producer: prompts, policy announcements, quarantined groups and DLQ
records, each flushed (acks=all, idempotent) before the learner acts on it having been sent."""

from __future__ import annotations

from typing import Any, cast

from confluent_kafka import KafkaError, Message, Producer

from steadyrl.bus.kafka import producer_config
from steadyrl.wire import codec
from steadyrl.wire.contracts import Contract


class Outbox:
    """Encodes contracts onto the run's topics (`topics`: catalogue name -> prefixed name)."""

    def __init__(self, bootstrap: str, client: str, topics: dict[str, str], stats_interval_s: float):
        self.topics = topics
        self.producer = Producer(producer_config(bootstrap, client, None, stats_interval_s))
        self._errors: list[str] = []

    def produce(self, topic: str, key: str | bytes | None, value: Contract) -> None:
        """Queue `value` on the catalogue topic `topic` (not yet acknowledged: see flush)."""
        payload, headers = codec.encode(value)

        def on_delivery(err: KafkaError | None, msg: Message) -> None:
            if err is not None:
                self._errors.append(str(err))

        self.producer.produce(self.topics[topic], payload, key=key, headers=cast(Any, headers), on_delivery=on_delivery)

    def flush(self, timeout_s: float = 120) -> None:
        """Wait until everything produced is acknowledged. Raises RuntimeError on a delivery error."""
        left = self.producer.flush(timeout_s)
        if left or self._errors:
            errors, self._errors = self._errors[:3], []
            raise RuntimeError(f"{left} records not delivered; errors: {errors}")

    def close(self) -> None:
        self.producer.flush(30)

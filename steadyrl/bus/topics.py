"""The topic catalogue (`schemas/topics.yaml`, shipped with the package) and idempotent creation
via AdminClient."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel, Field

from steadyrl.assets import asset_dir
from steadyrl.bus.kafka import client_config

if TYPE_CHECKING:
    from confluent_kafka.admin._metadata import TopicMetadata

    from steadyrl.http import Health

log = logging.getLogger(__name__)

CATALOGUE_PATH = asset_dir("schemas") / "topics.yaml"


class TopicSpec(BaseModel):
    """One catalogue entry."""

    name: str
    key: str
    schema_name: str | None = Field(alias="schema")
    partitions: int = Field(ge=1)
    retention_ms: int = Field(ge=-1)
    cleanup_policy: str = Field(pattern="^(delete|compact)$")
    max_message_bytes: int = Field(ge=1024)

    def configs(self) -> dict[str, str]:
        """Topic-level configs for CreateTopics."""
        return {"retention.ms": str(self.retention_ms), "cleanup.policy": self.cleanup_policy,
                "max.message.bytes": str(self.max_message_bytes)}


def load_catalogue(path: Path = CATALOGUE_PATH) -> dict[str, TopicSpec]:
    """Catalogue by base name (`rl.prompts`, ...). Raises pydantic.ValidationError if malformed."""
    data = yaml.safe_load(Path(path).read_text())
    return {t["name"]: TopicSpec.model_validate(t) for t in data["topics"]}


def topic_name(base: str, prefix: str = "") -> str:
    """Physical topic name: `prefix + base` (prefixes isolate tests and parallel runs)."""
    return f"{prefix}{base}"


def _existing_status(spec: TopicSpec, meta: TopicMetadata, replication_factor: int) -> str:
    """What an existing topic (`meta`, as the broker lists it) needs against `spec`:
    "partitions N->M" (to grow), "exists (replication N < M)" (fewer copies than asked, left as
    it is) or "exists"."""
    have = len(meta.partitions)
    copies = min((len(p.replicas) for p in meta.partitions.values()), default=replication_factor)
    if have < spec.partitions:
        return f"partitions {have}->{spec.partitions}"
    if copies < replication_factor:
        return f"exists (replication {copies} < {replication_factor})"
    return "exists"


def create_topics(bootstrap: str, prefix: str = "", timeout_s: float = 30.0, replication_factor: int = 1,
                  min_insync_replicas: int = 1) -> dict[str, str]:
    """Create every catalogue topic that is missing; grow partitions that are too few.

    Args:
        bootstrap: the cluster; prefix: topic name prefix; timeout_s: per admin call, seconds.
        replication_factor: copies of each partition a new topic gets (1: the single local
            broker; 3 on a three-broker cluster, docs/replication.md).
        min_insync_replicas: the new topics' `min.insync.replicas`, set on each topic (an acks=all
            write, which every steadyrl producer makes, fails while fewer copies are in sync;
            with 3 and 2 one broker may be down).

    Idempotent. Returns `{topic: "created" | "exists" | "partitions N->M"}`; an existing topic
    with fewer copies than asked reads "exists (replication N < M)" (left as it is: changing a
    topic's replication is a reassignment, not done here). Raises ValueError unless
    1 <= min_insync_replicas <= replication_factor, confluent_kafka.KafkaException on any other
    broker error (e.g. fewer brokers than replication_factor).
    """
    from confluent_kafka import KafkaError, KafkaException  # lazy: heavy (confluent_kafka); the CLI imports this
    from confluent_kafka.admin import AdminClient  # lazy: heavy (confluent_kafka)
    from confluent_kafka.cimpl import NewPartitions, NewTopic  # lazy: heavy (confluent_kafka); where they are exported

    if not 1 <= min_insync_replicas <= replication_factor:
        raise ValueError(f"min_insync_replicas {min_insync_replicas} must be between 1 and replication_factor "
                         f"{replication_factor}")
    # log_level 4 (warning): librdkafka's info lines (e.g. BGQUEUE "Purging 1 unserved events"
    # when the client is destroyed on a busy machine) went to the CLI's stderr; errors raise here
    admin = AdminClient(client_config(bootstrap) | {"log_level": 4})
    existing = admin.list_topics(timeout=timeout_s).topics
    result: dict[str, str] = {}
    new, grow = [], []
    for spec in load_catalogue().values():
        name = topic_name(spec.name, prefix)
        if name not in existing:
            new.append(NewTopic(name, num_partitions=spec.partitions, replication_factor=replication_factor,
                                config=spec.configs() | {"min.insync.replicas": str(min_insync_replicas)}))
            result[name] = "created"
            continue
        result[name] = _existing_status(spec, existing[name], replication_factor)
        if result[name].startswith("partitions"):
            grow.append(NewPartitions(name, spec.partitions))
    futures = {}
    if new:
        futures.update(admin.create_topics(new, operation_timeout=timeout_s))
    if grow:
        futures.update(admin.create_partitions(grow, operation_timeout=timeout_s))
    for name, fut in futures.items():
        try:
            fut.result()
        except KafkaException as e:
            if e.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS:  # a concurrent creator won
                result[name] = "exists"
            else:
                raise
    return result


def list_topics(bootstrap: str, prefix: str = "", timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """Catalogue topics as they exist on the broker: name, partitions, present, replication
    (the fewest copies of any partition; 0 when absent)."""
    from confluent_kafka.admin import AdminClient  # lazy: heavy (confluent_kafka); the CLI imports this

    md = AdminClient(client_config(bootstrap) | {"log_level": 4}).list_topics(timeout=timeout_s)
    rows = []
    for spec in load_catalogue().values():
        name = topic_name(spec.name, prefix)
        t = md.topics.get(name)
        rows.append({"topic": name, "present": t is not None,
                     "partitions": len(t.partitions) if t else 0, "wanted": spec.partitions,
                     "replication": min((len(p.replicas) for p in t.partitions.values()), default=0) if t else 0})
    return rows


def topic_id(bootstrap: str, topic: str, health: Health | None = None, timeout_s: float = 300.0) -> str:
    """The topic id (KIP-516: a UUID the broker gives a topic when it is created) of `topic`.

    Waits while the broker cannot be reached or the topic is not there yet (compose and
    Kubernetes may start the learner first), beating `health` and logging each try. Raises
    RuntimeError past timeout_s.
    """
    from confluent_kafka import KafkaException, TopicCollection  # lazy: heavy (confluent_kafka); the CLI imports this
    from confluent_kafka.admin import AdminClient  # lazy: heavy (confluent_kafka)

    admin = AdminClient(client_config(bootstrap) | {"log_level": 0})
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return str(admin.describe_topics(TopicCollection([topic]), request_timeout=10)[topic].result().topic_id)
        except KafkaException as e:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"cannot describe topic {topic} at {bootstrap} within {timeout_s:g} s: {e}") from None
            log.warning("waiting for the broker to describe the input topic", extra={"topic": topic, "error": str(e)})
            if health is not None:
                health.beat()
            time.sleep(2)

"""`rl.quarantine`: batches the reward watch held back, and a person's decision on each.

The learner writes a `QuarantinedBatch` (key: batch id) when a batch trips the reward watch
(services/learner/watch.py) and publishes other prompts in its place. A person then looks:

    steadyrl quarantine list                 every batch: step, rules, figures, status
    steadyrl quarantine show BATCH           its groups: prompt, rewards, responses
    steadyrl quarantine release BATCH        its groups go back to rl.scored and are trained
    steadyrl quarantine drop BATCH           never trained

A decision is a `QuarantineDecision` record on the same topic; a batch has at most one.
`release` writes the groups to rl.scored and the decision in one Kafka transaction, so either
both land or neither does. The learner trains a released group as it is (its behaviour
log-probs make the importance ratio right however old it is), once: a second copy of a
released group is a duplicate. A run that has finished no longer trains what is released.
"""

from __future__ import annotations

import getpass
import socket
import time
import uuid
from dataclasses import dataclass, field

from steadyrl import codec
from steadyrl.contracts import QuarantineAction, QuarantineDecision, QuarantinedBatch


@dataclass
class Entry:
    """One quarantined batch with its decision, if any (offset: on rl.quarantine)."""

    batch: QuarantinedBatch
    offset: int
    decision: QuarantineDecision | None = None
    duplicates: list[int] = field(default_factory=list)   # offsets of later copies (a learner re-sent it)

    @property
    def status(self) -> str:
        return "held" if self.decision is None else {"release": "released", "drop": "dropped"}[self.decision.action.value]


class QuarantineError(Exception):
    """A decision that cannot be taken: unknown batch, or one already decided."""


def read_quarantine(bootstrap: str, prefix: str = "", timeout_s: float = 30.0) -> dict[str, Entry]:
    """Every batch on `{prefix}rl.quarantine`, by batch id, in the order written.

    Reads from the start to the end offset seen at the call (read_committed). Records that do
    not decode as either contract are skipped. Raises RuntimeError when the topic is missing.
    """
    from confluent_kafka import Consumer, TopicPartition

    from steadyrl.bus.kafka import MAX_RECORD_BYTES

    topic = f"{prefix}rl.quarantine"
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"quarantine-cli-{uuid.uuid4().hex}",
                  "isolation.level": "read_committed", "enable.auto.commit": False,
                  "fetch.max.bytes": MAX_RECORD_BYTES * 2, "max.partition.fetch.bytes": MAX_RECORD_BYTES,
                  "receive.message.max.bytes": MAX_RECORD_BYTES * 2 + 1024 * 1024})
    entries: dict[str, Entry] = {}
    try:
        md = c.list_topics(topic, timeout=timeout_s).topics.get(topic)
        if md is None or md.error is not None:
            raise RuntimeError(f"topic {topic} not found (run `steadyrl topics create`)")
        ends = {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout_s)[1] for p in md.partitions}
        c.assign([TopicPartition(topic, p, 0) for p in md.partitions])
        deadline = time.monotonic() + timeout_s
        # the end offset may be a transaction marker, never delivered: read until the position passes it
        while any(max(tp.offset, 0) < ends[tp.partition] for tp in c.position([TopicPartition(topic, p) for p in ends])):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{topic}: not read to its end offsets {ends} within {timeout_s} s")
            for m in c.consume(500, timeout=0.5):
                if m.error() is None:
                    _add(entries, m)
    finally:
        c.close()
    return entries


def _add(entries: dict[str, Entry], m) -> None:
    name = codec.header_value(m.headers()) or ""
    try:
        if name.startswith(QuarantinedBatch.SCHEMA_NAME + "/"):
            b = codec.decode(m.value(), m.headers(), QuarantinedBatch)
            if b.batch_id in entries:
                entries[b.batch_id].duplicates.append(m.offset())
            else:
                entries[b.batch_id] = Entry(b, m.offset())
        elif name.startswith(QuarantineDecision.SCHEMA_NAME + "/"):
            d = codec.decode(m.value(), m.headers(), QuarantineDecision)
            if d.batch_id in entries and entries[d.batch_id].decision is None:
                entries[d.batch_id].decision = d
    except codec.Rejected:
        pass


def decide(bootstrap: str, batch_id: str, action: QuarantineAction, note: str = "", prefix: str = "") -> Entry:
    """Release or drop a held batch; returns its entry with the decision.

    release: the groups go to rl.scored (key: prompt_id) and the decision to rl.quarantine,
    in one transaction (aborted, and the error raised, if any part fails).
    Raises QuarantineError for an unknown or already decided batch, KafkaException on a
    broker error.
    """
    from confluent_kafka import Producer

    from steadyrl.bus.kafka import producer_config

    entries = read_quarantine(bootstrap, prefix)
    if batch_id not in entries:
        known = ", ".join(list(entries)[-5:]) or "none"
        raise QuarantineError(f"no quarantined batch {batch_id!r} on {prefix}rl.quarantine (latest: {known})")
    entry = entries[batch_id]
    if entry.decision is not None:
        raise QuarantineError(f"batch {batch_id} was already {entry.status} by {entry.decision.by or '?'}")
    decision = QuarantineDecision(batch_id=batch_id, action=action, note=note,
                                  by=f"{getpass.getuser()}@{socket.gethostname()}")
    p = Producer(producer_config(bootstrap, "quarantine-cli", f"quarantine-cli-{uuid.uuid4().hex}"))
    p.init_transactions(30)
    p.begin_transaction()
    try:
        if action == QuarantineAction.release:
            for g in entry.batch.groups:
                value, headers = codec.encode(g)
                p.produce(f"{prefix}rl.scored", value, key=g.prompt_id, headers=headers)
        value, headers = codec.encode(decision)
        p.produce(f"{prefix}rl.quarantine", value, key=batch_id, headers=headers)
        p.commit_transaction(60)
    except Exception:
        p.abort_transaction(30)
        raise
    entry.decision = decision
    return entry

"""`rl.quarantine`: batches the reward watch held back, and a person's decision on each.

The learner writes a held batch of n groups as n `QuarantinedGroup` records (key: batch id,
`index` 0..n-1) when it trips the reward watch (services/learner/watch.py), and publishes
other prompts in its place. The batch id hashes its prompt ids, so a learner that holds the
same groups again after a restart writes the same id (the copies are ignored). A person then
looks:

    steadyrl quarantine list                 every batch: step, rules, figures, status
    steadyrl quarantine show BATCH           its groups: prompt, rewards, responses
    steadyrl quarantine release BATCH        its groups go to rl.releases and are trained
    steadyrl quarantine drop BATCH           never trained

A decision is a `QuarantineDecision` record on the same topic; a batch has at most one. It
records who made it (`by`: user@host of the command, and the note given).
`release` writes the groups to rl.releases, each with the header `steadyrl-release: <batch id>`,
and the decision, in one Kafka transaction, so either all land or none does. Its
transactional id is fixed per batch, so of two people deciding at once the later fences the
earlier (whose commit fails), and it reads the topic again after fencing.

Kafka does not tell a consumer who produced a record, so a release's authorship comes from its
topic: rl.releases is written by this command alone (with Kafka ACLs, only the quarantine
principal may write it), never by the reward workers that write rl.scored. The learner treats
only rl.releases records as releases: it trains such a group as it is (its behaviour log-probs
make the importance ratio right however old it is), once. A group on rl.scored is an ordinary
group whatever its headers (one carrying the release header is counted, `release_on_scored`,
and logged), so a held group read again there stays held, and nobody who may write rl.scored
can release one. A run that has finished no longer trains what is released.
"""

from __future__ import annotations

import getpass
import hashlib
import socket
from dataclasses import dataclass, field

from confluent_kafka import Message

from steadyrl.bus.kafka import read_topic
from steadyrl.bus.txn import TransactionalProducer
from steadyrl.wire import codec
from steadyrl.wire.contracts import QuarantineAction, QuarantineDecision, QuarantinedGroup

RELEASE_HEADER = "steadyrl-release"


def batch_id(run_id: str, step: int, prompt_ids: list[str]) -> str:
    """`{run_id}/q{step:06d}-{first 8 hex of sha256 of the sorted prompt ids}`."""
    digest = hashlib.sha256("\n".join(sorted(prompt_ids)).encode()).hexdigest()[:8]
    return f"{run_id}/q{step:06d}-{digest}"


@dataclass
class Entry:
    """One quarantined batch: its groups by index, and the decision, if any."""

    groups: dict[int, QuarantinedGroup] = field(default_factory=dict)
    decision: QuarantineDecision | None = None
    copies: int = 0                      # records of a group already seen (a learner held it again)

    @property
    def first(self) -> QuarantinedGroup:
        return self.groups[min(self.groups)]

    @property
    def complete(self) -> bool:
        return len(self.groups) == self.first.count

    @property
    def status(self) -> str:
        if self.decision is not None:
            return {"release": "released", "drop": "dropped"}[self.decision.action.value]
        return "held" if self.complete else "partial"


class QuarantineError(Exception):
    """A decision that cannot be taken: unknown, incomplete or already decided batch."""


def read_quarantine(bootstrap: str, prefix: str = "", timeout_s: float = 60.0) -> dict[str, Entry]:
    """Every batch on `{prefix}rl.quarantine`, by batch id, in the order first written.

    Reads each partition from its first offset still kept (the low watermark) to the end
    offset seen at the call (read_committed). Records that do not decode as either contract
    are skipped. Raises RuntimeError when the topic is missing or cannot be read to its end
    within timeout_s.
    """
    entries: dict[str, Entry] = {}
    for m in read_topic(bootstrap, f"{prefix}rl.quarantine", "quarantine-cli", timeout_s):
        _add(entries, m)
    return entries


def _add(entries: dict[str, Entry], m: Message) -> None:
    name = codec.header_value(m.headers()) or ""
    try:
        if name.startswith(QuarantinedGroup.SCHEMA_NAME + "/"):
            g = codec.decode(m.value(), m.headers(), QuarantinedGroup)
            e = entries.setdefault(g.batch_id, Entry())
            if g.index in e.groups:
                e.copies += 1
            else:
                e.groups[g.index] = g
        elif name.startswith(QuarantineDecision.SCHEMA_NAME + "/"):
            d = codec.decode(m.value(), m.headers(), QuarantineDecision)
            if d.batch_id in entries and entries[d.batch_id].decision is None:
                entries[d.batch_id].decision = d
    except codec.Rejected:
        pass


def decide(bootstrap: str, batch: str, action: QuarantineAction, note: str = "", prefix: str = "") -> Entry:
    """Release or drop a held batch; returns its entry with the decision.

    release: the groups go to rl.releases (key: prompt_id, header steadyrl-release) and the
    decision (`by`: user@host, `note`) to rl.quarantine, in one transaction (aborted, and the
    error raised, if any part fails; steadyrl.bus.txn.TransactionalProducer). Raises
    QuarantineError for an unknown, incomplete or already decided batch, KafkaException on a
    broker error (e.g. fenced by another decision on the same batch; TransactionAborted, a
    KafkaException, when the transaction failed and was aborted).
    """
    p = TransactionalProducer(bootstrap, "quarantine-cli", f"quarantine-{batch}")
    try:
        p.init_transactions()  # fences any other decider of this batch; read after it
        entries = read_quarantine(bootstrap, prefix)
        if batch not in entries:
            known = ", ".join(list(entries)[-5:]) or "none"
            raise QuarantineError(f"no quarantined batch {batch!r} on {prefix}rl.quarantine (latest: {known})")
        entry = entries[batch]
        if entry.decision is not None:
            raise QuarantineError(f"batch {batch} was already {entry.status} by {entry.decision.by or '?'}")
        if not entry.complete:
            raise QuarantineError(f"batch {batch} is incomplete ({len(entry.groups)} of {entry.first.count} groups): "
                                  "the learner is still writing it, or stopped mid-way and will hold it again")
        decision = QuarantineDecision(batch_id=batch, action=action, note=note,
                                      by=f"{getpass.getuser()}@{socket.gethostname()}")
        with p.transaction():
            if action == QuarantineAction.release:
                for i in sorted(entry.groups):
                    g = entry.groups[i].group
                    value, headers = codec.encode(g)
                    p.produce(f"{prefix}rl.releases", value, g.prompt_id, headers + [(RELEASE_HEADER, batch.encode())])
            value, headers = codec.encode(decision)
            p.produce(f"{prefix}rl.quarantine", value, batch, headers)
    finally:
        p.close()
    entry.decision = decision
    return entry

"""Reading rl.scored (and rl.dlq) into the train buffer.

rl.scored is read with `assign()` (no consumer group: the learner is the only reader that
matters and keeps its own offsets, in state.json) and read_committed. A new run starts at the
end of each partition: older runs' records are not its. Each group read is one of

    accepted            one of our prompts in flight: waits in the buffer for an update
    released            `steadyrl quarantine release` put it back: trained as it is
    released_in_flight  ... reaching a learner resumed from before the hold (replaces the original)
    duplicate           trained already, waiting, or held (a held group read again stays held)
    foreign             another run's
    rejected            the codec refused it: sent to rl.dlq with the reason

Waiting groups leave the buffer when their policy version is older than max_staleness
allows (stale) or newer than the learner's (from weights a crash threw away): the prompt is
published again with the same id. The buffer holds at most max_buffer_size groups
(services/learner/buffer.py). A record of rl.dlq keyed by a prompt in flight means that
prompt is lost: the feeder publishes another.
"""

from __future__ import annotations

import logging

from confluent_kafka import Consumer, TopicPartition
from prometheus_client import Counter, Gauge

from services.learner.buffer import MAX_EVICTIONS, evictions
from services.learner.config import LearnerSection
from services.learner.outbox import Outbox
from services.learner.state import Count, InFlight, Ready, RunState
from steadyrl import codec
from steadyrl.bus.kafka import consumer_config
from steadyrl.config import ConfigError
from steadyrl.contracts import DLQRecord, ScoredGroup
from steadyrl.quarantine import RELEASE_HEADER

log = logging.getLogger("steadyrl.learner")

GROUPS = Counter("steadyrl_learner_groups", "Scored groups read", ["outcome"])
BUFFER_SIZE = Gauge("steadyrl_rollout_buffer_size", "Scored groups waiting in a buffer", ["stage"])
EVICTED = Counter("steadyrl_learner_buffer_evictions", "Groups evicted from the full train buffer (their prompts "
                  "published again)", ["policy"])


def open_consumer(bootstrap: str, client: str, topics: dict[str, str], st: RunState,
                  stats_interval_s: float) -> Consumer:
    """A consumer assigned to every partition of rl.scored at the run's offsets, and rl.dlq.
    A new run's offsets are set to the partitions' ends."""
    conf = consumer_config(bootstrap, client, f"learner-{st.run_id}", stats_interval_s)
    conf.pop("group.protocol", None)
    c = Consumer(conf)
    topic, dlq = topics["rl.scored"], topics["rl.dlq"]
    parts = sorted(c.list_topics(topic, timeout=30).topics[topic].partitions)
    if not st.offsets:
        for p in parts:
            st.offsets[str(p)] = c.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1]
    if st.dlq_offset < 0:
        st.dlq_offset = c.get_watermark_offsets(TopicPartition(dlq, 0), timeout=30)[1]
    c.assign([TopicPartition(topic, p, st.offsets.get(str(p), 0)) for p in parts]
             + [TopicPartition(dlq, 0, st.dlq_offset)])
    return c


class Intake:
    """The train buffer `ready` (prompt id -> Ready) and the rules that fill and empty it."""

    def __init__(self, lc: LearnerSection, st: RunState, outbox: Outbox, stage: str):
        self.lc, self.st, self.outbox, self.stage = lc, st, outbox, stage
        self.ready: dict[str, Ready] = {}
        self._arrivals = 0
        self.dlq_in_a_row = 0  # prompts lost to rl.dlq since the last step

    def saved_offsets(self) -> dict[str, int]:
        """Offsets that re-read every group read but not yet trained (what state.json keeps)."""
        saved = dict(self.st.offsets)
        for r in self.ready.values():
            saved[str(r.partition)] = min(saved.get(str(r.partition), r.offset), r.offset)
        return saved

    def _wait(self, pid: str, sg: ScoredGroup, msg) -> None:
        old = self.ready.get(pid)
        if old is None:
            self._arrivals += 1
        self.ready[pid] = Ready(sg, msg.partition(), msg.offset(), old.arrival if old else self._arrivals)

    def accept(self, msg) -> None:
        """One record of rl.scored (see the module doc for the outcomes)."""
        st = self.st
        st.offsets[str(msg.partition())] = msg.offset() + 1
        try:
            sg = codec.decode(msg.value(), msg.headers(), ScoredGroup)
        except codec.Rejected as rej:
            GROUPS.labels("rejected").inc()
            st.count(Count.rejected)
            self.outbox.produce("rl.dlq", msg.key(), codec.dlq_record(
                rej, stage=self.stage, topic=msg.topic(), partition=msg.partition(),
                offset=msg.offset(), key=msg.key(), value=msg.value()))
            return
        pid = sg.prompt_id
        released_from = codec.header_value(msg.headers(), RELEASE_HEADER)
        if sg.group.prompt.run_id != st.run_id:
            outcome = Count.foreign
        elif released_from is not None and (pid in st.quarantined or (pid in st.in_flight and
                                                                      not st.in_flight[pid].released)):
            # Train it as it is. In flight instead of held: this learner resumed from before the
            # hold; the released copy replaces the original (counted apart: "released" gives
            # back a prompt the feeder replaced).
            held = st.quarantined.pop(pid, None)
            outcome = Count.released if held is not None else Count.released_in_flight
            base = held if held is not None else st.in_flight[pid]
            st.in_flight[pid] = InFlight.model_validate(base.model_dump(exclude={"batch_id"}) | {"released": True})
            self._wait(pid, sg, msg)
            log.info("quarantined group released", extra={"prompt_id": pid, "batch_id": released_from})
        elif pid not in st.in_flight or pid in self.ready:  # incl. a held group read again: stays held
            outcome = Count.duplicate
        else:
            self._wait(pid, sg, msg)
            outcome = None
        GROUPS.labels(outcome.value if outcome else "accepted").inc()
        if outcome is not None:
            st.count(outcome)

    def dead_letter(self, msg) -> None:
        """A record of rl.dlq: if it is one of our prompts in flight, that prompt is lost (it
        cannot be generated or scored); count it and let the feeder publish another.

        Raises ConfigError (exit 2: `steadyrl up` stops instead of restarting) when a whole
        batch's worth of prompts in a row were lost: the configuration cannot work (e.g.
        group_size above what the actor allows).
        """
        st = self.st
        st.dlq_offset = msg.offset() + 1
        pid = (msg.key() or b"").decode(errors="replace")
        if pid not in st.in_flight or pid in self.ready:
            return
        try:
            reason = codec.decode(msg.value(), msg.headers(), DLQRecord)
            why = f"{reason.stage}: {reason.reason.value}: {reason.error}"
        except codec.Rejected as rej:
            why = f"unreadable DLQ record: {rej.detail}"
        del st.in_flight[pid]
        if pid in st.requeue:
            st.requeue.remove(pid)
        st.count(Count.dlq)
        self.dlq_in_a_row += 1
        GROUPS.labels("dlq").inc()
        log.warning("prompt lost to rl.dlq; publishing another", extra={"prompt_id": pid, "why": why})
        if self.dlq_in_a_row >= self.lc.prompts_per_step:
            raise ConfigError(f"the learner's configuration cannot work: {self.dlq_in_a_row} prompts in a row "
                              f"went to rl.dlq; last: {why}")

    def drop_stale(self) -> None:
        """Groups older than max_staleness allows, or newer than this learner (made by weights a
        crash threw away): out of the buffer, their prompts published again (same seed if newer)."""
        st = self.st
        oldest = st.step - self.lc.max_staleness
        for pid, r in list(self.ready.items()):
            v = r.group.group.policy_version
            if oldest <= v <= st.step or (v < oldest and st.in_flight[pid].released):
                continue
            stale = v < oldest
            del self.ready[pid]
            f = st.in_flight[pid]
            if stale:
                f.attempt += 1
            f.released = False  # what comes back is a new sample, unseen
            st.requeue.append(pid)
            GROUPS.labels("stale" if stale else "future").inc()
            st.count(Count.stale_dropped if stale else Count.future_dropped)
            log.info("group dropped; prompt published again",
                     extra={"prompt_id": pid, "policy_version": v, "step": st.step,
                            "why": "stale" if stale else "from discarded weights"})

    def evict(self) -> None:
        """Keep the train buffer within max_buffer_size (services/learner/buffer.py)."""
        st, lc = self.st, self.lc
        waiting = {pid: (r.arrival, r.group.rewards,
                         st.in_flight[pid].released or st.in_flight[pid].evicted >= MAX_EVICTIONS)
                   for pid, r in self.ready.items()}
        for pid in evictions(waiting, lc.max_buffer_size, lc.buffer_eviction):
            del self.ready[pid]
            f = st.in_flight[pid]
            f.attempt += 1
            f.evicted += 1
            st.requeue.append(pid)
            EVICTED.labels(lc.buffer_eviction).inc()
            st.count(Count.evicted)
            log.info("train buffer full: group evicted, prompt published again",
                     extra={"prompt_id": pid, "policy": lc.buffer_eviction, "max": lc.max_buffer_size})
        BUFFER_SIZE.labels("train").set(len(self.ready))


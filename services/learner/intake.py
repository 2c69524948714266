"""Reading rl.scored and rl.releases (and rl.dlq) into the train buffer.

rl.scored and rl.releases are read with `assign()` (no consumer group: the learner is the only
reader that matters and keeps its own offsets, in state.json: `offsets`, `release_offsets`)
and read_committed. A new run starts at the end of each partition: older runs' records are not
its. A run saved before rl.releases existed reads rl.releases from the start (what is there
can only be releases made since). Each group read is one of

    accepted            one of our prompts in flight: waits in the buffer for an update
    released            on rl.releases: `steadyrl quarantine release` put it back: trained as it is
    released_in_flight  ... reaching a learner resumed from before the hold (replaces the original)
    duplicate           trained already, waiting, or held (a held group read again stays held)
    foreign             another run's
    rejected            the codec refused it: sent to rl.dlq with the reason
    invalid_tokens      one of ours whose token ids the model cannot take (`TokenLimits`: an id
                        outside the vocabulary, prompt + response above the context length, an
                        empty prompt): sent to rl.dlq with reason invalid_tokens, never trained

The choice among them is a pure decision over the decoded group (services/learner/arrival.py,
`decide`, tested from a table); `Intake.accept` decodes, decides, and acts in one place (`_act`).

Only rl.releases records are releases: Kafka does not say who produced a record, so authorship
comes from the topic, and rl.releases is written by the quarantine command alone (rl.scored by
the reward workers). A group on rl.scored carrying the release header (`steadyrl-release`) is
read as any other (a held one stays held); it is counted (`counts.release_on_scored`,
`steadyrl_learner_release_on_scored_total`) and logged.

Waiting groups leave the buffer when their policy version is older than max_staleness
allows (stale) or newer than the learner's (from weights a crash threw away): the prompt is
published again with the same id. The buffer holds at most max_buffer_size groups
(services/learner/buffer.py).

A record of rl.dlq keyed by a prompt in flight (and not waiting) means that prompt's
generation, scoring or group was refused somewhere -- by a rollout or reward worker, or by
this learner (rejected, invalid_tokens: the learner acts on its own DLQ records when it
reads them back, one rule for all) -- when it counts: readable, from a stage that could have
refused it, and naming the attempt in flight (services/learner/dlq_check.py; one that does
not is counted in `counts.dlq_ignored` and changes nothing). The prompt is published again,
same id, attempt + 1 (a new seed), so each prompt is still trained once; it is counted
(`steadyrl_learner_dlq_prompts_total{reason}`, `counts.dlq`). The learner goes on: a
configuration that cannot work sends every prompt there, and the alert on that counter tells a
person; when a batch's worth in a row came since the last step, an error names the reasons
(services/learner/refusals.py). The one exception is a reward scorer that raises on every
sample of learner.scorer_failure_limit groups in a row with none scored in between: the loop
stops the run (exit 2) naming the scorer and the exception (refusals.py). A forged or replayed
DLQ record costs nothing unless it names the stage and attempt a real refusal would; then one
more generation of the prompt, never the prompt: each attempt is refused at most once.

Every prompt has an end: one refused `learner.prompt_max_refusals` times (each a publish of
the learner's own, after its backoff) over at least `prompt_min_refusal_s` since its first
refusal is abandoned (`abandon`): taken out of flight, recorded once in `state.abandoned` and
`<run>/abandoned.jsonl` with its last reasons, counted (`counts.abandoned`,
`steadyrl_learner_prompts_abandoned_total`, alert `PromptsAbandoned`), and replaced by the next
row (feeder.py). The budget is counted in the learner's own publishes, so one record's word
cannot end a prompt: a record naming a prompt already queued to go out again is ignored.
"""

from __future__ import annotations

import logging
import time
from collections import Counter as Tally
from collections.abc import Callable
from pathlib import Path

from confluent_kafka import Consumer, Message, TopicPartition
from prometheus_client import Counter, Gauge

from steadyrl.bus.kafka import consumer_config
from steadyrl.files import append_line
from steadyrl.run import diskspace
from steadyrl.run.quarantine import RELEASE_HEADER
from steadyrl.run.runfolder import Count
from steadyrl.wire import codec
from steadyrl.wire.contracts import DLQRecord, Prompt, ScoredGroup, now_ms

from .arrival import COUNTS, DEAD_LETTERED, Decision, Facts, Outcome, decide
from .buffer import MAX_EVICTIONS, evictions
from .config import LearnerSection
from .dlq_check import uncounted
from .outbox import Outbox
from .refusals import Refusals, default_limit
from .state import REASONS_KEPT, InFlight, Ready, RunState
from .tokens import TokenLimits

log = logging.getLogger("steadyrl.learner")

GROUPS = Counter("steadyrl_learner_groups", "Scored groups read", ["outcome"])
DLQ_PROMPTS = Counter("steadyrl_learner_dlq_prompts", "Prompts in flight that a record on rl.dlq refused, published "
                      "again (same id, a new seed), by the DLQ record's reason", ["reason"])
DLQ_IGNORED = Counter("steadyrl_learner_dlq_ignored", "Records on rl.dlq keyed by a prompt in flight that did not "
                      "count as its refusal (services/learner/dlq_check.py): unreadable, from a stage that could "
                      "not have refused it (stage), for another attempt (attempt: a replay, a late copy) or naming "
                      "none (no_attempt)", ["why"])
RELEASE_ON_SCORED = Counter("steadyrl_learner_release_on_scored", "Groups on rl.scored carrying the release "
                            "header: not releases (only rl.releases' groups are), read as any other")
BUFFER_SIZE = Gauge("steadyrl_rollout_buffer_size", "Scored groups waiting in a buffer", ["stage"])
#: what the warning of a group refused says, by outcome
REFUSED = {Outcome.PROMPT_DIFFERS: "its prompt is not the one published",
           Outcome.INVALID_TOKENS: "token ids the model cannot take"}
#: characters of a DLQ record's error kept as a refusal's reason (state.json holds them)
REASON_CHARS = 500
ABANDONED = Counter("steadyrl_learner_prompts_abandoned", "Prompts abandoned: refused (sent back by rl.dlq) "
                    "learner.prompt_max_refusals times over at least prompt_min_refusal_s, or left out at start "
                    "as unservable; never trained, each replaced by the next row (<run>/abandoned.jsonl)")
EVICTED = Counter("steadyrl_learner_buffer_evictions", "Groups evicted from the full train buffer (their prompts "
                  "published again)", ["policy"])


def open_consumer(bootstrap: str, client: str, topics: dict[str, str], st: RunState,
                  stats_interval_s: float) -> Consumer:
    """A consumer assigned to every partition of rl.scored and rl.releases at the run's offsets,
    and rl.dlq. A new run's offsets are set to the partitions' ends; a run saved before
    rl.releases existed (no `release_offsets`) reads rl.releases from each partition's start."""
    conf = consumer_config(bootstrap, client, f"learner-{st.run_id}", stats_interval_s)
    conf.pop("group.protocol", None)
    c = Consumer(conf)
    topic, releases, dlq = topics["rl.scored"], topics["rl.releases"], topics["rl.dlq"]
    parts = {t: sorted(c.list_topics(t, timeout=30).topics[t].partitions) for t in (topic, releases)}
    if not parts[releases]:  # an older deployment's topics: releases would go unread
        c.close()
        raise RuntimeError(f"topic {releases} is missing at {bootstrap}: create it (`steadyrl topics create`)")
    new_run = not st.offsets
    if new_run:
        for p in parts[topic]:
            st.offsets[str(p)] = c.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1]
    if not st.release_offsets:
        for p in parts[releases]:
            low, high = c.get_watermark_offsets(TopicPartition(releases, p), timeout=30)
            st.release_offsets[str(p)] = high if new_run else low
    if st.dlq_offset < 0:
        st.dlq_offset = c.get_watermark_offsets(TopicPartition(dlq, 0), timeout=30)[1]
    c.assign([TopicPartition(topic, p, st.offsets.get(str(p), 0)) for p in parts[topic]]
             + [TopicPartition(releases, p, st.release_offsets.get(str(p), 0)) for p in parts[releases]]
             + [TopicPartition(dlq, 0, st.dlq_offset)])
    return c


def dlq_backoff_s(attempt: int) -> float:
    """Seconds before a prompt sent back by rl.dlq for the `attempt`-th time (>= 1) goes out again:
    1, 2, 4, ... capped at 60."""
    return float(min(60, 2 ** max(attempt - 1, 0)))


#: The fields of a group's prompt that must equal the published prompt's: what the reward is
#: computed from and what is trained (not the seed or min_policy_version, which a republished
#: attempt changes while an earlier attempt's group may still arrive).
PROMPT_FIELDS = ("prompt_id", "run_id", "epoch", "index", "messages", "ground_truth", "data_source", "extra_info",
                 "n_samples")


def prompt_differs(got: Prompt, published: Prompt) -> str | None:
    """The first of PROMPT_FIELDS where `got` (a group's prompt) differs from `published`; None
    when they agree. Authorship of the prompt's content: only the learner writes rl.prompts,
    so a rollout or reward stage that rewrote a prompt (e.g. its ground truth, to be scored 1)
    is caught here."""
    for name in PROMPT_FIELDS:
        if getattr(got, name) != getattr(published, name):
            return name
    return None


def _where(msg: Message) -> tuple[str, int, int]:
    """(topic, partition, offset) of a consumed record: librdkafka sets all three on every record
    it delivers (None only on an error event, which the loop skips)."""
    topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
    assert topic is not None and partition is not None and offset is not None, "an error event, not a record"
    return topic, partition, offset


class Intake:
    """The train buffer `ready` (prompt id -> Ready) and the rules that fill and empty it."""

    def __init__(self, lc: LearnerSection, st: RunState, outbox: Outbox, stage: str,
                 limits: TokenLimits | None = None, run_dir: Path | None = None,
                 topic_prefix: str = ""):
        self.lc, self.st, self.outbox, self.stage, self.limits = lc, st, outbox, stage, limits
        self.topic_prefix = topic_prefix  # of this deployment's topics (a DLQ record names one)
        self.ignored_since_step: Tally[str] = Tally()   # DLQ records that did not count, by why
        self.run_dir = run_dir  # where abandoned.jsonl goes (None: not written)
        self.ready: dict[str, Ready] = {}
        self._arrivals = 0
        self.dlq_in_a_row = 0  # prompts sent back by rl.dlq since the last step (stepped() resets it)
        self.refusals = Refusals(lc.scorer_failure_limit or default_limit(lc.prompts_per_step))
        self.retry_at: dict[str, float] = {}  # prompt id -> time.monotonic() before which it is not sent again
        #: (prompt id, its InFlight) -> the Prompt the feeder published (Feeder.prompt); set by the
        #: loop. A group whose prompt differs is refused (`prompt_differs`). None: not checked.
        self.published: Callable[[str, InFlight], Prompt] | None = None

    def stepped(self) -> None:
        """A step was made: the count of refusals in a row and their reasons start anew."""
        self.dlq_in_a_row = 0
        self.refusals.stepped()
        self.ignored_since_step.clear()

    def saved_offsets(self) -> dict[str, dict[str, int]]:
        """What state.json keeps as `offsets` (rl.scored) and `release_offsets` (rl.releases):
        offsets that re-read every group read but not yet trained."""
        saved = {"offsets": dict(self.st.offsets), "release_offsets": dict(self.st.release_offsets)}
        for r in self.ready.values():
            at = saved["release_offsets" if r.topic == "rl.releases" else "offsets"]
            at[str(r.partition)] = min(at.get(str(r.partition), r.offset), r.offset)
        return saved

    def _wait(self, pid: str, sg: ScoredGroup, msg: Message, topic: str) -> None:
        old = self.ready.get(pid)
        if old is None:
            self._arrivals += 1
        _, partition, offset = _where(msg)
        self.ready[pid] = Ready(sg, partition, offset, old.arrival if old else self._arrivals, topic)

    def accept(self, msg: Message, releases: bool = False) -> None:
        """One record of rl.scored, or of rl.releases (`releases`: the only records that are
        releases): decoded, decided (services/learner/arrival.py), acted on (`_act`); see the
        module doc for the outcomes."""
        st, topic = self.st, "rl.releases" if releases else "rl.scored"
        _, partition, offset = _where(msg)
        (st.release_offsets if releases else st.offsets)[str(partition)] = offset + 1
        try:
            sg = codec.decode(msg.value(), msg.headers(), ScoredGroup)
        except codec.Rejected as rej:
            self._act(msg, None, Decision(Outcome.REJECTED, rej.detail), topic, rej)
            return
        pid, ours = sg.prompt_id, sg.group.prompt.run_id == st.run_id
        if not releases and ours:
            self.refusals.scored()   # the scorer scored a group of this run: it works
        released_from = codec.header_value(msg.headers(), RELEASE_HEADER)
        if released_from is not None and not releases:
            RELEASE_ON_SCORED.inc()
            st.count(Count.release_on_scored)
            log.warning("a group on rl.scored carries the release header: not a release (only rl.releases' "
                        "groups are); read as any other", extra={"prompt_id": pid, "batch_id": released_from})
        f = Facts(ours=ours, on_releases=releases, in_flight=pid in st.in_flight,
                  released=pid in st.in_flight and st.in_flight[pid].released, held=pid in st.quarantined,
                  waiting=pid in self.ready)
        differs = invalid = None
        if f.takes:   # only a group the learner would take is checked
            sent = st.quarantined.get(pid) or st.in_flight.get(pid)
            if sent is not None and self.published is not None:
                differs = prompt_differs(sg.group.prompt, self.published(pid, sent))
            invalid = self.limits.violation(sg) if self.limits is not None else None
        self._act(msg, sg, decide(f, differs, invalid), topic)

    def _act(self, msg: Message, sg: ScoredGroup | None, d: Decision, topic: str,
             rej: codec.Rejected | None = None) -> None:
        """Carry out decision `d` on the record `msg` read on `topic` (its group `sg`, None when
        the codec refused it as `rej`): counted, logged, sent to rl.dlq, or waiting in the buffer."""
        st = self.st
        GROUPS.labels(d.outcome.value).inc()
        if (count := COUNTS.get(d.outcome)) is not None:
            st.count(count)
        if sg is None:   # REJECTED by the codec
            assert rej is not None, "a record without a group is one the codec refused"
            self._dead_letter_out(msg, rej)
            return
        pid = sg.prompt_id
        if (reason := DEAD_LETTERED.get(d.outcome)) is not None:
            # Never trained: on rl.dlq, which publishes the prompt again when the learner reads it
            # back (dead_letter). A released copy refused so stays held (like a drop).
            log.warning(f"group refused: {REFUSED[d.outcome]}", extra={"prompt_id": pid, "why": d.why})
            self._dead_letter_out(msg, codec.Rejected(reason, f"{pid}: {d.why}", codec.header_value(msg.headers())))
        elif d.outcome in (Outcome.RELEASED, Outcome.RELEASED_IN_FLIGHT):
            # Train it as it is. In flight instead of held: this learner resumed from before the
            # hold; the released copy replaces the original (counted apart: "released" gives
            # back a prompt the feeder replaced).
            held = st.quarantined.pop(pid, None)
            base = held if held is not None else st.in_flight[pid]
            st.in_flight[pid] = InFlight.model_validate(base.model_dump(exclude={"batch_id"}) | {"released": True})
            self._wait(pid, sg, msg, topic)
            log.info("quarantined group released", extra={"prompt_id": pid, "batch_id": codec.header_value(
                msg.headers(), RELEASE_HEADER)})
        elif d.outcome is Outcome.ACCEPTED:
            self._wait(pid, sg, msg, topic)

    def _dead_letter_out(self, msg: Message, rej: codec.Rejected) -> None:
        """Send the rl.scored (or rl.releases) record `msg` to rl.dlq (flushed: on the topic before the offset
        past it can be saved, so a crash cannot lose both the group and the record of it)."""
        topic, partition, offset = _where(msg)
        self.outbox.produce("rl.dlq", msg.key(), codec.dlq_record(
            rej, stage=self.stage, topic=topic, partition=partition,
            offset=offset, key=msg.key(), value=msg.value()))
        self.outbox.flush()

    def dead_letter(self, msg: Message) -> None:
        """A record of rl.dlq: if it names one of our prompts in flight (not waiting in the
        buffer, not already queued to go out again) and counts as its refusal (readable, from a
        stage that could have refused it, naming the attempt in flight: dlq_check.py), that
        prompt's group will not come: publish it again (same id, attempt + 1: a new seed) and
        count it. One that does not count is counted as ignored, and changes nothing else.
        Never raises on what the record holds."""
        st = self.st
        st.dlq_offset = _where(msg)[2] + 1
        pid = (msg.key() or b"").decode(errors="replace")
        if pid not in st.in_flight or pid in self.ready or pid in st.requeue:
            return
        f = st.in_flight[pid]
        try:
            rec = codec.decode(msg.value(), msg.headers(), DLQRecord)
        except codec.Rejected as rej:
            self._ignored(pid, "unreadable", rej.detail)
            return
        # the seed of the attempt in flight names it for a record without `attempt` (dlq_check.py)
        seed = self.published(pid, f).seed if self.published is not None and rec.attempt is None else None
        why_not = uncounted(rec, self.topic_prefix, f.attempt, seed)
        if why_not is not None:
            self._ignored(pid, why_not, f"{rec.stage[:100]}: {rec.reason.value} on {rec.topic[:100]}, attempt "
                                        f"{rec.attempt}; the attempt in flight is {f.attempt}")
            return
        # the error is the writer's text, of any length: a reason is kept and logged cut short
        reason, why = rec.reason.value, f"{rec.stage[:100]}: {rec.reason.value}: {rec.error[:REASON_CHARS]}"
        self.refusals.refused(rec.stage[:100], reason, rec.error)
        f.attempt += 1
        f.released = False  # what comes back is a new sample
        f.refused += 1
        f.first_refused_ms = f.first_refused_ms or now_ms()
        f.reasons = (f.reasons + [why])[-REASONS_KEPT:]
        st.count(Count.dlq)
        self.dlq_in_a_row += 1
        GROUPS.labels("dlq").inc()
        DLQ_PROMPTS.labels(reason).inc()
        lc = self.lc
        if f.refused >= lc.prompt_max_refusals and now_ms() - f.first_refused_ms >= lc.prompt_min_refusal_s * 1000:
            self.abandon(pid, f"refused {f.refused} times over "
                              f"{(now_ms() - f.first_refused_ms) / 1000:.0f} s; last: {why}")
            return
        st.requeue.append(pid)
        # Not at once: a configuration that can never work (or a poison record) would cycle the
        # prompt through rl.dlq as fast as a worker refuses it. 1, 2, 4, ... 60 s (in memory:
        # a restarted learner sends its requeue at once).
        self.retry_at[pid] = time.monotonic() + dlq_backoff_s(f.attempt)
        log.warning("prompt went to rl.dlq; publishing it again with a new seed",
                    extra={"prompt_id": pid, "attempt": f.attempt, "refused": f.refused, "why": why,
                           "in_a_row": self.dlq_in_a_row})
        if self.dlq_in_a_row == self.lc.prompts_per_step:  # once per streak; the alert is on the counter
            log.error(f"a batch's worth of prompts in a row went to rl.dlq since the last step: "
                      f"{self.refusals.summary()}; the learner goes on",
                      extra={"in_a_row": self.dlq_in_a_row, "last": why})

    def _ignored(self, pid: str, why: str, detail: str) -> None:
        """A DLQ record keyed by prompt `pid` (in flight) that does not count (`why`:
        dlq_check.py): counted; logged as a warning the first time per `why` since the last
        step (a flood of forged records does not flood the log), else at debug."""
        self.st.count(Count.dlq_ignored)
        DLQ_IGNORED.labels(why).inc()
        first = self.ignored_since_step[why] == 0
        self.ignored_since_step[why] += 1
        log.log(logging.WARNING if first else logging.DEBUG,
                "a record on rl.dlq did not count as a refusal of the prompt it names (forged, replayed, or for "
                "an earlier attempt)", extra={"prompt_id": pid, "why": why, "detail": detail[:REASON_CHARS]})

    def abandon(self, pid: str, why: str) -> None:
        """Give up prompt `pid` (in flight): never trained, out of the run's books, recorded once
        in `<run>/abandoned.jsonl` and `state.abandoned` with `why`, counted
        (`steadyrl_learner_prompts_abandoned_total`); the feeder gives its slot to the next row.
        The caller saves the state."""
        st = self.st
        f = st.in_flight.pop(pid)
        self.ready.pop(pid, None)
        self.retry_at.pop(pid, None)
        if pid in st.requeue:
            st.requeue.remove(pid)
        st.abandoned[pid] = why
        st.count(Count.abandoned)
        ABANDONED.inc()
        if self.run_dir is not None:
            path = self.run_dir / "abandoned.jsonl"
            row = {"prompt_id": pid, "epoch": f.epoch, "index": f.index, "attempts": f.attempt, "refused": f.refused,
                   "step": st.step, "reasons": f.reasons or [why], "why": why, "time_ms": now_ms()}
            diskspace.retry(lambda: append_line(path, row), "abandoned", path)   # a full disk: until space returns
        log.error("prompt abandoned: refused past its budget; the next row takes its place",
                  extra={"prompt_id": pid, "index": f.index, "refused": f.refused, "why": why})

    def drop_stale(self) -> None:
        """Groups older than max_staleness allows, or newer than this learner (made by weights a
        crash threw away): out of the buffer, their prompts published again (same seed if newer).
        An episode's turns may span versions: the bound counts from its oldest turn (its first),
        and any turn newer than this learner makes the group newer."""
        st = self.st
        oldest = st.step - self.lc.max_staleness
        for pid, r in list(self.ready.items()):
            g = r.group.group
            v, newest = g.oldest_version, g.newest_version
            if newest <= st.step and (oldest <= v or st.in_flight[pid].released):
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


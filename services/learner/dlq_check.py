"""Which records on rl.dlq count as a refusal of a prompt in flight (issue 46).

Kafka does not say who wrote a record, and anyone who may write rl.dlq can write a record keyed
by any prompt id; a broker that lost its tail replays records already read. A refusal costs the
prompt one of its learner.prompt_max_refusals, and a scorer_error one moves the count toward
learner.scorer_failure_limit, which stops the run. So a record keyed by a prompt in flight
counts only when all of these hold (`uncounted` says which did not):

- it is readable: a dlq_record of this major (else `unreadable`);
- it comes from a stage that could have refused that prompt: its `stage` names a service that
  reads the `topic` it names (rollout: rl.prompts; reward: rl.rollouts; the learner:
  rl.scored, rl.releases), and a reason only one service gives comes from it (`scorer_*`: the
  reward server's scorer; `invalid_tokens`: the learner) (else `stage`);
- it names the attempt in flight now: `attempt` (dlq_record 1.4, copied from the refused
  record's prompt by codec.dlq_record) equals the prompt's (`InFlight.attempt`) (else
  `attempt`). Counting one moves the prompt to its next attempt (published again with a new
  seed), so a second record for the same attempt -- a replay, or a refusal of a copy of the
  same publish -- names an attempt no longer in flight and does not count: a refusal counts
  once.

A record without `attempt` (written by a version before dlq_record 1.4, or refusing a prompt
published before prompt 1.3: a run in flight during an upgrade) is read by the prompt its
payload holds: its `attempt` when it has one, else its `seed`, which names the attempt too
(the feeder's seed is the row's plus 7919 per attempt: services/learner/rows.py). A record
whose payload cannot tell (truncated, not a record holding a prompt) does not count
(`no_attempt`): the prompt goes out again once overdue (learner.republish_min_s), as one whose
records were lost.

What does not count is counted (`counts.dlq_ignored`,
`steadyrl_learner_dlq_ignored_total{why}`) and logged, never acted on.
"""

from __future__ import annotations

import base64
import binascii

from steadyrl.bus.topics import topic_name
from steadyrl.wire import codec
from steadyrl.wire.contracts import DLQReason, DLQRecord

#: service (the part of a DLQ record's `stage` before "/") -> the topics (catalogue names) it reads.
STAGE_READS: dict[str, tuple[str, ...]] = {
    "rollout": ("rl.prompts", "rl.episodes"),   # rl.episodes: an agent episode's later turns
    "reward": ("rl.rollouts",),
    "learner": ("rl.scored", "rl.releases"),
}
#: reasons only one service gives -> that service (a reason starting with `scorer_`: the reward's).
ONLY_FROM: dict[str, str] = {DLQReason.invalid_tokens.value: "learner"}


def reason_service(reason: str) -> str | None:
    """The only service that gives `reason`, or None when any stage may."""
    return "reward" if reason.startswith("scorer_") else ONLY_FROM.get(reason)


def stage_could_refuse(rec: DLQRecord, topic_prefix: str) -> bool:
    """Whether `rec`'s stage could have written it: a service reading the topic it names (this
    deployment's: catalogue name after `topic_prefix`), and the one service that gives its
    reason."""
    service = rec.stage.split("/", 1)[0]
    read = {topic_name(t, topic_prefix) for t in STAGE_READS.get(service, ())}
    only = reason_service(rec.reason.value)
    return rec.topic in read and (only is None or only == service)


def named_attempt(rec: DLQRecord, seed_in_flight: int | None, attempt_in_flight: int) -> int | None:
    """The attempt `rec` names: its `attempt`; for a record without one, the attempt of the
    prompt its payload holds (that prompt's `attempt`, or `attempt_in_flight` when its `seed`
    is `seed_in_flight`, -1 when it is another seed); None when it cannot tell."""
    if rec.attempt is not None:
        return rec.attempt
    if rec.payload_truncated:
        return None
    try:
        payload = base64.b64decode(rec.payload_b64, validate=True)
    except (binascii.Error, ValueError):
        return None
    prompt = codec.held_prompt(payload)
    if prompt is None:
        return None
    attempt = codec.held_attempt(payload)
    if attempt is not None:
        return attempt
    seed = prompt.get("seed")
    if type(seed) is not int or seed_in_flight is None:
        return None
    return attempt_in_flight if seed == seed_in_flight else -1


def uncounted(rec: DLQRecord, topic_prefix: str, attempt_in_flight: int,
              seed_in_flight: int | None) -> str | None:
    """Why the readable DLQ record `rec`, keyed by a prompt in flight at `attempt_in_flight`
    (published with `seed_in_flight`; None: not known), does not count as its refusal:
    `stage`, `attempt` or `no_attempt` (module doc); None when it counts."""
    if not stage_could_refuse(rec, topic_prefix):
        return "stage"
    named = named_attempt(rec, seed_in_flight, attempt_in_flight)
    if named is None:
        return "no_attempt"
    return None if named == attempt_in_flight else "attempt"

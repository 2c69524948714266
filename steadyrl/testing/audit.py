"""The one exactly-once audit of a learner run, from the broker's topics and the run's files.

What it checks (each a named entry of the report's `checks`, all must hold for `ok`):

- `final_step_reached`: the run is marked finished, at the step asked for, and the audit log
  holds every step 1..steps;
- `trained_count_is_steps_x_batch`: steps x batch groups were trained;
- `no_prompt_trained_twice`: no prompt id appears twice in consumed.jsonl;
- `every_trained_prompt_was_published`: each trained prompt id is on rl.prompts;
- `no_published_prompt_lost`: each prompt id of the run on rl.prompts was trained, or
  abandoned (the state's `abandoned`: refused past its budget), or is excused (its key is on
  rl.dlq, or the reward watch holds it) where the caller allows that;
- `no_abandoned_prompt_trained`: a prompt is trained once or abandoned once, never both;
- `audit_log_in_step_order`: consumed.jsonl never goes back a step;
- `rollout_stage_exactly_once`, `reward_stage_exactly_once` (`audit_pipeline` only): every
  input record below the stage's committed group offsets became exactly one output record
  (read_committed) or one DLQ record, and the stage produced nothing else.

`audit_run` does the learner-side checks from data the caller read (no broker needed);
`audit_pipeline` reads the topics and does them all. `audit_episodes` checks multi-turn
episodes (rl.episodes, read_committed) against the groups they finished as.
"""

from __future__ import annotations

import base64
from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from typing import Any, Protocol, TypeVar

from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient

from steadyrl.bus.kafka import client_config, read_topic
from steadyrl.testing.run import RunDir
from steadyrl.wire import codec
from steadyrl.wire.contracts import DLQRecord, EpisodeState, Prompt, RolloutGroup, ScoredGroup

#: The consumer groups of the two stages (the services' default `group_id`).
STAGE_GROUPS = {"rollout": "steadyrl-rollout", "reward": "steadyrl-reward"}

#: The identity a stage's input and its output share (e.g. one publish of a prompt).
Key = tuple[Hashable, ...]


class Consumed(Protocol):
    """What stage_audit reads of a consumed message (a confluent_kafka Message)."""

    def topic(self) -> str | None: ...
    def partition(self) -> int | None: ...
    def offset(self) -> int | None: ...


In = TypeVar("In", bound=Consumed)
Out = TypeVar("Out")


def _ref(m: Consumed) -> tuple[str, int, int]:
    """(topic, partition, offset) of a consumed record: librdkafka sets all three on every record
    it delivers (None only on an error event, which no reader here keeps)."""
    topic, partition, offset = m.topic(), m.partition(), m.offset()
    assert topic is not None and partition is not None and offset is not None, "an error event, not a record"
    return topic, partition, offset


def audit_run(run: RunDir, steps: int, batch: int, published: Iterable[str] | None = None,
              excused: Iterable[str] = ()) -> dict[str, Any]:
    """The learner-side exactly-once checks of one finished run.

    Args:
        run: the run's folder.
        steps, batch: the steps the run was asked for and the prompts per step.
        published: the prompt id of every record on rl.prompts (one per publish; other runs'
            ids are left out here). None: the two checks against rl.prompts are not made.
        excused: prompt ids that may stay untrained (on rl.dlq, held by the reward watch);
            the run's abandoned prompts (state.json `abandoned`) always may.

    Returns a JSON-able report: `ok`, `checks` (name -> bool) and the evidence: counts of
    published, republished and trained ids, and up to 10 examples of each failure
    (`trained_twice`, `not_published`, `lost`; `lost_count` in full).
    """
    state, consumed = run.state, run.consumed()
    abandoned = state.get("abandoned") or {}
    trained = Counter(c["prompt_id"] for c in consumed)
    steps_seen = sorted({c["step"] for c in consumed})
    twice = sorted(p for p, n in trained.items() if n > 1)
    checks = {
        "final_step_reached": bool(state.get("finished")) and state.get("step") == steps
                              and steps_seen == list(range(1, steps + 1)),
        "trained_count_is_steps_x_batch": sum(trained.values()) == steps * batch,
        "no_prompt_trained_twice": not twice,
        "no_abandoned_prompt_trained": not (set(abandoned) & set(trained)),
    }
    report: dict[str, Any] = {"run_id": run.run_id, "step": state.get("step"), "finished": state.get("finished"),
                              "counts": state.get("counts", {})}
    if published is not None:
        run_prefix = run.run_id + "/"
        pub = Counter(p for p in published if p.startswith(run_prefix))
        not_published = sorted(set(trained) - set(pub))
        lost = sorted(set(pub) - set(trained) - set(excused) - set(abandoned))
        checks["every_trained_prompt_was_published"] = not not_published
        checks["no_published_prompt_lost"] = not lost
        report.update(published_ids=len(pub), publish_records=sum(pub.values()),
                      republished_ids=sum(1 for n in pub.values() if n > 1),
                      not_published=not_published[:10], lost=lost[:10], lost_count=len(lost))
    steps_in_order = [c["step"] for c in consumed]
    checks["audit_log_in_step_order"] = steps_in_order == sorted(steps_in_order)
    report.update(trained=sum(trained.values()), trained_twice=twice[:10], abandoned=len(abandoned))
    return {"ok": all(checks.values()), "checks": checks, **report}


def stage_audit(name: str, inputs: list[In], in_key: Callable[[In], Key], outputs: list[Out],
                out_key: Callable[[Out], Key], committed: dict[int, int],
                dlq_refs: set[tuple[str, int, int]]) -> dict[str, Any]:
    """One stage's exactly-once check: inputs below the group's committed offsets -> exactly one
    output each (or one DLQ record), and no other output.

    Args:
        name: the stage, for the report.
        inputs: the input topic's messages (`.topic()`, `.partition()`, `.offset()`).
        in_key: input message -> the identity its output carries (e.g. one publish of a prompt).
        outputs: the decoded output records; out_key: output -> that identity.
        committed: partition -> the stage group's committed offset (next to read).
        dlq_refs: (topic, partition, offset) of every input that went to rl.dlq.
    """
    done = [m for m in inputs if _ref(m)[2] < committed.get(_ref(m)[1], -1)]
    expected = Counter(in_key(m) for m in done if _ref(m) not in dlq_refs)
    got = Counter(out_key(m) for m in outputs)
    dup = {k: n - expected[k] for k, n in got.items() if n > expected.get(k, 0)}
    missing = {k: n - got.get(k, 0) for k, n in expected.items() if got.get(k, 0) < n}
    return {"stage": name, "inputs": len(inputs), "inputs_committed": len(done),
            "inputs_to_dlq": sum(1 for m in done if _ref(m) in dlq_refs),
            "outputs": len(outputs), "duplicated_outputs": sum(dup.values()), "missing_outputs": sum(missing.values()),
            "examples": {"duplicated": [list(k) for k in list(dup)[:3]],
                         "missing": [list(k) for k in list(missing)[:3]]},
            "ok": not dup and not missing}


def committed_offsets(bootstrap: str, group: str, topic: str, partitions: Iterable[int]) -> dict[int, int]:
    """partition -> the consumer group's committed offset on `topic` (negative: none)."""
    admin = AdminClient(client_config(bootstrap) | {"log_level": 4})
    req = [ConsumerGroupTopicPartitions(group, [TopicPartition(topic, p) for p in partitions])]
    res = admin.list_consumer_group_offsets(req)[group].result(60)
    return {tp.partition: tp.offset for tp in res.topic_partitions}


def audit_pipeline(bootstrap: str, prefix: str, run: RunDir, steps: int, batch: int, *,
                   excuse_dlq: bool = True, client: str = "steadyrl-audit", timeout_s: float = 120.0,
                   groups: dict[str, str] | None = None) -> dict[str, Any]:
    """The whole exactly-once audit of one finished run under topic `prefix` (see the module doc).

    Reads rl.prompts, rl.rollouts, rl.scored and rl.dlq (every committed record) and the stage
    groups' committed offsets. `excuse_dlq`: a published prompt keyed on rl.dlq, or held by
    the reward watch, does not count as lost (False: every published prompt must be trained).
    Returns `audit_run`'s report plus `dlq_records`, `published_ids_in_dlq`, `dlq_reasons`
    (stage, reason, topic, count, an example error), `quarantined`, `stages` (`stage_audit`
    of each) and `scored_groups_by_reward_source`.
    """
    groups = STAGE_GROUPS | (groups or {})
    topic = {t: f"{prefix}{t}" for t in ("rl.prompts", "rl.rollouts", "rl.scored", "rl.dlq")}
    raw = {t: read_topic(bootstrap, name, client, timeout_s) for t, name in topic.items()}
    prompts = [(m, codec.decode(m.value(), m.headers(), Prompt)) for m in raw["rl.prompts"]]
    rollouts = [(m, codec.decode(m.value(), m.headers(), RolloutGroup)) for m in raw["rl.rollouts"]]
    scored = [(m, codec.decode(m.value(), m.headers(), ScoredGroup)) for m in raw["rl.scored"]]
    dlq = [codec.decode(m.value(), m.headers(), DLQRecord) for m in raw["rl.dlq"]]

    dlq_ids = {base64.b64decode(d.key_b64).decode(errors="replace") for d in dlq if d.key_b64}
    quarantined = set(run.quarantined)
    report = audit_run(run, steps, batch, published=[p.prompt_id for _, p in prompts],
                       excused=(dlq_ids | quarantined) if excuse_dlq else ())
    dlq_refs = {(d.topic, d.partition, d.offset) for d in dlq}
    prompt_at = {(m.topic(), m.partition(), m.offset()): v for m, v in prompts}
    group_at = {(m.topic(), m.partition(), m.offset()): v for m, v in rollouts}

    def committed(name: str, src: str) -> dict[int, int]:
        parts = sorted({m.partition() for m in raw[src]}) or list(range(8))
        return committed_offsets(bootstrap, groups[name], topic[src], parts)

    stages = [
        stage_audit("rollout", raw["rl.prompts"], lambda m: _prompt_key(prompt_at[_ref(m)]), [v for _, v in rollouts],
                    lambda g: _prompt_key(g.prompt), committed("rollout", "rl.prompts"), dlq_refs),
        stage_audit("reward", raw["rl.rollouts"], lambda m: _group_key(group_at[_ref(m)]), [v for _, v in scored],
                    lambda s: _group_key(s.group), committed("reward", "rl.rollouts"), dlq_refs),
    ]
    report["checks"]["rollout_stage_exactly_once"] = stages[0]["ok"]
    report["checks"]["reward_stage_exactly_once"] = stages[1]["ok"]
    report["ok"] = all(report["checks"].values())
    published = {p.prompt_id for _, p in prompts if p.prompt_id.startswith(run.run_id + "/")}
    report.update(dlq_records=len(dlq), published_ids_in_dlq=len(published & dlq_ids),
                  dlq_reasons=_dlq_reasons(dlq, prefix), quarantined=len(quarantined), stages=stages,
                  scored_groups_by_reward_source=dict(Counter(v.reward_source.value for _, v in scored)))
    return report


def _prompt_key(p: Prompt) -> Key:
    """One publish of a prompt."""
    return p.prompt_id, p.created_ms, p.seed


def _group_key(g: RolloutGroup) -> Key:
    """One rollout group."""
    return *_prompt_key(g.prompt), g.generated_ms


def _dlq_reasons(dlq: list[DLQRecord], prefix: str) -> list[dict[str, Any]]:
    """The dead letters by (stage, reason, topic without `prefix`), sorted: each with its count
    and the error of the first (300 characters)."""
    def where(d: DLQRecord) -> tuple[str, str, str]:
        return d.stage.split("/")[0], d.reason.value, d.topic.removeprefix(prefix)

    reasons = Counter(where(d) for d in dlq)
    return [{"stage": s, "reason": r, "topic": t, "count": n,
             "example": next(d.error for d in dlq if where(d) == (s, r, t))[:300]}
            for (s, r, t), n in sorted(reasons.items())]
def samples_extend(group: RolloutGroup, episodes: list[Any], extends: Callable[[Any, Any], bool]) -> bool:
    """Whether each sample of a finished `group` extends an episode of its last state, in order:
    one each, or, with truncated episodes dropped (`rollout.agent.truncated: drop`, counted in
    the group's `rejected` as truncated_*), one each of the episodes left, matched in order."""
    dropped = sum(n for why, n in group.rejected.items() if why.startswith("truncated_"))
    if len(group.samples) + dropped != len(episodes):
        return False
    k = 0
    for ep in episodes:   # the samples are the kept episodes, in their order
        if k < len(group.samples) and extends(group.samples[k], ep):
            k += 1
    return k == len(group.samples)


def audit_episodes(states: Iterable[EpisodeState], groups: Iterable[RolloutGroup],
                   prompts: Iterable[str]) -> dict[str, Any]:
    """The exactly-once checks of multi-turn episodes (steadyrl/model/agents.py), from the committed
    records of rl.episodes (`states`) and rl.rollouts (`groups`) and the prompt ids started:

    - `each_episode_group_finished_once`: each prompt id is one group on rl.rollouts;
    - `no_turn_twice`: no (prompt id, turn) state is on rl.episodes twice;
    - `turns_in_order`: a prompt's states are turns 1, 2, ... with none missing;
    - `trajectories_extend_their_states`: each state's episodes extend the previous state's
      (token ids, mask, log-probs and turn versions as a prefix), and each finished sample
      extends its last state's (less the truncated episodes a `truncated: drop` worker left out,
      counted in the group's `rejected`): no turn is lost, repeated or re-tokenized in a trained
      trajectory;
    - `masks_align`: every finished sample has one mask entry per token, one version per turn.
    """
    by_prompt: dict[str, list[EpisodeState]] = {}
    for st in states:
        by_prompt.setdefault(st.prompt_id, []).append(st)
    finished = Counter(g.prompt_id for g in groups)
    last = {g.prompt_id: g for g in groups}
    turns = {pid: [st.turn for st in sts] for pid, sts in by_prompt.items()}
    twice = sorted(pid for pid, t in turns.items() if len(t) != len(set(t)))
    gaps = sorted(pid for pid, t in turns.items() if sorted(t) != list(range(1, len(t) + 1)))

    def extends(longer: Any, shorter: Any) -> bool:
        n = len(shorter.token_ids)
        return (longer.token_ids[:n] == shorter.token_ids and list(longer.logprobs[:n]) == list(shorter.logprobs)
                and list(longer.loss_mask or [1] * len(longer.token_ids))[:n] == list(shorter.loss_mask)
                and list(longer.turn_versions or [])[:len(shorter.turn_versions)] == list(shorter.turn_versions))

    broken = []
    for pid, sts in by_prompt.items():
        chain = sorted(sts, key=lambda st: st.turn)
        pairs = list(zip(chain, chain[1:], strict=False))
        ok = all(extends(b, a) for x, y in pairs for a, b in zip(x.episodes, y.episodes, strict=True))
        if pid in last and chain:
            ok = ok and samples_extend(last[pid], chain[-1].episodes, extends)
        if not ok:
            broken.append(pid)
    misaligned = sorted(g.prompt_id for g in groups for smp in g.samples
                        if smp.loss_mask is not None and len(smp.loss_mask) != len(smp.token_ids))
    started = set(prompts)
    checks = {"each_episode_group_finished_once": all(finished.get(p) == 1 for p in started)
                                                  and set(finished) <= started,
              "no_turn_twice": not twice, "turns_in_order": not gaps,
              "trajectories_extend_their_states": not broken, "masks_align": not misaligned}
    return {"ok": all(checks.values()), "checks": checks, "groups": sum(finished.values()),
            "states": sum(len(t) for t in turns.values()),
            "unfinished": sorted(started - set(finished))[:10], "finished_twice": sorted(
                p for p, n in finished.items() if n > 1)[:10],
            "turn_twice": twice[:10], "turn_gaps": gaps[:10], "broken": sorted(broken)[:10]}


def explain(report: dict[str, Any]) -> str:
    """The failed checks of a report with their evidence, for an assertion message."""
    failed = [k for k, v in report["checks"].items() if not v]
    if not failed:
        return "all checks passed"
    keys = ("run_id", "step", "finished", "trained", "trained_twice", "not_published", "lost", "lost_count",
            "published_ids", "dlq_reasons")
    stages = [{k: s[k] for k in ("stage", "duplicated_outputs", "missing_outputs", "examples")}
              for s in report.get("stages", []) if not s["ok"]]
    evidence = {k: report[k] for k in keys if k in report}
    return f"failed: {', '.join(failed)}; {evidence}" + (f"; stages {stages}" if stages else "")

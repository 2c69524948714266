"""Issue 18's acceptance test: bad input never stops the pipeline.

A tiny run (30 steps) under `steadyrl up` is fed poison of every class on every topic a
service reads, while it trains:

- rl.prompts (the rollout worker): bytes that are not UTF-8 JSON, no or a garbage schema
  header, another contract's header, major version 9, a NaN temperature, n_samples 0, a
  negative index, 5000 open brackets, extra_info nested 100 deep, a prompt longer than the
  model's context and one at temperature 1e-45 (the actor answers 422 to both), and prompts
  of a policy version the actor will never serve (held, with the partitions they sit in,
  until their budget is spent: `rollout.max_hold_s` HOLD_S, `max_attempts` 2);
- rl.rollouts (the reward worker): not JSON, a NaN log-prob, a negative token id, a group whose
  scored record cannot fit rl.scored;
- rl.scored (the learner): not JSON, another contract, a NaN reward, another run's group, and,
  keyed by a real prompt in flight, token ids outside the vocabulary and prompt + response
  above the context (128);
- rl.dlq (the learner): seven forged DLQ records keyed by one real prompt in flight (issue 46:
  from no stage of ours, from a stage that does not read the topic named or give the reason --
  a run of scorer_error among them, with learner.scorer_failure_limit 1 -- for another attempt,
  naming none, unreadable), an unreadable one keyed by another, and a valid one keyed by a
  prompt already trained.

It proves that the run still reaches its last step with no service restarted; that each
poison record is on rl.dlq exactly once, with the reason the product promises, written by
the service that read it (matched by topic/partition/offset and key), and the foreign group
on none; that no real record went to rl.dlq; that the prompt the learner refused itself was
published again, and none the forged records named was (nor abandoned, nor did the scorer_error
ones stop the run); that every real prompt was trained exactly once; and that each stage
turned every input it committed into exactly one output or DLQ record.

The real prompts the rl.scored and rl.dlq poison is keyed by are chosen so the race with their
real groups cannot be lost: prompts published behind an unserved prompt, in its partition,
cannot be generated until it leaves (HOLD_S), and the poison goes out well before that.

Not fed: a record above an input topic's record limit (`oversize`): the broker refuses it
before any reader sees it, and every reader's limit is its topic's unless configured lower.

`steadyrl.testing.audit_pipeline` decodes every record of the topics and raises on poison, so
the audit here is its parts (`audit_run`, `stage_audit`) over the records that are not poison.
About 1.5-2 min on the 2-core machine under load (30 s of it the unserved prompts' hold).
"""

from __future__ import annotations

import base64
import json
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from steadyrl.bus.kafka import read_topic
from steadyrl.bus.records import RECORD_FRAMING_BYTES, record_bytes
from steadyrl.bus.topics import load_catalogue
from steadyrl.testing import audit_run, committed_offsets, producer, stage_audit
from steadyrl.testing.audit import STAGE_GROUPS
from steadyrl.wire import codec
from steadyrl.wire.contracts import DLQReason, DLQRecord, Prompt, RolloutGroup, Sample, ScoredGroup
from tests.integration.test_pipeline import Up, _config

STEPS, BATCH = 30, 8
HOLD_S = 30.0                  # rollout.max_hold_s: how long an unserved prompt (and its partition) is held
HELD_PARTITIONS = (0, 1, 2)    # where the unserved prompts go: ~3 prompts of each step land behind them
FORGER = "test_poison/forger"  # the stage name of the DLQ records this test writes itself

log = logging.getLogger(__name__)  # the table and figures, in the test log (pytest -rA, or --log-cli-level=INFO)


@dataclass
class Poison:
    """One record of poison and what must become of it."""

    name: str                 # the class, as the report's table names it
    topic: str                # catalogue name of the topic it is produced to
    key: str
    value: bytes | None
    headers: list | None
    reason: str | None        # the DLQReason its DLQ record must carry; None: no DLQ record about it
    stage: str | None         # the service that must write that record (rollout, reward, learner)
    partition: int | None = None  # set to produce to a given partition; set from the delivery report
    offset: int | None = None
    produced_ms: int = 0


def _header(contract) -> list:
    return [("schema", contract.schema_header().encode())]


def _json(model, **changes) -> bytes:
    """`model` as JSON with top-level fields replaced, written by hand: json.dumps writes a NaN
    as the literal `NaN` (a writer's bug the codec refuses; codec.encode never writes one)."""
    return json.dumps({**model.model_dump(mode="json"), **changes}).encode()


def _prompt(pid: str, **kw) -> Prompt:
    base = {"prompt_id": pid, "epoch": 0, "index": 0, "messages": [{"role": "user", "content": "3"}], "n_samples": 2,
                "data_source": "poison", "ground_truth": "3", "max_new_tokens": 4}
    return Prompt(**{**base, **kw})


def _group(prompt: Prompt, prompt_ids: list[int], responses: list[list[int]]) -> RolloutGroup:
    return RolloutGroup(prompt=prompt, prompt_token_ids=prompt_ids, policy_version=0,
                        samples=[Sample(text="3" * len(r), token_ids=r, logprobs=[-0.5] * len(r)) for r in responses])


def _scored(group: RolloutGroup) -> ScoredGroup:
    return ScoredGroup(group=group, rewards=[0.0] * len(group.samples), reward_source="rule",
                       scorer="rule:tiny_copy@1")


def _prompt_poison(run_id: str) -> list[Poison]:
    """rl.prompts: each refused by the rollout worker, by the codec or by the actor's 422."""
    enc = lambda m: m.model_dump_json().encode()
    p = lambda i, **kw: _prompt(f"poison/p{i}", **kw)
    nested: object = 0
    for _ in range(100):
        nested = [nested]
    rows = [  # (name, value of prompt id poison/p<i>, headers, reason)
        ("undecodable bytes", b"\xff\xfe\x00 not json", _header(Prompt), "undecodable"),
        ("no schema header", enc(p(1)), None, "missing_schema_header"),
        ("garbage schema header", enc(p(2)), [("schema", b"\x00garbage v1")], "missing_schema_header"),
        ("another contract's header", enc(p(3)), _header(ScoredGroup), "wrong_schema"),
        ("major version 9", enc(p(4)), [("schema", b"prompt/v9.0")], "major_version_mismatch"),
        ("NaN temperature", _json(p(5), temperature=float("nan")), _header(Prompt), "non_finite"),
        ("n_samples 0", _json(p(6), n_samples=0), _header(Prompt), "validation_failed"),
        ("negative index", _json(p(7), index=-1), _header(Prompt), "validation_failed"),
        ("[ x5000", b"[" * 5000 + b"]" * 5000, _header(Prompt), "undecodable"),
        ("extra_info nested 100 deep", _json(p(9), extra_info={"deep": nested}), _header(Prompt), "undecodable"),
        # the actor's 422s: over the context (201 + 4 > 128 tokens), non-finite log-probs (logits / 1e-45)
        ("prompt over the context", enc(p(10, messages=[{"role": "user", "content": "3" * 200}])),
         _header(Prompt), "handler_error"),
        ("temperature 1e-45", enc(p(11, temperature=1e-45, run_id=run_id)), _header(Prompt), "non_finite"),
    ]
    return [Poison(name, "rl.prompts", f"poison/p{i}", value, headers, reason, "rollout")
            for i, (name, value, headers, reason) in enumerate(rows)]


def _unserved(run_id: str) -> list[Poison]:
    """Prompts of our run at a version it never reaches: the actor answers 503 (behind) to each try."""
    return [Poison("version the actor never serves", "rl.prompts", f"poison/unserved-{p}",
                   _prompt(f"poison/unserved-{p}", run_id=run_id, min_policy_version=10 ** 9).model_dump_json()
                   .encode(), _header(Prompt), "retries_exhausted", "rollout", partition=p) for p in HELD_PARTITIONS]


def _oversize_rollout() -> bytes:
    """A rollout group that fits rl.rollouts and whose scored group cannot fit rl.scored: 1024
    samples (one reward each makes the scored record >= 4 KiB bigger) and one long response, up
    to 1 KiB below rl.scored's limit."""
    cat = load_catalogue()
    scored_limit = cat["rl.scored"].max_message_bytes - RECORD_FRAMING_BYTES
    key = "poison/r-oversize"
    g = _group(_prompt(key), [4, 5], [[7]] * 1024)
    small = len(codec.encode(g)[0])
    g.samples[0].text = "3" * (scored_limit - 1024 - small - len(key) - 32)
    value, headers = codec.encode(g)
    assert record_bytes(value, key, headers) + RECORD_FRAMING_BYTES <= cat["rl.rollouts"].max_message_bytes
    assert record_bytes(codec.encode(_scored(g))[0], key, headers) > scored_limit  # the least the worker adds
    return value


def _rollout_poison() -> list[Poison]:
    """rl.rollouts: each refused by the reward worker."""
    g = _group(_prompt("poison/r"), [4, 5], [[7, 7], [8, 8]])
    nan_lp, neg_id = g.model_dump(mode="json"), g.model_dump(mode="json")
    nan_lp["samples"][0]["logprobs"][1] = float("nan")
    neg_id["samples"][1]["token_ids"][0] = -1
    return [
        Poison("undecodable bytes", "rl.rollouts", "poison/r-bytes", b"\x80\x81 not json", _header(RolloutGroup),
               "undecodable", "reward"),
        Poison("NaN log-prob", "rl.rollouts", "poison/r-nan", json.dumps(nan_lp).encode(), _header(RolloutGroup),
               "non_finite", "reward"),
        Poison("negative token id", "rl.rollouts", "poison/r-neg", json.dumps(neg_id).encode(),
               _header(RolloutGroup), "validation_failed", "reward"),
        Poison("scored group over rl.scored's limit", "rl.rollouts", "poison/r-oversize", _oversize_rollout(),
               _header(RolloutGroup), "output_oversize", "reward"),
    ]


def _scored_poison() -> list[Poison]:
    """rl.scored, keyed by no prompt of the run: refused by the learner's codec, or skipped (foreign)."""
    sg = _scored(_group(_prompt("poison/s", run_id="r00000000T000000-other"), [4, 5], [[7, 7], [8, 8]]))
    return [
        Poison("undecodable bytes", "rl.scored", "poison/s-bytes", b"\xc3\x28 not json", _header(ScoredGroup),
               "undecodable", "learner"),
        Poison("another contract's record", "rl.scored", "poison/s-prompt", _prompt("poison/s-prompt")
               .model_dump_json().encode(), _header(Prompt), "wrong_schema", "learner"),
        Poison("NaN reward", "rl.scored", "poison/s-nan", _json(sg, rewards=[0.5, float("nan")]),
               _header(ScoredGroup), "non_finite", "learner"),
        Poison("another run's group (foreign)", "rl.scored", "poison/s", sg.model_dump_json().encode(),
               _header(ScoredGroup), None, None),
    ]


def _keyed_by_real(x1, x2, x3, trained) -> list[Poison]:
    """Poison keyed by real prompts, each (its message on rl.prompts, its Prompt): x1..x3 in
    flight (held behind an unserved prompt), `trained` already trained."""
    (_, p1), (m2, p2), (_, p3), (mt, pt) = x1, x2, x3, trained
    vocab = _scored(_group(p1, [4, 5], [[7, 7], [7, 10_000]]))   # the tiny vocabulary has 46 ids
    context = _scored(_group(p1, [5] * 100, [[7] * 40] * 2))     # 100 + 40 tokens > 128

    def forged(m, stage=FORGER, topic="rl.prompts", reason=DLQReason.handler_error, value=None,
               attempt: int | None | str = "held") -> bytes:
        """A DLQ record about the prompt record `m` (by default what a stage that refused it would
        write, but from `stage`); `attempt` the prompt's in `m` unless given."""
        pid = m.key().decode()
        error = (f"prompt {pid}: 2 of 2 items unscored: scorer forged raised ValueError: forged by test_poison"
                 if reason == DLQReason.scorer_error else "forged by test_poison")
        rec = codec.dlq_record(codec.Rejected(reason, error), stage=stage,
                               topic=m.topic().replace("rl.prompts", topic), partition=m.partition(),
                               offset=m.offset(), key=m.key(), value=m.value() if value is None else value)
        if attempt != "held":
            rec.attempt = attempt
        return codec.encode(rec)[0]

    def on_x2(name: str, value: bytes) -> Poison:
        return Poison(f"forged DLQ record: {name}", "rl.dlq", p2.prompt_id, value, _header(DLQRecord), None, None)

    return [
        Poison("token id outside the vocabulary", "rl.scored", p1.prompt_id, vocab.model_dump_json().encode(),
               _header(ScoredGroup), "invalid_tokens", "learner"),
        Poison("prompt + response over the context", "rl.scored", p1.prompt_id, context.model_dump_json().encode(),
               _header(ScoredGroup), "invalid_tokens", "learner"),
        # seven forged records for one prompt in flight (issue 46): none counts as its refusal
        # (first: counted by its key alone, as before issue 46, it stopped the run at once)
        on_x2("scorer_error naming no attempt", forged(m2, stage="reward/reward-0", topic="rl.rollouts",
                                                       reason=DLQReason.scorer_error, value=b"x")),
        on_x2("no stage of ours", forged(m2)),
        on_x2("rollout, of rl.rollouts", forged(m2, stage="rollout/rollout-0", topic="rl.rollouts")),
        on_x2("another attempt", forged(m2, stage="rollout/rollout-0", attempt=3)),
        on_x2("naming no attempt", forged(m2, stage="rollout/rollout-0", value=b"not the prompt")),
        on_x2("scorer_error of another attempt", forged(m2, stage="reward/reward-0", topic="rl.rollouts",
                                                        reason=DLQReason.scorer_error, attempt=1)),
        on_x2("unreadable", b"\xff not a dlq record"),
        Poison("unreadable DLQ record, prompt in flight", "rl.dlq", p3.prompt_id, b"\xff not a dlq record",
               _header(DLQRecord), None, None),
        Poison("valid DLQ record, prompt trained", "rl.dlq", pt.prompt_id, forged(mt), _header(DLQRecord),
               None, None),
    ]


def _produce(bootstrap: str, prefix: str, poison: list[Poison]) -> None:
    """Produce each record (to its partition, if set) and note where it landed."""
    p, errors = producer(bootstrap), []
    for x in poison:
        def landed(err, msg, x=x):
            if err is not None:
                errors.append(f"{x.name}: {err}")
            else:
                x.partition, x.offset = msg.partition(), msg.offset()

        x.produced_ms = int(time.time() * 1000)
        kw = {} if x.partition is None else {"partition": x.partition}
        p.produce(prefix + x.topic, x.value, key=x.key, headers=x.headers, on_delivery=landed, **kw)
        p.poll(0)
    assert p.flush(120) == 0 and not errors, errors


class _Tail:
    """rl.prompts as it is written: every record from the start, decoded where it can be."""

    def __init__(self, bootstrap: str, topic: str):
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

        self.c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"test-poison-tail-{uuid.uuid4().hex}",
                           "isolation.level": "read_committed", "enable.auto.commit": False,
                           "fetch.wait.max.ms": 50})
        parts = self.c.list_topics(topic, timeout=30).topics[topic].partitions
        self.c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        self.records: list = []   # (message, Prompt | None)

    def poll(self) -> None:
        for m in self.c.consume(500, timeout=0.2):
            if m.error() is None:
                try:
                    self.records.append((m, codec.decode(m.value(), m.headers(), Prompt)))
                except codec.Rejected:
                    self.records.append((m, None))

    def close(self) -> None:
        self.c.close()


def _wait_behind(tail: _Tail, behind: dict[int, int], run_id: str, n: int, deadline: float, up: Up) -> list:
    """The first `n` prompts of the run first published behind an unserved prompt (partition ->
    its offset): in flight, and not generated until it leaves."""
    while True:
        tail.poll()
        seen: dict[str, tuple] = {}
        for m, p in tail.records:
            if p is not None and p.prompt_id.startswith(run_id + "/"):
                seen.setdefault(p.prompt_id, (m, p))
        held = [(m, p) for m, p in seen.values() if m.partition() in behind and m.offset() > behind[m.partition()]]
        if len(held) >= n:
            return held[:n]
        assert time.monotonic() < deadline and up.proc.poll() is None, \
            f"only {len(held)} prompts behind the unserved ones before the hold could end; {up.log()[-3000:]}"


def _audit(bootstrap: str, prefix: str, up: Up, poison: list[Poison], dlq: list[DLQRecord]) -> dict:
    """audit_pipeline's checks over the records that are not poison: the learner's (every real
    prompt on rl.prompts trained exactly once, none excused) and each stage's (every input below
    its group's committed offsets -> one output, or one record on rl.dlq; `dlq`: the records the
    services wrote, none of the test's own)."""
    ref = lambda m: (m.topic(), m.partition(), m.offset())
    mine = {(prefix + x.topic, x.partition, x.offset) for x in poison}
    raw, decoded = {}, {}
    for t, contract in (("rl.prompts", Prompt), ("rl.rollouts", RolloutGroup), ("rl.scored", ScoredGroup)):
        raw[t] = read_topic(bootstrap, prefix + t, "test-poison-audit")
        decoded[t] = {ref(m): codec.decode(m.value(), m.headers(), contract) for m in raw[t] if ref(m) not in mine}
    report = audit_run(up.run(), STEPS, BATCH, published=[p.prompt_id for p in decoded["rl.prompts"].values()])
    p_key = lambda p: (p.prompt_id, p.created_ms, p.seed)  # one publish of a prompt (as audit_pipeline)
    g_key = lambda g: (*p_key(g.prompt), g.generated_ms)   # one rollout group
    dlq_refs = {(d.topic, d.partition, d.offset) for d in dlq}
    stages = []
    for name, src, dst, in_key, out_key in (
            ("rollout", "rl.prompts", "rl.rollouts", p_key, lambda g: p_key(g.prompt)),
            ("reward", "rl.rollouts", "rl.scored", g_key, lambda s: g_key(s.group))):
        committed = committed_offsets(bootstrap, STAGE_GROUPS[name], prefix + src, range(8))
        stages.append(stage_audit(name, raw[src], lambda m, k=in_key, t=src: k(decoded[t][ref(m)]),
                                  list(decoded[dst].values()), out_key, committed, dlq_refs))
        report["checks"][f"{name}_stage_exactly_once"] = stages[-1]["ok"]
    return {**report, "stages": stages, "ok": all(report["checks"].values())}


@pytest.mark.timeout(900)
def test_poison_on_every_topic_never_stops_the_pipeline(bootstrap, tmp_path: Path):
    config = _config(tmp_path, steps=STEPS, eval_data=None)
    cfg = yaml.safe_load(config.read_text())
    cfg["rollout"] = {"max_hold_s": HOLD_S, "max_attempts": 2}
    # one counted scorer_error stops the run; two counted refusals abandon a prompt (issue 46)
    cfg["learner"].update(scorer_failure_limit=1, prompt_max_refusals=2, prompt_min_refusal_s=0)
    config.write_text(yaml.safe_dump(cfg))
    up = Up(bootstrap, tmp_path, config)
    t_start = time.monotonic()
    tail = None
    try:
        up.wait_step(2, timeout_s=300)
        run_id = up.progress()["run_id"]
        tail = _Tail(bootstrap, f"{up.prefix}rl.prompts")
        unserved = _unserved(run_id)
        _produce(bootstrap, up.prefix, unserved)
        t_hold = time.monotonic()
        others = _prompt_poison(run_id) + _rollout_poison() + _scored_poison()
        _produce(bootstrap, up.prefix, others)
        # Real prompts first published behind the unserved ones are in flight and cannot be
        # generated before those leave (HOLD_S): poison keyed by them cannot lose the race.
        x1, x2, x3 = _wait_behind(tail, {x.partition: x.offset for x in unserved}, run_id, 3,
                                  t_hold + HOLD_S - 8, up)
        trained_id = up.run().consumed()[0]["prompt_id"]
        trained = next((m, p) for m, p in tail.records if p is not None and p.prompt_id == trained_id)
        keyed = _keyed_by_real(x1, x2, x3, trained)
        _produce(bootstrap, up.prefix, keyed)
        lead_s = t_hold + HOLD_S - time.monotonic()
        assert lead_s > 3, "the poison keyed by held prompts went out too late"
        log.info("poison keyed by held prompts out %.1f s after the unserved ones (%.1f s before they can leave)",
                 HOLD_S - lead_s, lead_s)
        rc = up.wait(600)
    finally:
        if tail is not None:
            tail.close()
        up.close()
    wall_s = time.monotonic() - t_start
    poison = unserved + others + keyed
    out = up.log()

    # the run reached its last step, and nothing restarted (steadyrl/local/supervisor.py's wording)
    assert rc == 0, out[-4000:]
    run = up.run()
    assert len(run.summary()["reward_per_step"]) == STEPS
    assert "exited with" not in out and "restart #" not in out, [ln for ln in out.splitlines() if "exit" in ln]

    # each poison record on rl.dlq exactly once, with its reason, written by the service that read
    # it, keeping its key; the foreign group and what the test wrote to rl.dlq itself on none
    written = {(x.partition, x.offset) for x in poison if x.topic == "rl.dlq"}
    dlq = [codec.decode(m.value(), m.headers(), DLQRecord)
           for m in read_topic(bootstrap, f"{up.prefix}rl.dlq", "test-poison-dlq")
           if (m.partition(), m.offset()) not in written]
    about: dict[tuple, list[DLQRecord]] = {}
    for d in dlq:
        about.setdefault((d.topic.removeprefix(up.prefix), d.partition, d.offset), []).append(d)
    observed = [[(d.reason.value, d.stage.split("/")[0], base64.b64decode(d.key_b64 or "").decode())
                 for d in about.get((x.topic, x.partition, x.offset), [])] for x in poison]
    expected = [[(x.reason, x.stage, x.key)] if x.reason else [] for x in poison]
    table = "\n".join(f"{x.topic:11} {x.name:40} {[o[:2] for o in obs]}"
                      for x, obs in zip(poison, observed, strict=True))
    log.info("poison -> rl.dlq (reason, stage):\n%s", table)
    assert observed == expected, table
    ours = {(x.topic, x.partition, x.offset) for x in poison}
    strays = [d for d in dlq if (d.topic.removeprefix(up.prefix), d.partition, d.offset) not in ours]
    assert not strays, [(d.stage, d.reason.value, d.topic, d.error[:200]) for d in strays]

    # the unserved prompts left only once their budget was spent (HOLD_S since their first try)
    for x in unserved:
        (d,) = about[(x.topic, x.partition, x.offset)]
        assert d.rejected_ms - x.produced_ms >= HOLD_S * 1000, (d.rejected_ms - x.produced_ms, d.error)
        assert "version >= 1000000000" in d.error, d.error

    # the prompt the learner refused itself (invalid_tokens) went out again after it; those only
    # forged records named (x2: seven, x3: one) and the trained one did not, and none was
    # abandoned; the learner counted what it skipped, refused and ignored
    since = {x.key: x.produced_ms for x in keyed}
    again = Counter()
    for m in read_topic(bootstrap, f"{up.prefix}rl.prompts", "test-poison-prompts"):
        try:
            p = codec.decode(m.value(), m.headers(), Prompt)
        except codec.Rejected:
            continue
        if p.prompt_id in since and p.created_ms > since[p.prompt_id]:
            again[p.prompt_id] += 1
    forged_only = [x2[1].prompt_id, x3[1].prompt_id]
    assert again[x1[1].prompt_id] >= 1 and again[trained_id] == 0, (again, trained_id)
    assert all(again[pid] == 0 for pid in forged_only), (again, forged_only)
    counts = run.counts
    assert counts["foreign"] == 1 and counts["rejected"] == 5 and counts["dlq"] == 1, counts
    assert counts["dlq_ignored"] >= 8 and counts["abandoned"] == 0, counts

    # every real prompt trained exactly once; every stage exactly once around the poison
    report = _audit(bootstrap, up.prefix, up, poison, dlq)
    assert report["ok"], {k: report.get(k) for k in ("checks", "trained_twice", "lost", "lost_count", "stages")}
    log.info("wall %.0f s; %d records on rl.dlq by the services %s; trained %d of %d published ids (%d publish "
             "records); counts %s", wall_s, len(dlq), dict(Counter(d.reason.value for d in dlq)), report["trained"],
             report["published_ids"], report["publish_records"], counts.as_dict())

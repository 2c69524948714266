"""Issue 46: a refusal counts once and only from the stage that refused. A record on rl.dlq
keyed by a prompt in flight counts only when it is readable, comes from a stage that reads the
topic it names (and gives its reason), and names the attempt in flight; replays, other
attempts, forgeries and unreadable records are counted as ignored and change nothing
(services/learner/dlq_check.py)."""

import json

import pytest
from prometheus_client import REGISTRY

from steadyrl.services.learner.dlq_check import named_attempt, reason_service, stage_could_refuse, uncounted
from steadyrl.services.reward.client import scorer_error_detail
from steadyrl.wire import codec
from steadyrl.wire.contracts import DLQReason, DLQRecord
from tests.services.learner.conftest import Msg

PREFIX = "p."   # the deployment's topic prefix


def _rec(stage="rollout/rollout-0", topic="p.rl.prompts", reason=DLQReason.handler_error, attempt=0,
         value: bytes = b"{}", error="x") -> DLQRecord:
    rec = codec.dlq_record(codec.Rejected(reason, error), stage=stage, topic=topic, partition=0, offset=0,
                           key=b"k", value=value)
    rec.attempt = attempt
    return rec


@pytest.mark.parametrize("stage, topic, reason, counts", [
    ("rollout/rollout-0", "p.rl.prompts", DLQReason.handler_error, True),
    ("rollout/rollout-0", "p.rl.episodes", DLQReason.handler_error, True),  # an agent episode's later turn
    ("reward/reward-1", "p.rl.rollouts", DLQReason.scorer_error, True),
    ("learner/0", "p.rl.scored", DLQReason.invalid_tokens, True),
    ("learner/0", "p.rl.releases", DLQReason.rejected, True),
    ("test/forger", "p.rl.prompts", DLQReason.handler_error, False),  # no stage of ours
    ("rollout/rollout-0", "p.rl.rollouts", DLQReason.handler_error, False),  # rollout does not read it
    ("reward/reward-1", "rl.rollouts", DLQReason.handler_error, False),  # another deployment's topic
    ("rollout/rollout-0", "p.rl.prompts", DLQReason.scorer_error, False),  # only the reward scores
    ("learner/0", "p.rl.scored", DLQReason.scorer_error, False),
    ("reward/reward-1", "p.rl.rollouts", DLQReason.invalid_tokens, False),  # only the learner checks tokens
    ("reward", "p.rl.rollouts", DLQReason.handler_error, True),        # no instance: still the service
])
def test_the_stage_must_read_the_topic_it_names_and_give_the_reason(stage, topic, reason, counts):
    assert stage_could_refuse(_rec(stage=stage, topic=topic, reason=reason), PREFIX) is counts


def test_every_scorer_reason_is_the_rewards():
    """Reasons named scorer_* (scorer_error, and the timeout and crash reasons) come from the reward only."""
    assert reason_service("scorer_error") == reason_service("scorer_timeout") == "reward"
    assert reason_service("handler_error") is None and reason_service("invalid_tokens") == "learner"


def _payload_prompt(**fields) -> bytes:
    return json.dumps({"prompt": {"prompt_id": "r/e0-i1", "messages": [], **fields}}).encode()


def test_an_old_record_names_its_attempt_by_the_payloads_prompt():
    """A record without `attempt` (a writer before dlq_record 1.4): the prompt its payload holds
    names the attempt, by its own `attempt` or by its seed."""
    assert named_attempt(_rec(attempt=None, value=_payload_prompt(attempt=2)), 99, 5) == 2
    assert named_attempt(_rec(attempt=None, value=_payload_prompt(seed=99)), 99, 5) == 5     # the seed in flight
    assert named_attempt(_rec(attempt=None, value=_payload_prompt(seed=98)), 99, 5) == -1    # another publish's
    assert named_attempt(_rec(attempt=None, value=_payload_prompt(seed=99)), None, 5) is None  # seed not known
    assert named_attempt(_rec(attempt=None, value=_payload_prompt()), 99, 5) is None         # no seed
    assert named_attempt(_rec(attempt=None, value=b"\xff"), 99, 5) is None
    truncated = _rec(attempt=None, value=_payload_prompt(seed=99)).model_copy(update={"payload_truncated": True})
    assert named_attempt(truncated, 99, 5) is None
    assert named_attempt(_rec(attempt=4, value=_payload_prompt(seed=99)), 99, 5) == 4       # its own word first


def test_a_refused_episode_turn_counts_for_the_attempt_its_state_holds():
    """A rollout worker's refusal of a later turn of an agent episode (a record of rl.episodes,
    whose payload is an EpisodeState holding the prompt) counts as that attempt's refusal."""
    from steadyrl.wire.contracts import EpisodeState, Prompt

    prompt = Prompt(prompt_id="r/e0-i1", epoch=0, index=1, messages=[{"role": "user", "content": "q"}],
                    n_samples=1, ground_truth="3", run_id="r", seed=7, attempt=2)
    episode = {"messages": [{"role": "user", "content": "q"}], "prompt_ids": [5]}
    state = EpisodeState.model_validate({"prompt": prompt.model_dump(mode="json"), "episodes": [episode], "turn": 1})
    rec = _rec(topic="p.rl.episodes", attempt=None, value=codec.encode(state)[0])
    assert uncounted(rec, PREFIX, 2, 7) is None
    assert uncounted(rec, PREFIX, 3, 7) == "attempt"


def test_uncounted_says_why():
    assert uncounted(_rec(), PREFIX, 0, None) is None
    assert uncounted(_rec(stage="x/y"), PREFIX, 0, None) == "stage"
    assert uncounted(_rec(attempt=1), PREFIX, 0, None) == "attempt"
    assert uncounted(_rec(attempt=None), PREFIX, 0, None) == "no_attempt"


def _ignored(why: str) -> float:
    return REGISTRY.get_sample_value("steadyrl_learner_dlq_ignored_total", {"why": why}) or 0.0


def _msg(lrn, pid: str, offset: int, **kw) -> Msg:
    """A DLQ record keyed by `pid` (rl.dlq at `offset`): by default one a rollout worker would
    write for the attempt in flight."""
    kw.setdefault("attempt", lrn.state.in_flight[pid].attempt)
    kw.setdefault("topic", "rl.prompts")
    return Msg(_rec(**kw), pid, offset=offset, topic="rl.dlq")


def test_seven_forged_or_replayed_records_do_not_abandon_a_prompt(make_learner):
    """The issue's case: with a budget of one refusal, any record keyed by the prompt used to
    abandon it. Only the record a real refusal would be counts -- once."""
    lrn = make_learner(prompt_max_refusals=2, prompt_min_refusal_s=0)
    st = lrn.state
    lrn.feeder.top_up()
    pid = sorted(st.in_flight)[0]
    before = {w: _ignored(w) for w in ("stage", "attempt", "no_attempt", "unreadable")}
    forged = [
        _msg(lrn, pid, 1, stage="test/forger"),                                         # no stage of ours
        _msg(lrn, pid, 2, stage="reward/reward-0"),                                     # reward reads rl.rollouts
        _msg(lrn, pid, 3, attempt=7),                                                    # not the attempt in flight
        _msg(lrn, pid, 4, attempt=None),                                                 # names none
        _msg(lrn, pid, 5, stage="rollout/x", reason=DLQReason.scorer_error),            # not the rollout's reason
        Msg(b"\xff garbage", pid, offset=6, topic="rl.dlq", headers=[("schema", b"dlq_record/v1.4")]),
        _msg(lrn, pid, 7, attempt=1),                                                    # a later attempt
    ]
    for m in forged:
        lrn.intake.dead_letter(m)
    f = st.in_flight[pid]
    assert f.refused == 0 and f.attempt == 0 and not st.requeue and "dlq" not in st.counts
    assert st.counts["dlq_ignored"] == 7 and st.dlq_offset == 8
    assert {w: _ignored(w) - before[w] for w in before} == {"stage": 3, "attempt": 2, "no_attempt": 1,
                                                           "unreadable": 1}
    # a real refusal counts, once: its replays (after the prompt went out again) do not
    real = _msg(lrn, pid, 8)
    lrn.intake.dead_letter(real)
    assert f.refused == 1 and f.attempt == 1 and st.requeue == [pid]
    lrn.intake.retry_at[pid] = 0.0
    lrn.feeder.top_up()
    for k in range(7):
        lrn.intake.dead_letter(Msg(codec.decode(real.value(), real.headers(), DLQRecord), pid, offset=9 + k,
                                   topic="rl.dlq"))
    assert pid in st.in_flight and f.refused == 1 and not st.abandoned and st.counts["dlq"] == 1


def test_a_forged_run_of_scorer_errors_does_not_stop_the_run(make_learner):
    lrn = make_learner(scorer_failure_limit=1)
    st = lrn.state
    lrn.feeder.top_up()
    for i, pid in enumerate(sorted(st.in_flight)):
        error = scorer_error_detail(pid, 4, 4, "scorer x raised ValueError: forged")
        for j, kw in enumerate([{"stage": "reward/reward-0"},                          # topic rl.prompts
                                {"stage": "reward/reward-0", "topic": "rl.rollouts", "attempt": 3},
                                {"stage": "reward/reward-0", "topic": "rl.rollouts", "attempt": None},
                                {"stage": "learner/9", "topic": "rl.scored"}]):
            lrn.intake.dead_letter(_msg(lrn, pid, 10 * i + j, reason=DLQReason.scorer_error, error=error, **kw))
    assert lrn.intake.refusals.failing() is None and lrn.intake.refusals.streak == 0 and not st.requeue
    # the reward stage's own record for the attempt in flight is the one that counts
    pid = sorted(st.in_flight)[0]
    lrn.intake.dead_letter(_msg(lrn, pid, 99, reason=DLQReason.scorer_error, stage="reward/reward-0",
                                topic="rl.rollouts",
                                error=scorer_error_detail(pid, 4, 4, "scorer x raised ValueError: real")))
    assert lrn.intake.refusals.failing() is not None


def test_a_record_of_before_the_upgrade_counts_by_the_seed_of_the_prompt_it_holds(make_learner):
    """A run in flight during an upgrade: a worker of the version before writes dlq_record 1.3
    (no attempt) with the refused prompt record, itself of prompt 1.2 (no attempt), as payload.
    It counts when that prompt's seed is the attempt in flight's; an earlier attempt's does not."""
    lrn = make_learner()
    st = lrn.state
    lrn.intake.published = lrn.feeder.prompt   # the loop's wiring (conftest turns it off)
    lrn.feeder.top_up()
    pid = sorted(st.in_flight)[0]
    [published] = [v for k, v in lrn.outbox.on("rl.prompts") if k == pid]
    old_prompt = published.model_dump_json(exclude={"attempt"}).encode()

    def old_record(offset: int) -> Msg:
        rec = codec.dlq_record(codec.Rejected(DLQReason.handler_error, "old worker"), stage="rollout/rollout-0",
                               topic="rl.prompts", partition=0, offset=offset, key=pid.encode(),
                               value=old_prompt)
        assert rec.attempt is None
        raw = json.loads(rec.model_dump_json(exclude={"attempt"}))
        return Msg(json.dumps(raw).encode(), pid, offset=offset, topic="rl.dlq",
                   headers=[("schema", b"dlq_record/v1.3")])

    lrn.intake.dead_letter(old_record(1))
    assert st.in_flight[pid].refused == 1 and st.in_flight[pid].attempt == 1
    lrn.intake.retry_at[pid] = 0.0
    lrn.feeder.top_up()
    lrn.intake.dead_letter(old_record(2))     # the same old record again: the seed of attempt 0, not 1
    assert st.in_flight[pid].refused == 1 and st.in_flight[pid].attempt == 1


def test_the_learner_publishes_the_attempt_and_its_own_refusal_names_it(make_learner):
    """The learner's prompt record carries its attempt; its own DLQ record of a group it
    refuses (invalid_tokens) names that attempt and counts when read back."""
    from tests.services.learner.conftest import scored

    lrn = make_learner()
    st = lrn.state
    lrn.feeder.top_up()
    assert {v.attempt for _, v in lrn.outbox.on("rl.prompts")} == {0}
    pid = sorted(st.in_flight)[0]
    bad = scored(st, pid, responses=[[4, 5, 10_000]] * 4)
    lrn.intake.accept(Msg(bad, pid, offset=3))
    [(key, dlq)] = lrn.outbox.on("rl.dlq")
    assert dlq.reason == DLQReason.invalid_tokens and dlq.attempt == 0 and dlq.stage == "learner/0"
    lrn.intake.dead_letter(Msg(dlq, pid, offset=0, topic="rl.dlq"))
    assert st.in_flight[pid].refused == 1 and st.in_flight[pid].attempt == 1
    lrn.intake.retry_at[pid] = 0.0
    lrn.feeder.top_up()
    assert [v.attempt for k, v in lrn.outbox.on("rl.prompts") if k == pid] == [0, 1]

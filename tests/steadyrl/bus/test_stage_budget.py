"""The stage's budget of held records and its checks of outputs, on the transform alone (no
broker: a stand-in consumer, fake messages). The same rules against a real broker:
tests/integration/test_stage_budget.py."""

import math

import pytest

from steadyrl.bus.stage import RECORD_FRAMING_BYTES, Output, RetryLater, Stage, record_bytes
from steadyrl.wire import codec
from steadyrl.wire.contracts import DLQReason, DLQRecord, RewardSource, RolloutGroup, ScoredGroup
from tests.helpers import rollout_group

TOPIC = "unit.rl.rollouts"


class _Msg:
    """A consumed record as the stage sees it."""

    def __init__(self, partition: int, offset: int, group: RolloutGroup):
        self._p, self._o, self.group = partition, offset, group
        self._value, self._headers = codec.encode(group)

    def topic(self):
        return TOPIC

    def partition(self):
        return self._p

    def offset(self):
        return self._o

    def key(self):
        return self.group.prompt_id.encode()

    def timestamp(self):
        return (1, 0)

    def value(self):
        return self._value

    def headers(self):
        return self._headers

    def error(self):
        return None


class _Consumer:
    def close(self):
        pass


def _msgs(*names: str, partition: int = 0) -> list[_Msg]:
    out = []
    for i, name in enumerate(names):
        g = rollout_group(i)
        g.prompt.prompt_id = name
        out.append(_Msg(partition, i, g))
    return out


def _scored(g: RolloutGroup, text: str | None = None) -> ScoredGroup:
    if text is not None:
        g = g.model_copy(deep=True)
        g.samples[0].text = text
    return ScoredGroup(group=g, rewards=[1.0], reward_source=RewardSource.rule, scorer="rule:test@1")


class Dependency:
    """A batch handler in front of a dependency: `failing` prompt ids get `why` (a RetryLater
    returned, or raised when `raise_it`); `down` fails every record. Records every call."""

    def __init__(self, why=None, failing=(), down=False):
        self.why, self.failing, self.down = why or RetryLater("answered 500", 0.0, counts=True), set(failing), down
        self.calls: list[list[str]] = []

    def __call__(self, items):
        self.calls.append([g.prompt_id for g, _ in items])
        return [self.why if self.down or g.prompt_id in self.failing else [Output("rl.scored", g.prompt_id, _scored(g))]
                for g, _ in items]


@pytest.fixture
def make_stage():
    made = []

    def make(handle_batch, **kw):
        st = Stage(name="budget-unit", bootstrap="127.0.0.1:1", topic_prefix="unit.", instance_id="w0",
                   input_topic="rl.rollouts", input_contract=RolloutGroup, group_id="g", handle_batch=handle_batch,
                   **kw)
        st.consumer.close()  # never connected (nothing listens on port 1)
        st.consumer = _Consumer()
        made.append(st)
        return st

    yield make
    for st in made:
        st.close()


def _dlq(batch) -> dict[str, DLQRecord]:
    return {p.key.decode(): codec.decode(p.value, p.headers, DLQRecord) for p in batch.pending
            if p.topic == "unit.rl.dlq"}


def _out(batch) -> list[str]:
    return sorted(p.key for p in batch.pending if p.topic == "unit.rl.scored" and not batch.is_held(p.source, p.offset))


def test_a_record_failing_while_others_are_done_goes_to_the_dlq_alone_once_its_budget_is_spent(make_stage):
    dep = Dependency(failing={"poison"})
    st = make_stage(dep, max_hold_s=0, max_attempts=2)
    msgs = _msgs("a", "poison", "b")
    for _ in range(2):  # tries 1 and 2 count; the budget is spent after the second
        batch = st._transform(msgs)
        assert _dlq(batch) == {} and batch.held[(TOPIC, 0)].offset == 1 and _out(batch) == ["a"]
    assert dep.calls == [["a", "poison", "b"]] * 2
    batch = st._transform(msgs)  # spent: tried alone, fails again while a and b are done
    assert dep.calls[-2:] == [["a", "b"], ["poison"]]
    [(key, rec)] = _dlq(batch).items()
    assert key == "poison" and rec.reason is DLQReason.retries_exhausted and rec.offset == 1
    assert rec.error.startswith("failed 3 tries over 0 s while other records were done; last error: answered 500")
    assert batch.held == {} and _out(batch) == ["a", "b"]  # the partition moves on


def test_nothing_is_dropped_while_no_record_is_done_then_all_come_out(make_stage):
    """Every record fails (the actor is behind for every prompt, say): the budgets are spent,
    each record is tried alone, and none goes to the DLQ without another record done."""
    dep = Dependency(down=True)
    st = make_stage(dep, max_hold_s=0, max_attempts=1)
    msgs = _msgs("a", "b") + _msgs("c", partition=1)
    for _ in range(5):
        batch = st._transform(msgs)
        assert _dlq(batch) == {} and set(batch.held) == {(TOPIC, 0), (TOPIC, 1)}
    assert dep.calls[-3:] == [["a"], ["b"], ["c"]]  # spent: alone
    assert len(st.budgets._budgets) == 3
    dep.down = False
    batch = st._transform(msgs)
    assert _dlq(batch) == {} and batch.held == {} and _out(batch) == ["a", "b", "c"]
    assert st.budgets._budgets == {}


def test_a_dependency_that_does_not_answer_spends_no_budget(make_stage):
    dep = Dependency(why=RetryLater("actor unreachable", 0.0), failing={"b"})
    st = make_stage(dep, max_hold_s=0, max_attempts=1)
    for _ in range(5):
        batch = st._transform(_msgs("a", "b"))
        assert _dlq(batch) == {} and batch.held[(TOPIC, 0)].offset == 1
    assert st.budgets._budgets == {} and dep.calls == [["a", "b"]] * 5  # never tried alone


def test_both_limits_must_be_spent(make_stage):
    dep = Dependency(failing={"poison"})
    st = make_stage(dep, max_hold_s=3600, max_attempts=1)
    for _ in range(20):
        assert _dlq(st._transform(_msgs("a", "poison"))) == {}
    st.budgets.max_hold_s, st.budgets.max_attempts = 0, 50
    for _ in range(20):
        assert _dlq(st._transform(_msgs("a", "poison"))) == {}
    st.budgets.max_attempts = 1
    assert _dlq(st._transform(_msgs("a", "poison")))["poison"].reason is DLQReason.retries_exhausted


def test_an_own_failure_is_tried_alone_at_once_and_needs_no_other_record_done(make_stage):
    """RetryLater(own=True): the handler saw the dependency serve other work. Its batch mates
    are freed at the next try (each alone), and the failing one is dropped once spent even
    with nothing else in flight."""
    dep = Dependency(why=RetryLater("answered 500; the server scores other items", 0.0, own=True), down=True)
    st = make_stage(dep, max_hold_s=0, max_attempts=3)
    msgs = _msgs("a", "poison", "b")
    st._transform(msgs)  # the whole batch failed
    dep.down, dep.failing = False, {"poison"}
    batch = st._transform(msgs)
    assert dep.calls[1:] == [["a"], ["poison"], ["b"]] and _out(batch) == ["a"]
    batch = st._transform(msgs[1:2])  # a and b committed: poison is all that is left
    assert _dlq(batch)["poison"].reason is DLQReason.retries_exhausted
    assert "while the dependency served other work" in _dlq(batch)["poison"].error


def test_a_raised_retry_later_holds_every_record_of_the_call(make_stage):
    def handler(items):
        raise RetryLater("reward server answered 500", 0.0, counts=True)

    st = make_stage(handler, max_hold_s=3600)
    batch = st._transform(_msgs("a", "b") + _msgs("c", partition=1))
    assert batch.pending == [] and {tp: h.offset for tp, h in batch.held.items()} == {(TOPIC, 0): 0, (TOPIC, 1): 0}
    assert all(b.attempts == 1 for b in st.budgets._budgets.values()) and len(st.budgets._budgets) == 3


def test_a_solo_try_that_finds_the_dependency_down_spares_the_rest(make_stage):
    dep = Dependency(down=True)
    st = make_stage(dep, max_hold_s=0, max_attempts=1)
    msgs = _msgs("a", "b", "c")
    st._transform(msgs)
    dep.why = RetryLater("unreachable", 0.0)  # now it does not answer at all
    st._transform(msgs)
    assert dep.calls[1:] == [["a"]]  # b and c are held with a's answer, untried


def test_budgets_go_when_committed_past_or_the_partition_is_revoked(make_stage):
    from confluent_kafka import TopicPartition

    st = make_stage(Dependency(down=True), max_hold_s=0)
    st._transform(_msgs("a", "b") + _msgs("c", partition=1))
    st.budgets.forget_committed([TopicPartition(TOPIC, 0, 1)])
    assert sorted(st.budgets._budgets) == [(TOPIC, 0, 1), (TOPIC, 1, 0)]
    st._on_revoke(None, [TopicPartition(TOPIC, 1)])
    assert sorted(st.budgets._budgets) == [(TOPIC, 0, 1)]


def test_outputs_above_their_topic_limit_or_that_cannot_be_encoded_go_to_the_dlq_before_produce(make_stage):
    limit = 8388608  # rl.scored, schemas/topics.yaml
    g0 = rollout_group(0)
    value, headers = codec.encode(_scored(g0, ""))
    base = record_bytes(value, "fits", headers)
    fits = "x" * (limit - RECORD_FRAMING_BYTES - base)
    big = fits + "x"

    def handler(items):
        out = []
        for g, _ in items:
            pid = g.prompt.prompt_id
            if pid == "fits":  # exactly the largest record the topic takes
                out.append([Output("rl.scored", pid, _scored(g0, fits))])
            elif pid == "big":  # one byte more
                out.append([Output("rl.scored", f"{pid}-a", _scored(g)), Output("rl.scored", "bigx", _scored(g0, big))])
            elif pid == "not-a-contract":
                out.append([Output("rl.scored", pid, object())])
            elif pid == "nan":
                out.append([Output("rl.scored", pid, _scored(g).model_copy(update={"rewards": [math.nan]}))])
            elif pid == "garbage":
                out.append("not a list")
            else:
                out.append([Output("rl.scored", pid, _scored(g))])
        return out

    st = make_stage(handler)
    msgs = _msgs("ok-1", "fits", "big", "not-a-contract", "nan", "garbage", "ok-2")
    batch = st._transform(msgs)
    assert _out(batch) == ["fits", "ok-1", "ok-2"]  # none of big's outputs goes, the rest of the batch does
    dlq = _dlq(batch)
    assert {k: r.reason for k, r in dlq.items()} == {
        "big": DLQReason.output_oversize, "not-a-contract": DLQReason.handler_error, "nan": DLQReason.non_finite,
        "garbage": DLQReason.handler_error}
    size = base + len(big) - len("fits") + len("bigx")
    assert dlq["big"].error == (f"an output to rl.scored is {size} bytes (value, key and headers); the topic takes "
                                f"at most {limit - RECORD_FRAMING_BYTES} (max.message.bytes {limit} less "
                                f"{RECORD_FRAMING_BYTES} of framing)")
    assert dlq["big"].payload_size == len(msgs[2].value())  # the input record, as always
    assert "AttributeError" in dlq["not-a-contract"].error
    assert "cannot be encoded: ValueError" in dlq["nan"].error and "non-finite" in dlq["nan"].error  # the codec's
    assert "not a list of Output" in dlq["garbage"].error
    assert dlq["big"].schema_seen == codec.header_value(msgs[2].headers())


def test_a_refusal_naming_a_non_finite_value_is_non_finite():
    """Regression: pydantic's own wording ("Input should be a finite number", raised where a
    handler builds a contract from NaN) was filed as handler_error."""
    from steadyrl.bus.records import refusal_reason

    for detail in ("Input should be a finite number", "log-probs not finite", "reward nan", "non-finite grad"):
        assert refusal_reason(detail) is DLQReason.non_finite, detail
    assert refusal_reason("actor answered 409: an earlier run") is DLQReason.handler_error

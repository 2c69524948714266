"""No record is held forever, no output stops a stage: the budget of held records and the
checks of outputs (steadyrl.bus.stage), against the real broker. The same rules on the
transform alone: tests/steadyrl/bus/test_stage_budget.py."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
from prometheus_client import REGISTRY

from steadyrl.bus.stage import RECORD_FRAMING_BYTES, Output, RetryLater, Stage, record_bytes
from steadyrl.bus.topics import load_catalogue
from steadyrl.wire import codec
from steadyrl.wire.contracts import DLQReason, DLQRecord, RewardSource, RolloutGroup, ScoredGroup
from tests.helpers import decode_all, read_all, rollout_group


def _group(pid: str) -> RolloutGroup:
    g = rollout_group(0)
    g.prompt.prompt_id = pid
    return g


def _produce(bootstrap: str, topic: str, by_partition: dict[int, list[str]]) -> None:
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for part, pids in by_partition.items():
        for pid in pids:
            value, headers = codec.encode(_group(pid))
            p.produce(topic, value, key=pid, headers=headers, partition=part)
    assert p.flush(30) == 0


def _scored(g: RolloutGroup, text: str | None = None) -> ScoredGroup:
    if text is not None:
        g = g.model_copy(deep=True)
        g.samples[0].text = text
    return ScoredGroup(group=g, rewards=[1.0], reward_source=RewardSource.rule, scorer="rule:test@1")


class Running:
    """A Stage on a thread of this process, from rl.rollouts to rl.scored."""

    def __init__(self, bootstrap: str, prefix: str, name: str, handle_batch, **kw):
        self.name = name
        self.stage = Stage(name=name, bootstrap=bootstrap, topic_prefix=prefix, instance_id=prefix.rstrip("."),
                           input_topic="rl.rollouts", input_contract=RolloutGroup, group_id=f"{prefix}{name}",
                           handle_batch=handle_batch, **kw)
        self.stop_ = threading.Event()
        self.failure: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, name=name)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.stage.run(self.stop_)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            self.failure.append(e)

    def metric(self, name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, {"stage": self.name, **labels}) or 0.0

    def stop(self) -> None:
        self.stop_.set()
        self.thread.join(60)
        assert not self.thread.is_alive() and not self.failure, self.failure


def test_a_record_failing_while_others_pass_reaches_the_dlq_once_and_its_partition_moves_on(bootstrap, prefix):
    calls: list[list[str]] = []

    def handle(items):  # "poison" fails every try, as a reward server's 500 on one batch
        calls.append([g.prompt_id for g, _ in items])
        return [RetryLater("reward server answered 500: boom", 0.1, counts=True) if g.prompt_id == "poison"
                else [Output("rl.scored", g.prompt_id, _scored(g))] for g, _ in items]

    _produce(bootstrap, f"{prefix}rl.rollouts", {0: ["a0", "poison", "a1", "a2"], 1: ["b0", "b1"]})
    run = Running(bootstrap, prefix, "budget-poison", handle, max_hold_s=1.0, max_attempts=3)
    try:
        scored = decode_all(read_all(bootstrap, f"{prefix}rl.scored", expect=5, timeout_s=60), ScoredGroup)
        dlq_msgs = read_all(bootstrap, f"{prefix}rl.dlq", expect=1, timeout_s=30, settle_s=3)
    finally:
        run.stop()
    ids = Counter(s.prompt_id for s in scored)
    assert ids == Counter(["a0", "a1", "a2", "b0", "b1"]), ids  # each once; a1, a2 came after poison
    [rec] = decode_all(dlq_msgs, DLQRecord)
    assert dlq_msgs[0].key() == b"poison" and rec.reason is DLQReason.retries_exhausted
    assert rec.topic == f"{prefix}rl.rollouts" and rec.partition == 0 and rec.offset == 1
    assert rec.error.startswith("failed ") and "while other records were done" in rec.error
    assert rec.error.endswith("last error: reward server answered 500: boom")
    assert [c for c in calls if "poison" in c][-1] == ["poison"]  # dropped after failing alone
    assert run.metric("steadyrl_stage_dlq_records_total", reason="retries_exhausted") == 1
    assert run.metric("steadyrl_stage_retrying_records") == 0


@pytest.mark.parametrize("counts", [True, False], ids=["answers-503-for-all", "unreachable"])
def test_a_dependency_down_for_everything_holds_everything_then_resumes(bootstrap, prefix, counts):
    """The actor behind for every prompt (503: the tries count, but no record is done) or not
    answering at all: nothing goes to the DLQ however long, and all of it comes out once it is
    back."""
    down = threading.Event()
    down.set()

    def handle(items):
        if down.is_set():
            return [RetryLater("actor not ready: behind", 0.1, counts=counts) for _ in items]
        return [[Output("rl.scored", g.prompt_id, _scored(g))] for g, _ in items]

    pids = {0: ["p0", "p1", "p2"], 3: ["q0", "q1"], 5: ["r0"]}
    _produce(bootstrap, f"{prefix}rl.rollouts", pids)
    run = Running(bootstrap, prefix, f"budget-down-{counts}", handle, max_hold_s=0.2, max_attempts=2)
    try:
        assert read_all(bootstrap, f"{prefix}rl.scored", expect=0, settle_s=4) == []
        assert read_all(bootstrap, f"{prefix}rl.dlq", expect=0, settle_s=0.5) == []
        # counted tries: every record is past its budget, and still held
        assert run.metric("steadyrl_stage_retrying_records") == (6 if counts else 0)
        assert run.metric("steadyrl_stage_records_total", outcome="held") >= 6
        down.clear()
        scored = decode_all(read_all(bootstrap, f"{prefix}rl.scored", expect=6, timeout_s=60), ScoredGroup)
        assert read_all(bootstrap, f"{prefix}rl.dlq", expect=0, settle_s=0.5) == []
    finally:
        run.stop()
    assert sorted(s.prompt_id for s in scored) == sorted(p for ps in pids.values() for p in ps)
    assert run.metric("steadyrl_stage_retrying_records") == 0


def test_an_oversize_or_unencodable_output_goes_to_the_dlq_and_the_rest_commits_once(bootstrap, prefix):
    """Before: an output above rl.scored's 8 MiB aborted the transaction at commit and the batch
    was redone at once, for good (above the producer's 16 MiB: the process exited). Now it goes to
    rl.dlq before produce; the largest record the stage lets through is taken by the broker."""
    limit = load_catalogue()["rl.scored"].max_message_bytes

    def padded(g: RolloutGroup, key: str, extra: int) -> Output:
        value, headers = codec.encode(_scored(g, ""))
        room = limit - RECORD_FRAMING_BYTES - record_bytes(value, key, headers)
        return Output("rl.scored", key, _scored(g, "x" * (room + extra)))

    def handle(items):
        out = []
        for g, _ in items:
            pid = g.prompt_id
            if pid == "fits":
                out.append([padded(g, pid, 0)])
            elif pid == "big":
                out.append([Output("rl.scored", f"{pid}-first", _scored(g)), padded(g, pid, 1)])
            elif pid == "huge":  # above the producer's own message.max.bytes too
                out.append([Output("rl.scored", pid, _scored(g, "x" * (17 << 20)))])
            elif pid == "not-a-contract":
                out.append([Output("rl.scored", pid, object())])
            else:
                out.append([Output("rl.scored", pid, _scored(g))])
        return out

    _produce(bootstrap, f"{prefix}rl.rollouts", {0: ["ok-0", "big", "ok-1", "fits"], 1: ["ok-2", "not-a-contract"],
                                                 2: ["huge", "ok-3"]})
    run = Running(bootstrap, prefix, "budget-oversize", handle)
    try:
        scored_msgs = read_all(bootstrap, f"{prefix}rl.scored", expect=5, timeout_s=60, settle_s=3)
        dlq = {m.key().decode(): codec.decode(m.value(), m.headers(), DLQRecord)
               for m in read_all(bootstrap, f"{prefix}rl.dlq", expect=3, timeout_s=30)}
    finally:
        run.stop()
    keys = Counter(m.key().decode() for m in scored_msgs)
    assert keys == Counter(["ok-0", "ok-1", "ok-2", "ok-3", "fits"]), keys  # once each; none of big's
    assert len(next(m for m in scored_msgs if m.key() == b"fits").value()) > limit - 4096
    assert {k: r.reason for k, r in dlq.items()} == {"big": DLQReason.output_oversize,
                                                     "huge": DLQReason.output_oversize,
                                                     "not-a-contract": DLQReason.handler_error}
    assert f"the topic takes at most {limit - RECORD_FRAMING_BYTES} (max.message.bytes {limit}" in dlq["big"].error
    assert "an output to rl.scored cannot be encoded: AttributeError" in dlq["not-a-contract"].error
    assert run.metric("steadyrl_stage_transactions_total", result="aborted") == 0
    assert run.metric("steadyrl_stage_dlq_records_total", reason="output_oversize") == 2


def nan_scorer(data_source, solution_str, ground_truth, extra_info=None):
    """numeric_match, but NaN for a response containing "nan" (a scorer that returns NaN)."""
    from steadyrl.model.rewards import numeric_match

    return float("nan") if "nan" in solution_str else numeric_match(data_source, solution_str, ground_truth, extra_info)


def test_a_scorer_returning_nan_sends_its_group_alone_to_the_dlq_and_the_reward_worker_goes_on(bootstrap, prefix,
                                                                                              tmp_path):
    """The reward server refuses a NaN score (422 naming the item: non_finite); before that
    answer existed it was a 500 on every batch with the group, and the breaker's trial call
    failed on it again and again. Either way the group leaves (a 500 while the server scores
    other items spends its budget: retries_exhausted) and every other group is scored once."""
    import json

    from tests.helpers import ServiceProc, produce_all

    groups = [rollout_group(i, answer="4" if i % 2 else "5") for i in range(6)]
    poison = rollout_group(99, answer="nan")
    produce_all(bootstrap, f"{prefix}rl.rollouts", [(g.prompt_id, *codec.encode(g)) for g in groups[:3] + [poison]
                                                    + groups[3:]])
    scorer = "tests.integration.test_stage_budget:nan_scorer"
    server = ServiceProc("reward.server", ["--reward-server.scorers", json.dumps([scorer]),
                                           "--reward-server.default-scorer", scorer], tmp_path / "server.log")
    worker = None
    try:
        server.wait_ready()
        worker = ServiceProc("reward", ["--bootstrap", bootstrap, "--topic-prefix", prefix, "--instance-id", "nan0",
                                        "--reward.server-url", server.url, "--reward.scorer", scorer,
                                        "--reward.retry-backoff-s", "0.2", "--reward.max-hold-s", "1",
                                        "--reward.max-attempts", "2", "--metrics-interval", "1"],
                             tmp_path / "reward.log")
        worker.wait_ready()
        scored = decode_all(read_all(bootstrap, f"{prefix}rl.scored", expect=6, timeout_s=60), ScoredGroup)
        dlq_msgs = read_all(bootstrap, f"{prefix}rl.dlq", expect=1, timeout_s=60, settle_s=2)
        assert sorted(s.prompt_id for s in scored) == sorted(g.prompt_id for g in groups)
        assert all(s.rewards == [1.0 if s.group.prompt.index % 2 else 0.0] for s in scored)
        [rec] = decode_all(dlq_msgs, DLQRecord)
        assert dlq_msgs[0].key().decode() == poison.prompt_id
        assert rec.reason in (DLQReason.non_finite, DLQReason.retries_exhausted), rec
        assert worker.proc.poll() is None
        assert worker.metric("steadyrl_reward_breaker_state", {"state": "closed"}) == 1
    finally:
        if worker is not None:
            assert worker.stop() == 0
        server.stop()

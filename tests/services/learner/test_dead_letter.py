"""A record on rl.dlq keyed by a prompt in flight: that prompt is published again (same id,
attempt + 1: a new seed) and counted, however many come -- the learner never exits on them
(the alert on steadyrl_learner_dlq_prompts_total tells a person). The feeder's total: a run
publishes steps x B new prompts whatever goes to rl.dlq, and a state from before (when each
DLQ loss got a new prompt, counts.dlq of them) still publishes its replacements."""

import json

from prometheus_client import REGISTRY

from steadyrl.services.learner.config import LearnerSection, load_dataset
from steadyrl.services.learner.feeder import Feeder
from steadyrl.services.learner.state import InFlight, RunState
from steadyrl.wire import codec
from steadyrl.wire.contracts import DLQReason
from tests.services.learner.conftest import FakeOutbox, Msg, scored


def _dlq(pid: str, reason=DLQReason.validation_failed, offset=0, attempt=0) -> Msg:
    """The record a rollout worker writes for attempt `attempt` of a prompt it cannot generate."""
    value = json.dumps({"prompt_id": pid, "messages": [], "attempt": attempt}).encode()
    rec = codec.dlq_record(codec.Rejected(reason, "n_samples: Input should be less than or equal to 256"),
                           stage="rollout/0", topic="rl.prompts", partition=0, offset=offset, key=pid.encode(),
                           value=value)
    assert rec.attempt == attempt
    return Msg(rec, pid, offset=offset, topic="rl.dlq")


def _dlq_prompts(reason: str) -> float:
    return REGISTRY.get_sample_value("steadyrl_learner_dlq_prompts_total", {"reason": reason}) or 0.0


def _dlq_ignored(why: str) -> float:
    return REGISTRY.get_sample_value("steadyrl_learner_dlq_ignored_total", {"why": why}) or 0.0


def _backoff_passed(lrn) -> None:
    """As if every prompt sent back by rl.dlq had waited out its backoff."""
    for pid in lrn.intake.retry_at:
        lrn.intake.retry_at[pid] = 0.0


def test_a_prompt_sent_back_by_the_dlq_waits_its_backoff(make_learner, monkeypatch):
    """Regression: with the exit gone, a configuration that cannot work sent each prompt through
    rl.dlq as fast as a worker refused it. Attempt k waits 1, 2, 4, ... 60 s."""
    import steadyrl.services.learner.feeder as feeder_mod
    import steadyrl.services.learner.intake as intake_mod
    from steadyrl.services.learner.intake import dlq_backoff_s

    assert [dlq_backoff_s(k) for k in (1, 2, 3, 7, 8, 20)] == [1.0, 2.0, 4.0, 60.0, 60.0, 60.0]
    now = [1000.0]
    monkeypatch.setattr(intake_mod.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(feeder_mod.time, "monotonic", lambda: now[0])
    lrn = make_learner()
    lrn.feeder.top_up()
    pid = next(iter(lrn.state.in_flight))
    lrn.intake.dead_letter(_dlq(pid))
    assert lrn.feeder.top_up() == 0 and lrn.state.requeue == [pid]   # not yet: 1 s to wait
    now[0] += 1.0
    assert lrn.feeder.top_up() == 1 and lrn.state.requeue == []
    lrn.intake.dead_letter(_dlq(pid, offset=1, attempt=1))            # second time: 2 s
    now[0] += 1.5
    assert lrn.feeder.top_up() == 0
    now[0] += 0.5
    assert lrn.feeder.top_up() == 1


def test_every_prompt_on_the_dlq_goes_out_again_with_a_new_seed_and_the_learner_goes_on(make_learner, caplog):
    lrn = make_learner()
    st, before = lrn.state, _dlq_prompts("validation_failed")
    lrn.feeder.top_up()
    first = {k: v.seed for k, v in lrn.outbox.on("rl.prompts")}
    for round_ in range(1, 4):                      # three batches' worth in a row: never a ConfigError
        for i, pid in enumerate(list(st.in_flight)):
            lrn.intake.dead_letter(_dlq(pid, offset=10 * round_ + i, attempt=round_ - 1))
        _backoff_passed(lrn)
        assert sorted(st.requeue) == sorted(first) and lrn.feeder.top_up() == 4
        assert {k: v.seed for k, v in lrn.outbox.on("rl.prompts")[-4:]} == {
            k: s + 7919 * round_ for k, s in first.items()}
    assert st.fed == 4 and st.counts["dlq"] == 12 and st.dlq_offset == 34
    assert _dlq_prompts("validation_failed") == before + 12
    assert any("a batch's worth of prompts in a row went to rl.dlq" in r.getMessage() for r in caplog.records)


def test_records_that_name_nothing_of_ours_in_flight_change_nothing(make_learner):
    lrn = make_learner()
    st = lrn.state
    lrn.feeder.top_up()
    waiting, queued, *_ = list(st.in_flight)
    lrn.intake.accept(Msg(scored(st, waiting), waiting))
    st.in_flight[queued].attempt, _ = 1, st.requeue.append(queued)   # dropped as stale, not published yet
    for pid in (waiting, queued, "another-run/e0-i1", f"{st.run_id}/e9-i9"):
        lrn.intake.dead_letter(_dlq(pid))
    assert st.requeue == [queued] and st.in_flight[queued].attempt == 1 and "dlq" not in st.counts
    assert waiting in lrn.intake.ready


def test_an_unreadable_dlq_record_does_not_count(make_learner):
    """Issue 46: an unreadable record keyed by a prompt in flight was a refusal (reason
    `unreadable`): garbage anyone could write cost the prompt a generation and its budget."""
    lrn = make_learner()
    lrn.feeder.top_up()
    pid, before = next(iter(lrn.state.in_flight)), _dlq_ignored("unreadable")
    lrn.intake.dead_letter(Msg(b"\xff garbage", pid, topic="rl.dlq", headers=[("schema", b"dlq_record/v1.1")]))
    assert lrn.state.requeue == [] and lrn.state.in_flight[pid].refused == 0 and "dlq" not in lrn.state.counts
    assert lrn.state.counts["dlq_ignored"] == 1 and _dlq_ignored("unreadable") == before + 1


def test_a_run_with_dlq_losses_trains_steps_times_b_prompts_each_once(make_learner):
    """The whole loop on the tiny model: one prompt of every batch goes to rl.dlq once; the run
    still publishes exactly steps x B new prompts and trains each once."""
    lrn = make_learner(steps=3)
    st, lost, offset = lrn.state, set(), 0
    lrn.store.publish(lrn.model, st)
    while st.step < 3:
        _backoff_passed(lrn)
        lrn.feeder.top_up()
        for pid in [p for p in st.in_flight if p not in lrn.intake.ready]:
            offset += 1
            if pid not in lost and len(lost) <= st.step:            # one loss per step, each prompt once
                lost.add(pid)
                lrn.intake.dead_letter(_dlq(pid, offset=offset))
            else:
                lrn.intake.accept(Msg(scored(st, pid, seed=st.in_flight[pid].attempt), pid, offset=offset))
        if len(lrn.intake.ready) >= 4:
            assert lrn.train_step() is not None
    _backoff_passed(lrn)
    assert lrn.feeder.top_up() == 0                                  # nothing more to publish
    trained = [json.loads(line)["prompt_id"] for line in (lrn.run_dir / "consumed.jsonl").read_text().splitlines()]
    assert st.fed == 12 and len(trained) == len(set(trained)) == 12 and not st.in_flight
    assert lost <= set(trained) and st.counts["dlq"] == 3 and st.dlq_replaced == 0


def _run_out(feeder: Feeder, st: RunState, b: int) -> list[str]:
    """Train the b oldest prompts in flight until fewer than b are left (feeder-only)."""
    trained = []
    while True:
        feeder.top_up()
        batch = sorted(st.in_flight, key=lambda p: st.in_flight[p].seq)[:b]
        if len(batch) < b:
            return trained
        for pid in batch:
            del st.in_flight[pid]
            trained.append(pid)


def test_a_state_saved_when_dlq_losses_got_new_prompts_resumes_with_as_many_prompts_as_it_needs():
    """The learner up to issue 18 deleted a lost prompt and published another: its state holds
    counts.dlq = 2 and 2 prompts fewer in flight. Resumed now it publishes those 2, and the run
    ends with steps x B trained: not one too few (a run that could not finish) nor too many."""
    lc = LearnerSection(model="tiny", data="tiny_copy:64", eval_data=None, steps=3, prompts_per_step=4,
                        max_staleness=1, prompt_gate={"cooldown_s": 0})
    rows = load_dataset(lc.data)
    new = RunState(run_id="r1")
    Feeder(lc, rows, new, FakeOutbox()).top_up()                    # 8 published, as the old learner did
    old = json.loads(new.model_dump_json(exclude={"dlq_replaced"}))
    lost = sorted(old["in_flight"])[:2]
    for pid in lost:                                                  # what its dead_letter did with two
        del old["in_flight"][pid]
    old["counts"] = {"dlq": 2}
    st = RunState.parse(json.dumps(old), "old state.json")
    assert st.dlq_replaced == 2 and len(st.in_flight) == 6 and st.fed == 8
    out = FakeOutbox()
    trained = _run_out(Feeder(lc, rows, st, out), st, 4)
    assert len(trained) == len(set(trained)) == 12 and not st.in_flight and st.fed == 14
    assert not set(lost) & set(trained)                              # lost then, replaced then

    # a state this version saved keeps its dlq_replaced however many DLQ records it has seen since
    st.counts["dlq"] = 7
    again = RunState.parse(st.model_dump_json(), "new state.json")
    assert again.dlq_replaced == 2 and RunState(run_id="r2").dlq_replaced == 0


def test_a_state_without_losses_is_unchanged_by_the_rule():
    lc = LearnerSection(model="tiny", data="tiny_copy:64", eval_data=None, steps=2, prompts_per_step=4,
                        prompt_gate={"cooldown_s": 0})
    st = RunState(run_id="r1", in_flight={"r1/e0-i3": InFlight(seq=1, epoch=0, index=3)}, fed=1, feeder_position=1)
    trained = _run_out(Feeder(lc, load_dataset(lc.data), st, FakeOutbox()), st, 4)
    assert len(trained) == 8 and st.fed == 8

"""Every prompt has an end (issue 33): a prompt refused again and again (sent back by rl.dlq)
is abandoned once it has been refused learner.prompt_max_refusals times over at least
prompt_min_refusal_s -- recorded once with its reasons, counted, its slot given to the next
row -- and a prompt in flight past the bound with no group and no refusal is published again
(same id, same seed): its records were lost."""

import json

from prometheus_client import REGISTRY

from steadyrl.services.learner import feeder as feeder_mod
from steadyrl.services.learner import intake as intake_mod
from steadyrl.services.learner.state import InFlight
from tests.services.learner.test_dead_letter import _backoff_passed, _dlq


def _abandoned_total() -> float:
    return REGISTRY.get_sample_value("steadyrl_learner_prompts_abandoned_total") or 0.0


def test_a_prompt_refused_past_its_budget_is_abandoned_once_and_replaced(make_learner, monkeypatch):
    now = [1_000_000]
    monkeypatch.setattr(intake_mod, "now_ms", lambda: now[0])
    lrn = make_learner(prompt_max_refusals=3, prompt_min_refusal_s=10)
    st, before = lrn.state, _abandoned_total()
    lrn.feeder.top_up()
    pid = sorted(st.in_flight)[0]
    for k in range(3):                     # 3 refusals within 2 s: the time part of the budget holds it
        lrn.intake.dead_letter(_dlq(pid, offset=k, attempt=k))
        now[0] += 1000
        _backoff_passed(lrn)
        lrn.feeder.top_up()
    assert pid in st.in_flight and st.in_flight[pid].refused == 3 and not st.abandoned
    now[0] += 10_000                       # 13 s since the first refusal: the 4th ends it
    lrn.intake.dead_letter(_dlq(pid, offset=3, attempt=3))
    assert pid not in st.in_flight and pid not in st.requeue and pid not in lrn.intake.retry_at
    assert list(st.abandoned) == [pid] and "refused 4 times over 13 s" in st.abandoned[pid]
    assert st.counts["abandoned"] == 1 and _abandoned_total() == before + 1
    [rec] = [json.loads(x) for x in (lrn.run_dir / "abandoned.jsonl").read_text().splitlines()]
    assert rec["prompt_id"] == pid and rec["refused"] == 4 and len(rec["reasons"]) == 3
    assert "validation_failed" in rec["reasons"][-1]
    # its slot goes to the next row: one new prompt, and the run still publishes steps x B trained ones
    fed = st.fed
    assert lrn.feeder.top_up() == 1 and st.fed == fed + 1 and len(st.in_flight) == 4
    # a late DLQ record or group of the abandoned prompt changes nothing
    lrn.intake.dead_letter(_dlq(pid, offset=9))
    assert st.counts["abandoned"] == 1 and pid not in st.in_flight


def test_the_abandoned_prompts_survive_a_restart(make_learner, monkeypatch):
    monkeypatch.setattr(intake_mod, "now_ms", lambda: 5_000_000)
    lrn = make_learner(prompt_max_refusals=1, prompt_min_refusal_s=0)
    lrn.feeder.top_up()
    pid = sorted(lrn.state.in_flight)[0]
    lrn.intake.dead_letter(_dlq(pid))
    lrn.store.publish(lrn.model, lrn.state)   # version 0, as run() does first
    lrn.save_state()
    again = make_learner(prompt_max_refusals=1, prompt_min_refusal_s=0)
    assert again.state.run_id == lrn.state.run_id and pid in again.state.abandoned
    assert pid not in again.state.in_flight


def test_a_prompt_in_flight_past_the_bound_is_published_again_with_the_same_id_and_seed(make_learner, monkeypatch):
    now = [2_000_000]
    monkeypatch.setattr(feeder_mod, "now_ms", lambda: now[0])
    lrn = make_learner()
    st = lrn.state
    lrn.feeder.top_up()
    first = dict(lrn.outbox.on("rl.prompts"))
    assert lrn.feeder.overdue(lrn.intake.ready, 60.0) == []
    now[0] += 61_000
    waiting = sorted(st.in_flight)[0]          # its group came: not overdue
    lrn.intake.ready[waiting] = object()
    late = lrn.feeder.overdue(lrn.intake.ready, 60.0)
    assert sorted(late) == sorted(set(st.in_flight) - {waiting}) and st.counts["republished"] == 3
    assert lrn.feeder.overdue(lrn.intake.ready, 60.0) == []   # queued once
    lrn.intake.ready.clear()
    assert lrn.feeder.top_up() == 3 and st.fed == 4            # same prompts, none new
    again = lrn.outbox.on("rl.prompts")[-3:]
    assert {k: v.seed for k, v in again} == {k: first[k].seed for k, _ in again}
    assert all(st.in_flight[k].published_ms == now[0] for k, _ in again)   # the clock starts again


def test_a_state_written_before_publish_times_counts_their_age_from_the_start(make_learner, monkeypatch):
    lrn = make_learner()
    lrn.feeder.top_up()
    for f in lrn.state.in_flight.values():
        f.published_ms = 0
    lrn.store.publish(lrn.model, lrn.state)   # version 0, as run() does first
    lrn.save_state()
    monkeypatch.setattr(feeder_mod, "now_ms", lambda: 9_000_000)
    again = make_learner()
    assert {f.published_ms for f in again.state.in_flight.values()} == {9_000_000}
    assert again.feeder.overdue(again.intake.ready, 1.0) == []


def test_an_old_in_flight_prompt_of_a_row_now_left_out_is_abandoned_at_start(make_learner, tmp_path):
    """A run published a prompt before the start-time check existed; its row is bad: abandoned
    at once, not published again."""
    rows = tmp_path / "d.jsonl"
    rows.write_text("".join(json.dumps({"question": str(i % 10), "answer": str(i % 10)}) + "\n" for i in range(8)))
    lrn = make_learner(data=str(rows))
    lrn.feeder.top_up()
    st = lrn.state
    pid, f = sorted(st.in_flight.items())[0]
    lrn.store.publish(lrn.model, lrn.state)   # version 0, as run() does first
    lrn.save_state()
    lines = rows.read_text().splitlines()
    lines[f.index] = json.dumps({"question": ["not", "text"], "answer": "1"})
    rows.write_text("\n".join(lines) + "\n")
    again = make_learner(data=str(rows))
    assert pid in again.state.abandoned and f"row {f.index} left out at start" in again.state.abandoned[pid]
    assert pid not in again.state.in_flight and isinstance(f, InFlight)


def test_a_resume_with_other_rows_left_out_never_publishes_a_prompt_id_twice(make_learner, tmp_path):
    """Regression (review of issue 33): the feeder's position counted the filtered order, so a
    resume that left out fewer rows (a limit raised) published a trained prompt id again."""
    rows = tmp_path / "d.jsonl"
    good = [json.dumps({"question": str(i % 10), "answer": str(i % 10)}) for i in range(16)]
    bad = good[:]
    for i in (1, 5, 9, 13):
        bad[i] = json.dumps({"question": ["not", "text"], "answer": "1"})
    rows.write_text("\n".join(bad) + "\n")
    lrn = make_learner(data=str(rows))
    lrn.feeder.top_up()
    first = [k for k, _ in lrn.outbox.on("rl.prompts")]
    lrn.store.publish(lrn.model, lrn.state)
    lrn.save_state()
    rows.write_text("\n".join(good) + "\n")      # every row servable now
    again = make_learner(data=str(rows))
    for pid in list(again.state.in_flight):      # as if they were trained
        del again.state.in_flight[pid]
    again.feeder.top_up()
    assert not set(first) & {k for k, _ in again.outbox.on("rl.prompts")}


def test_a_dlq_records_long_error_is_kept_cut_short(make_learner):
    """Regression (review): a forged DLQ record's 900 KB error went whole into state.abandoned,
    state.json grew to 18 MB after 20 of them."""
    from steadyrl.wire import codec
    from steadyrl.wire.contracts import DLQReason
    from tests.services.learner.conftest import Msg

    lrn = make_learner(prompt_max_refusals=1, prompt_min_refusal_s=0)
    lrn.feeder.top_up()
    pid = sorted(lrn.state.in_flight)[0]
    rec = codec.dlq_record(codec.Rejected(DLQReason.handler_error, "x"), stage="reward/0", topic="rl.rollouts",
                           partition=0, offset=0, key=pid.encode(), value=b"{}")
    rec.error, rec.attempt = "y" * 900_000, 0
    lrn.intake.dead_letter(Msg(rec, pid, topic="rl.dlq"))
    assert pid in lrn.state.abandoned and len(lrn.state.abandoned[pid]) < 700

"""A reward scorer that raises on every item stops the run with exit 2, naming the scorer, the
exception and where it was raised; one that raises on some items, or a reward server that is
down, never does (issue 38: a newcomer's `float(solution_str)` made the run hang at step 0
for ever, with a summary line that blamed group_size)."""

import json

import pytest

from steadyrl.services.learner.loop import ScorerFailing
from steadyrl.services.learner.refusals import Refusals, default_limit, scorer_items
from steadyrl.services.reward.client import scorer_error_detail
from steadyrl.wire import codec
from steadyrl.wire.contracts import DLQReason
from tests.services.learner.conftest import Msg, scored

RAISED = ("scorer my_reward.py:compute_score raised ValueError: could not convert string to float: 'abc' "
          "(at my_reward.py:2 in compute_score: return float(solution_str))")


def _error(failed: int, items: int = 8, pid: str = "r/e0-i0") -> str:
    return scorer_error_detail(pid, failed, items, RAISED)


def test_the_reward_workers_error_is_read_back():
    assert scorer_items("scorer_error", _error(3)) == (3, 8, RAISED)
    assert scorer_items("handler_error", _error(3)) is None           # another reason: not the scorer's
    assert scorer_items("scorer_error", "something else") is None


def test_limit_groups_in_a_row_all_raising_stop_the_run_naming_the_scorer_and_the_line():
    r = Refusals(limit=3)
    for _ in range(2):
        r.refused("reward/reward-0", "scorer_error", _error(8))
    assert r.failing() is None
    r.refused("reward/reward-1", "scorer_error", _error(8))
    why = r.failing()
    assert why is not None and why.startswith("the reward scorer failed on every sample of 3 groups in a row "
                                              "(24 items; scorer_error x3) and scored none: scorer "
                                              "my_reward.py:compute_score "
                                              "raised ValueError: could not convert string to float: 'abc' "
                                              "(at my_reward.py:2 in compute_score: return float(solution_str))")
    assert "learner.scorer_failure_limit (3)" in why


def test_timeouts_crashes_and_non_finite_returns_count_as_failures_too_naming_each_kind():
    """Issue 46: one failure rule. A scorer that hangs, kills its process or returns NaN on every
    item stops the run as one that raises does; the stop names the kinds and an example."""
    kinds = {"scorer_timeout": "scorer my_reward.py:compute_score did not return within item_timeout_s (2 s): "
                               "its scoring process was killed and replaced",
             "scorer_crash": "scorer my_reward.py:compute_score crashed its scoring process (exited with code 3) "
                             "on this item",
             "non_finite": "scorer my_reward.py:compute_score returned nan, not a finite number"}
    for kind, first in kinds.items():
        r = Refusals(limit=2)
        assert scorer_items(kind, scorer_error_detail("r/e0-i0", 8, 8, first)) == (8, 8, first)
        r.refused("reward/0", kind, scorer_error_detail("r/e0-i0", 8, 8, first))
        assert r.failing() is None
        r.refused("reward/0", kind, scorer_error_detail("r/e0-i1", 8, 8, first))
        why = r.failing()
        assert why is not None and f"(16 items; {kind} x2) and scored none: {first}" in why, why
    r = Refusals(limit=3)   # mixed kinds make one run of failures
    r.refused("reward/0", "scorer_timeout", scorer_error_detail("p", 8, 8, kinds["scorer_timeout"]))
    r.refused("reward/0", "non_finite", scorer_error_detail("p", 8, 8, kinds["non_finite"]))
    r.refused("reward/0", "scorer_error", _error(8))
    why = r.failing()
    assert why is not None and "scorer_timeout x1" in why and "non_finite x1" in why and "scorer_error x1" in why
    assert kinds["scorer_timeout"] in why   # the first group's example


def test_a_group_scored_or_a_group_raising_in_part_resets_the_count():
    r = Refusals(limit=3)
    r.refused("reward/0", "scorer_error", _error(8))
    r.refused("reward/0", "scorer_error", _error(8))
    r.scored()                                                      # the scorer works on some prompts
    r.refused("reward/0", "scorer_error", _error(8))
    r.refused("reward/0", "scorer_error", _error(8))
    assert r.failing() is None and r.streak == 2
    r.refused("reward/0", "scorer_error", _error(7))                # it scored one of eight: works in part
    assert r.streak == 0
    for _ in range(2):
        r.refused("reward/0", "scorer_error", _error(8))
    assert r.failing() is None


def test_outages_and_other_refusals_neither_count_nor_reset():
    """An outage never reaches rl.dlq (the worker holds the group); what a held group can become
    (retries_exhausted) and every other reason are not the scorer's word."""
    r = Refusals(limit=2)
    r.refused("reward/0", "scorer_error", _error(8))
    for reason in ("retries_exhausted", "handler_error", "validation_failed", "unreadable"):
        r.refused("reward/0", reason, "prompt p: reward server answered 500 ...")
    r.refused("reward/0", "non_finite", "prompt p: scorer x returned non-finite rewards [nan]")  # a 1.3 worker's
    assert r.streak == 1 and r.failing() is None
    r.refused("reward/0", "scorer_error", _error(8))
    assert r.failing() is not None


def test_the_summary_names_the_reasons_counted_since_the_last_step():
    r = Refusals(limit=100)
    for _ in range(8):
        r.refused("reward/reward-0", "scorer_error", _error(8))
    r.refused("rollout/rollout-0", "validation_failed", "n_samples: Input should be less than or equal to 256")
    assert r.summary() == (f"reward: {RAISED} (64 of the last 64 items); "
                           "rollout: validation_failed x1 (first: n_samples: Input should be less than or equal "
                           "to 256)")
    r.stepped()
    assert r.summary() == "none" and r.streak == 8     # a step clears the summary, not the scorer's count


def test_the_default_limit():
    assert default_limit(4) == 16 and default_limit(8) == 16 and default_limit(64) == 128


def _dlq(pid: str, failed: int, items: int = 4, offset: int = 0, attempt: int = 0) -> Msg:
    rec = codec.dlq_record(codec.Rejected(DLQReason.scorer_error, scorer_error_detail(pid, failed, items, RAISED)),
                           stage="reward/reward-0", topic="rl.rollouts", partition=0, offset=offset,
                           key=pid.encode(), value=b"{}")
    rec.attempt = attempt
    return Msg(rec, pid, offset=offset, topic="rl.dlq")


def test_the_learner_names_the_scorer_not_group_size_and_stops_with_exit_2(make_learner, caplog):
    lrn = make_learner(scorer_failure_limit=6)
    st = lrn.state
    lrn.feeder.top_up()
    pids = list(st.in_flight)
    for i, pid in enumerate(pids):                                 # a batch's worth: 4 of 4 groups
        lrn.intake.dead_letter(_dlq(pid, 4, offset=i))
    assert lrn.intake.refusals.failing() is None
    shown = [r.getMessage() for r in caplog.records if "a batch's worth" in r.getMessage()]
    assert shown == [f"a batch's worth of prompts in a row went to rl.dlq since the last step: reward: {RAISED} "
                     "(16 of the last 16 items); the learner goes on"]
    for pid in pids:                                               # published again: two more refused
        lrn.intake.retry_at[pid] = 0.0
    lrn.feeder.top_up()
    lrn.intake.dead_letter(_dlq(pids[0], 4, offset=10, attempt=1))
    lrn.intake.accept(Msg(scored(st, pids[1]), pids[1], offset=11))  # one scored: the count starts again
    for i, pid in enumerate(pids[2:]):
        lrn.intake.dead_letter(_dlq(pid, 4, offset=12 + i, attempt=1))
    assert lrn.intake.refusals.streak == 2 and lrn.intake.refusals.failing() is None
    for pid in (pids[0], pids[2], pids[3]):
        lrn.intake.retry_at[pid] = 0.0
    lrn.feeder.top_up()
    for i, pid in enumerate((pids[0], pids[2], pids[3])):
        lrn.intake.dead_letter(_dlq(pid, 4, offset=20 + i, attempt=2))
    lrn.intake.retry_at[pids[0]] = 0.0
    lrn.feeder.top_up()
    lrn.intake.dead_letter(_dlq(pids[0], 4, offset=30, attempt=3))
    why = lrn.intake.refusals.failing()
    assert why is not None and "6 groups in a row (24 items; scorer_error x6)" in why
    with pytest.raises(ScorerFailing) as e:
        lrn.stop_scorer_failing(why)
    assert e.value.code == 2 and str(e.value).startswith("learner: the reward scorer failed on every sample")
    assert "ValueError: could not convert string to float: 'abc' (at my_reward.py:2" in str(e.value)
    saved = json.loads((lrn.run_dir / "state.json").read_text())
    assert set(saved["in_flight"]) == set(st.in_flight) and not saved["abandoned"]   # nothing lost
    assert (lrn.run_dir / "checkpoints").is_dir()

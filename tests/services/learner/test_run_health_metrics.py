"""The learner's gauges behind the dashboard's "Run health" row (compose/grafana/dashboards):
the planned steps (progress, ETA), when the newest verified checkpoint was written, the policy
lag of the last step, and the accuracy of each harder evaluation split."""

import math

from prometheus_client import REGISTRY

from steadyrl.services.learner import report
from steadyrl.services.learner.config import LearnerSection
from tests.services.learner.conftest import Msg, scored


def _value(name, labels=None):
    return REGISTRY.get_sample_value(name, labels or {})


def _step(lrn, seed=0, version=None):
    lrn.feeder.top_up()
    for i, pid in enumerate(p for p in list(lrn.state.in_flight) if p not in lrn.intake.ready):
        lrn.intake.accept(Msg(scored(lrn.state, pid, seed=seed, version=version), pid, offset=100 * seed + i))
    assert lrn.train_step() is not None


def test_planned_steps_and_the_verified_checkpoints_write_time(make_learner):
    lrn = make_learner(steps=7, checkpoint_every=1)
    assert _value("steadyrl_learner_planned_steps") == 7.0
    assert math.isnan(_value("steadyrl_learner_last_verified_checkpoint_timestamp_seconds"))  # none yet
    lrn.store.publish(lrn.model, lrn.state)
    _step(lrn)
    lrn.saver.wait()
    manifest = lrn.saver.root / "step_000001" / "manifest.json"
    assert _value("steadyrl_learner_last_verified_checkpoint_timestamp_seconds") == manifest.stat().st_mtime
    lrn.cache.close()


def test_the_policy_lag_is_the_oldest_trained_groups_distance_from_the_updated_weights(make_learner):
    lrn = make_learner(max_staleness=2, checkpoint_every=100)
    lrn.store.publish(lrn.model, lrn.state)
    _step(lrn)                                          # version 0's groups update version 0
    assert _value("steadyrl_learner_policy_lag") == 0.0
    _step(lrn, seed=1, version=0)                       # groups of version 0 update version 1
    assert lrn.state.step == 2 and _value("steadyrl_learner_policy_lag") == 1.0
    lrn.cache.close()


def test_each_split_accuracy_is_set_by_split_and_when(monkeypatch):
    def greedy(model, tok, rows, scorer, max_new_tokens, on_batch=None, limits=None):
        return 0.25 if len(rows) == 4 else 0.75, [{"correct": False} for _ in rows]

    monkeypatch.setattr("steadyrl.services.learner.report.greedy_eval", greedy)
    lc = LearnerSection(model="tiny", data="tiny_copy:64", eval_data="tiny_copy:8",
                        eval_splits={"short": "tiny_copy:4", "long": "tiny_copy:6"}, eval_splits_limit=0)
    report.evaluate(lc, None, None, "before", lambda: None)
    name = "steadyrl_learner_eval_split_accuracy"
    assert _value(name, {"split": "short", "when": "before"}) == 0.25
    assert _value(name, {"split": "long", "when": "before"}) == 0.75
    assert _value("steadyrl_learner_eval_accuracy", {"when": "before"}) == 0.75   # eval_data: 8 rows

"""A user's scorer that raises during the evaluation: the items it raised on count as wrong and
the evaluation goes on; on every item, a ConfigError naming the scorer (exit 2, no crash loop).
Before, the exception ended the learner, which the supervisor restarted, over and over
(issue 38's newcomer walk-through)."""

import logging

import pytest

from steadyrl.config import ConfigError
from steadyrl.model.data import tiny_copy_rows
from steadyrl.model.models import load_policy
from steadyrl.rl.loop import ScorerRaisedOnEveryItem, evaluate
from steadyrl.services.learner import report
from steadyrl.services.learner.config import LearnerSection

SOME = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth in "01234":
        raise ValueError("no score for " + ground_truth)
    return 1.0
'''
ALL = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str + "x")
'''


def _rows():
    rows = tiny_copy_rows(20, seed=0)
    return rows, sum(r.ground_truth in "01234" for r in rows)


def test_items_the_scorer_raises_on_count_wrong_and_are_named(tmp_path, caplog):
    (tmp_path / "some.py").write_text(SOME)
    model, tok = load_policy("tiny", seed=0)
    rows, raising = _rows()
    assert 0 < raising < len(rows)
    with caplog.at_level(logging.WARNING):
        acc, items = evaluate(model, tok, rows, scorer=f"{tmp_path}/some.py:compute_score", max_new_tokens=2)
    assert acc == pytest.approx((len(rows) - raising) / len(rows))
    errored = [i for i in items if "error" in i]
    assert len(errored) == raising and all(not i["correct"] and i["reward"] == 0.0 for i in errored)
    assert "raised ValueError: no score for" in errored[0]["error"] and "some.py:4" in errored[0]["error"]
    assert f"failed on {raising} of {len(rows)} items (counted wrong)" in caplog.text


def test_progress_is_told_before_the_first_batch_and_after_each():
    model, tok = load_policy("tiny", seed=0)
    rows = tiny_copy_rows(70, seed=0)
    seen = []
    evaluate(model, tok, rows, scorer="tiny_copy", max_new_tokens=2, batch_size=32,
             on_progress=lambda done, n: seen.append((done, n)))
    assert seen == [(0, 70), (32, 70), (64, 70), (70, 70)]


def test_a_scorer_raising_on_every_item_stops_with_a_config_error(tmp_path):
    (tmp_path / "all.py").write_text(ALL)
    spec = f"{tmp_path}/all.py:compute_score"
    model, tok = load_policy("tiny", seed=0)
    rows, _ = _rows()
    first = f"on all {len(rows)} items; the first: scorer .* raised ValueError"
    with pytest.raises(ScorerRaisedOnEveryItem, match=first):
        evaluate(model, tok, rows, scorer=spec, max_new_tokens=2)
    lc = LearnerSection(model="tiny", eval_scorer=spec, eval_data="tiny_copy:8")
    with pytest.raises(ConfigError, match=r"learner.eval_scorer .*all.py:compute_score failed on the evaluation of "
                                          r"tiny_copy:8 on all 8 items"):
        report._greedy(lc, report._split(lc, "test", model, tok, lambda: None, None), model, tok, beat=lambda: None)


FAULTS = '''
import os, time
import numpy as np

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth == "0":
        time.sleep(600)
    if ground_truth == "1":
        os._exit(3)
    if ground_truth == "2":
        return float("nan")
    return {"score": np.float64(1.0), "hits": np.int64(2)}
'''


def test_the_evaluation_scores_in_the_guarded_pool_a_hang_or_a_crash_counts_wrong(tmp_path):
    """Issue 46: the evaluation called the user's reward on the learner's main loop, so a hang
    stopped it for good. Now each item runs in a scoring process with the reward server's
    limits: hung, crashed and NaN items count wrong with their kind, the others are scored."""
    from steadyrl.model.scorepool import ScoringLimits

    (tmp_path / "faults.py").write_text(FAULTS)
    model, tok = load_policy("tiny", seed=0)
    rows = tiny_copy_rows(20, seed=0)
    kinds = {"0": "scorer_timeout", "1": "scorer_crash", "2": "non_finite"}
    assert set(kinds) <= {r.ground_truth for r in rows}
    acc, items = evaluate(model, tok, rows, scorer=f"{tmp_path}/faults.py:compute_score", max_new_tokens=2,
                          limits=ScoringLimits(processes=2, item_timeout_s=0.5, call_deadline_s=5))
    for row, item in zip(rows, items, strict=True):
        if row.ground_truth in kinds:
            assert item["kind"] == kinds[row.ground_truth] and not item["correct"], item
        else:
            assert item["correct"] and item["hits"] == 2 and "error" not in item, item
    assert acc == pytest.approx(sum(r.ground_truth not in kinds for r in rows) / len(rows))

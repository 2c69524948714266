"""The evaluation cache (issue 37): a second greedy evaluation of the same weights on the same
rows with the same settings is read back, not run again; other weights, rows or settings run."""

import torch

from steadyrl.model.models import load_policy
from steadyrl.services.learner import report
from steadyrl.services.learner.config import LearnerSection


def _counting(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = report.greedy_eval

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(report, "greedy_eval", counted)
    return calls


def _section(eval_rows: int) -> LearnerSection:
    return LearnerSection(model="tiny", data="tiny_copy:64", eval_data=f"tiny_copy:{eval_rows}", eval_splits={},
                          eval_scorer="tiny_copy", eval_max_new_tokens=4)


def test_the_same_weights_rows_and_settings_are_evaluated_once(tmp_path, monkeypatch):
    calls = _counting(monkeypatch)
    lc, (model, tok) = _section(16), load_policy("tiny", seed=0)
    cache = tmp_path / "eval-cache"
    first = report.evaluate(lc, model, tok, "before", lambda: None, cache=cache)
    second = report.evaluate(lc, model, tok, "before", lambda: None, cache=cache)
    assert len(calls) == 1 and second["cached"] and "cached" not in first
    assert (second["accuracy"], second["n"], second["correct_items"]) == (
        first["accuracy"], first["n"], first["correct_items"]) and first["n"] == 16

    report.evaluate(lc.model_copy(update={"eval_max_new_tokens": 3}), model, tok, "before", lambda: None,
                    cache=cache)
    report.evaluate(lc.model_copy(update={"eval_data": "tiny_copy:12"}), model, tok, "before", lambda: None,
                    cache=cache)
    with torch.no_grad():
        next(model.parameters()).add_(1e-3)
    report.evaluate(lc, model, tok, "after", lambda: None, cache=cache)
    assert len(calls) == 4 and len(list(cache.iterdir())) == 4

    report.evaluate(lc, model, tok, "after", lambda: None)   # no cache given: always evaluated
    assert len(calls) == 5


def test_an_unreadable_cache_entry_is_evaluated_again(tmp_path, monkeypatch):
    calls = _counting(monkeypatch)
    lc, (model, tok) = _section(8), load_policy("tiny", seed=0)
    cache = tmp_path / "eval-cache"
    first = report.evaluate(lc, model, tok, "before", lambda: None, cache=cache)
    entry, = cache.iterdir()
    entry.write_text("{torn")
    again = report.evaluate(lc, model, tok, "before", lambda: None, cache=cache)
    assert len(calls) == 2 and "cached" not in again and again["correct_items"] == first["correct_items"]

"""Evaluation rows checked like training rows (issue 46): a bad `eval_data` or `eval_splits` row
is left out and named (file, row) and the run goes on; exit 2 at start only when none of a
split's rows is usable (before: one bad row raised in the evaluation, exit 1, restarted for
ever)."""

from __future__ import annotations

import json

import pytest

from steadyrl.config import ConfigError
from steadyrl.run.runfolder import Count
from steadyrl.services.learner import report


def _row(content, truth="3", role="user"):
    return json.dumps({"data_source": "tiny_copy", "prompt": [{"role": role, "content": content}],
                       "reward_model": {"ground_truth": truth}})


def test_bad_evaluation_rows_are_left_out_named_and_the_run_goes_on(make_learner, tmp_path, monkeypatch):
    test = tmp_path / "test.jsonl"
    # rows 2 (not JSON) and 4 (200 tokens + eval_max_new_tokens 4 > the tiny model's context 128) are bad
    test.write_text("\n".join([_row("1"), "{not json", _row("2"), _row("7" * 200), _row("3"), _row("4")]) + "\n")
    hard = tmp_path / "hard.jsonl"
    hard.write_text("\n".join([_row("5"), _row("6", role="tool")]) + "\n")   # role tool: the template is fine
    learner = make_learner(eval_data=str(test), eval_splits={"hard": str(hard)}, eval_scorer="tiny_copy",
                           eval_max_new_tokens=4)
    lines = [json.loads(x) for x in (learner.run_dir / "bad_eval_rows.jsonl").read_text().splitlines()]
    assert [(x["split"], x["where"], x["field"]) for x in lines] == [("test", f"{test} row 2", "line"),
                                                                     ("test", f"{test} row 4", "prompt")]
    assert "205 > the model's context 128" in lines[1]["reason"]
    assert learner.state.counts[Count.bad_eval_rows.value] == 2
    assert learner.evals["test"].good == [0, 2, 4, 5] and learner.evals["hard"].good == [0, 1]
    evaluated = []
    real = report.greedy_eval

    def counted(model, tok, rows, *a, **kw):
        evaluated.append([r.messages[0]["content"] for r in rows])
        return real(model, tok, rows, *a, **kw)

    monkeypatch.setattr(report, "greedy_eval", counted)
    before = report.evaluate(learner.lc, learner.model, learner.tok, "before", lambda: None,
                             cache=learner.eval_cache, rows=learner.evals)
    assert before["n"] == 4 and before["splits"]["hard"]["n"] == 2
    assert evaluated == [["1", "2", "3", "4"], ["5", "6"]]
    # the evaluation cache keys the rows evaluated: the same good rows hit it
    again = report.evaluate(learner.lc, learner.model, learner.tok, "before", lambda: None,
                            cache=learner.eval_cache, rows=learner.evals)
    assert again["cached"] and len(evaluated) == 2
    # the run goes on: prompts go out and a step trains
    assert learner.feeder.top_up() > 0


def test_no_usable_evaluation_row_exits_2_at_start_naming_the_file(make_learner, tmp_path):
    test = tmp_path / "test.jsonl"
    test.write_text("\n".join([_row("7" * 200), "[1]", ""]) + "\n")
    with pytest.raises(ConfigError) as e:
        make_learner(eval_data=str(test), eval_splits={}, eval_scorer="tiny_copy", eval_max_new_tokens=4)
    assert e.value.code == 2
    assert e.value.message.startswith(
        f"learner.eval_data {test}: none of its 2 rows to evaluate is usable (2 bad, first: {test} row 1: prompt: "
        f"201 tokens + learner.eval_max_new_tokens 4 = 205 > the model's context 128; {test} row 2: line: "
        "expected a JSON object, got list)"), e.value.message


def test_a_harder_split_with_no_usable_row_exits_2_naming_the_split(make_learner, tmp_path):
    hard = tmp_path / "hard.jsonl"
    hard.write_text(json.dumps({"answer": 3}) + "\n")
    with pytest.raises(ConfigError, match=rf"^learner\.eval_splits\.hard {hard}: none of its 1 rows to evaluate "
                                          rf"is usable \(1 bad, first: {hard} row 1: question: missing"):
        make_learner(eval_data="tiny_copy:8", eval_splits={"hard": str(hard)}, eval_scorer="tiny_copy",
                     eval_max_new_tokens=4)


def test_a_summary_whose_evaluations_differ_in_items_leaves_the_pairing_out():
    """A resume that left out other evaluation rows (another tokenizer, eval_max_new_tokens)
    evaluates other items after than before: no paired change (zip raised, exit 1, for ever)."""
    from steadyrl.services.learner.config import LearnerSection
    from steadyrl.services.learner.state import RunState

    lc = LearnerSection(model="tiny", data="tiny_copy:8", eval_data="tiny_copy:8")
    before = {"accuracy": 0.5, "n": 4, "correct_items": [True, False, True, False]}
    after = {"accuracy": 1.0, "n": 3, "correct_items": [True, True, True]}
    assert "eval" not in report.summary(lc, RunState(run_id="r", eval_before=before, eval_after=after))
    same = report.summary(lc, RunState(run_id="r", eval_before=before, eval_after={**after, "n": 4,
                                                                                    "correct_items": [True] * 4}))
    assert same["eval"]["improved"] == 2

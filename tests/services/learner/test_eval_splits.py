"""The harder test splits (learner.eval_splits): the config checks each file, the learner
evaluates them before and after like eval_data, and summary.json reports each beside `eval`."""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from steadyrl.services.learner import report
from steadyrl.services.learner.config import DEFAULT_EVAL_SPLITS, LearnerSection
from steadyrl.services.learner.state import RunState

ROOT = Path(__file__).resolve().parents[3]
OLD_STATE = ROOT / "tests/fixtures/run-4bba081/learner/r20261201T075848-5c73/state.json"


def _section(**kw) -> LearnerSection:
    return LearnerSection(model="tiny", data="tiny_copy:64", eval_data="tiny_copy:8", **kw)


def _result(items: list[bool], data: str | None = None) -> dict:
    r = {"accuracy": sum(items) / len(items), "n": len(items), "correct": sum(items), "seconds": 0.1,
         "correct_items": items}
    return r if data is None else {"data": data, **r}


def test_a_missing_split_file_is_an_error_naming_the_field_and_the_split(tmp_path):
    with pytest.raises(ValidationError) as e:
        _section(eval_splits={"level04": str(tmp_path / "nope.parquet")})
    msg = str(e.value)
    assert "eval_splits" in msg and "level04" in msg and "no such file" in msg and "nope.parquet" in msg
    with pytest.raises(ValidationError, match="eval_splits.hard: .*expected a .parquet"):
        _section(eval_splits={"hard": str(tmp_path / "x.csv")})
    with pytest.raises(ValidationError, match="name 'a b'"):
        _section(eval_splits={"a b": "tiny_copy:4"})


def test_splits_are_validated_like_eval_data_and_empty_turns_them_off(tmp_path):
    (tmp_path / "h.jsonl").write_text('{"question": "1+1?", "answer": 2}\n')
    lc = _section(eval_splits={"h": str(tmp_path / "h.jsonl"), "copy": "tiny_copy:4"}, eval_splits_limit=0)
    assert lc.eval_splits == {"h": str(tmp_path / "h.jsonl"), "copy": "tiny_copy:4"}
    assert _section(eval_splits={}).harder_splits == {}
    lc = LearnerSection()
    assert lc.harder_splits == DEFAULT_EVAL_SPLITS and lc.eval_splits_limit == 96
    lc.harder_splits["x"] = "y"  # each section its own dict
    assert LearnerSection().harder_splits == DEFAULT_EVAL_SPLITS


def test_the_default_splits_are_committed_harder_arithmetic_without_train_questions():
    train = {r["extra_info"]["question"] for r in pq.read_table(ROOT / "data/arithmetic/train.parquet").to_pylist()}
    prov = json.loads((ROOT / "data/arithmetic/PROVENANCE.json").read_text())["harder_test_splits"]
    for name, path in DEFAULT_EVAL_SPLITS.items():
        rows = pq.read_table(ROOT / path).to_pylist()
        meta = prov[Path(path).stem]
        assert meta["level"] == int(name.removeprefix("level")) and meta["count"] == len(rows) > 250
        assert train.isdisjoint(r["extra_info"]["question"] for r in rows)
    LearnerSection(eval_splits={k: str(ROOT / v) for k, v in DEFAULT_EVAL_SPLITS.items()})  # valid


def test_summary_reports_each_split_beside_eval_unchanged(tmp_path, capsys):
    lc = _section(eval_splits={"level04": "tiny_copy:4", "level09": "tiny_copy:4"})
    st = RunState(run_id="r1", step=2, history=[{"reward_mean": 0.5, "seconds": 1.0}] * 2,
                  eval_before=_result([False, True, False, False]), eval_after=_result([True, True, False, False]))
    before_only = report.summary(lc, st)  # a run begun before eval_splits: no "splits"
    st.eval_before["splits"] = {"level04": _result([True, False, False, False, True], "a.parquet"),
                                "level09": _result([False, False, True, False], "b.parquet")}
    st.eval_after["splits"] = {"level04": _result([True, True, True, False, False], "a.parquet"),
                               "level09": _result([False, False, False, False], "b.parquet")}
    s = report.summary(lc, st)
    assert s["eval"] == before_only["eval"] == {
        "data": "tiny_copy:8", "before": 0.25, "after": 0.5, **report.paired_margin(
            [False, True, False, False], [True, True, False, False])}
    assert "eval_splits" not in before_only
    e4, e9 = s["eval_splits"]["level04"], s["eval_splits"]["level09"]
    assert set(e4) == set(s["eval"])
    assert (e4["data"], e4["before"], e4["after"], e4["n"]) == ("a.parquet", 0.4, 0.6, 5)
    assert (e4["improved"], e4["regressed"], e4["delta"]) == (2, 1, pytest.approx(0.2))
    assert e4["margin_95"] == pytest.approx(1.96 * (3 - 1 / 5) ** 0.5 / 5) and e4["mcnemar_p"] == 1.0
    assert (e9["before"], e9["after"], e9["improved"], e9["regressed"], e9["learned"]) == (0.25, 0.0, 0, 1, False)
    json.dumps(s)

    report.write_summary(lc, st, tmp_path)
    assert json.loads((tmp_path / "summary.json").read_text()) == s
    out = capsys.readouterr().out   # issue 38: "SUMMARY counts: {}", and neither the curve nor export named
    assert "SUMMARY counts: none (no bad rows, refusals, drops or held batches)\n" in out
    assert f"curve {tmp_path / 'curve.png'}; the trained weights as a model folder: steadyrl export {tmp_path} " \
           "latest <folder>" in out
    st.counts = {"bad_rows": 2, "dlq": 0, "abandoned": 1}
    report.write_summary(lc, st, tmp_path)
    assert "SUMMARY counts: abandoned 1, bad_rows 2\n" in capsys.readouterr().out
    assert (tmp_path / "curve.png").stat().st_size > 0
    # the state round-trips through state.json with its splits (RunState is unchanged)
    assert RunState.parse(st.model_dump_json(), "x").eval_after["splits"] == st.eval_after["splits"]


def test_a_split_without_an_after_or_on_other_items_is_left_out():
    lc = _section(eval_splits={"level04": "tiny_copy:4"})
    before = {**_result([True]), "splits": {"level04": _result([True, False], "a"), "gone": _result([True], "g")}}
    after = {**_result([True]), "splits": {"level04": _result([True, False, True], "a")}}
    s = report.summary(lc, RunState(run_id="r1", eval_before=before, eval_after=after))
    assert "eval" in s and "eval_splits" not in s


def test_a_state_of_the_previous_version_resumes_without_splits():
    st = RunState.parse(OLD_STATE.read_text(), str(OLD_STATE))
    st.eval_before, st.eval_after = _result([True, False]), _result([True, True])  # saved without "splits"
    lc = _section(eval_splits={"level04": "tiny_copy:4"})
    s = report.summary(lc, st)
    assert s["eval"]["after"] == 1.0 and "eval_splits" not in s
    assert report.pending_splits(lc, st.eval_before) == {"level04"}  # evaluated if resumed at step 0
    assert report.pending_splits(lc, {**st.eval_before, "splits": {"level04": {}}}) == set()
    assert report.pending_splits(lc, None) == set()
    assert report.pending_splits(lc.model_copy(update={"eval_data": None}), st.eval_before) == set()


def _fake_greedy(monkeypatch) -> None:
    def greedy(model, tok, rows, scorer, max_new_tokens, on_batch=None, on_progress=None, limits=None):
        if on_progress:
            on_progress(len(rows), len(rows))
        return 0.5, [{"correct": i % 2 == 0} for i in range(len(rows))]

    monkeypatch.setattr("steadyrl.services.learner.report.greedy_eval", greedy)


def test_evaluate_splits_spreads_the_limit_and_skips_without_eval_data(monkeypatch):
    _fake_greedy(monkeypatch)
    lc = _section(eval_splits={"a": "tiny_copy:20", "b": "tiny_copy:3"}, eval_splits_limit=5)
    out = report.evaluate_splits(lc, None, None, "before", lambda: None)
    assert {k: (v["data"], v["n"], v["correct_items"]) for k, v in out.items()} == {
        "a": ("tiny_copy:20", 5, [True, False, True, False, True]), "b": ("tiny_copy:3", 3, [True, False, True])}
    assert list(report.evaluate_splits(lc, None, None, "after", lambda: None, names={"b"})) == ["b"]
    off = lc.model_copy(update={"eval_data": None})
    assert report.evaluate_splits(off, None, None, "before", lambda: None) == {}
    assert report.evaluate(off, None, None, "before", lambda: None) is None


def test_evaluate_reports_progress_by_split(monkeypatch):
    _fake_greedy(monkeypatch)
    seen = []
    lc = _section(eval_splits={"a": "tiny_copy:20", "b": "tiny_copy:3"}, eval_splits_limit=0)
    report.evaluate(lc, None, None, "before", lambda: None, progress=lambda *p: seen.append(p))
    assert seen == [("test", 8, 8), ("a", 20, 20), ("b", 3, 3)]


def test_evaluate_puts_the_splits_beside_eval_data(monkeypatch):
    _fake_greedy(monkeypatch)
    lc = _section(eval_splits={"a": "tiny_copy:20", "b": "tiny_copy:3"}, eval_splits_limit=0)
    before = report.evaluate(lc, None, None, "before", lambda: None)
    assert (before["n"], sorted(before["splits"]), before["splits"]["a"]["n"]) == (8, ["a", "b"], 20)
    after = report.evaluate(lc, None, None, "after", lambda: None, splits={"a"})
    assert list(after["splits"]) == ["a"]
    assert set(report.summary(lc, RunState(run_id="r", eval_before=before, eval_after=after))["eval_splits"]) == {"a"}
    assert report.evaluate(_section(eval_splits={}), None, None, "before", lambda: None)["splits"] == {}


def test_a_config_file_sets_the_splits_instead_of_adding_to_the_defaults(tmp_path, monkeypatch):
    """Regression (newcomer report): through the config loader, `eval_splits: {}` kept both
    default splits and `{only: ...}` came out as the defaults plus `only` (the loader merges a
    value into a dict default), so tiny.yaml's tests evaluated the arithmetic splits."""
    from steadyrl.config import load
    from steadyrl.services.learner.config import DEFAULT_EVAL_SPLITS, LearnerConfig

    root = Path(__file__).resolve().parents[3]
    monkeypatch.chdir(root)
    assert load(LearnerConfig, ["--config", "configs/tiny.yaml"]).learner.harder_splits == {}
    one = tmp_path / "one.yaml"
    one.write_text("learner:\n  eval_splits: {only: data/arithmetic/test_level04.parquet}\n")
    assert load(LearnerConfig, ["--config", str(one)]).learner.harder_splits == {
        "only": "data/arithmetic/test_level04.parquet"}
    assert load(LearnerConfig, []).learner.harder_splits == DEFAULT_EVAL_SPLITS


def test_the_curve_shows_reward_and_its_mean_and_each_split_with_whiskers(tmp_path):
    """Issue 38: curve.png drew reward and accuracy on one axis, without whiskers, titled GRPO
    for PPO runs."""
    import matplotlib.image

    ev = {"data": "d", "before": 0.25, "after": 0.5, "n": 8, "improved": 2, "regressed": 0, "delta": 0.25,
          "margin_95": 0.3, "mcnemar_p": 0.5, "learned": False}
    s = {"run_id": "r1", "model": "tiny", "algorithm": "ppo", "reward_per_step": [0.1, 0.3, 0.2, 0.4, 0.5, 0.6],
         "eval": ev, "eval_splits": {"level04": ev}}
    report.plot(s, tmp_path / "curve.png")
    assert matplotlib.image.imread(tmp_path / "curve.png").shape[:2] == (360, 1000)   # two panels side by side
    report.plot({**s, "eval_splits": {}, "eval": None} | {"eval": ev}, tmp_path / "one.png")
    assert report.rolling_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert report.accuracy_margin(0.5, 100) == pytest.approx(0.098)
    no_eval = {k: v for k, v in s.items() if k not in ("eval", "eval_splits")}
    report.plot(no_eval, tmp_path / "reward.png")
    assert matplotlib.image.imread(tmp_path / "reward.png").shape[:2] == (360, 600)

"""The per-step history lives in history.jsonl, not state.json: each step's save no longer
grows with the run (it did: state.json held every step's row and every trained prompt id,
5.5 MB and 131 ms a save at step 10 000; bench/state_save.py). A resume keeps the rows of the
saved step and before; a run written before the file moves its history into it."""

from __future__ import annotations

import json

from steadyrl.services.learner.parts import append_history
from steadyrl.services.learner.resume import trim_history
from steadyrl.services.learner.state import RunState
from steadyrl.testing.run import RunDir


def _row(step: int, reward: float = 0.5) -> dict:
    return {"step": step, "reward_mean": reward, "seconds": 1.0}


def test_state_json_holds_neither_history_nor_trained_ids():
    st = RunState(run_id="r1", step=1000, history=[_row(i) for i in range(1, 1001)],
                  trained=[f"p{i}" for i in range(8000)])
    saved = json.loads(st.model_dump_json())
    assert "history" not in saved and "trained" not in saved
    assert len(st.model_dump_json()) < 2000            # a few hundred bytes, whatever the step


def test_rows_beyond_the_saved_step_and_a_torn_line_are_dropped(tmp_path):
    for step in (1, 2, 3, 4):
        append_history(tmp_path, _row(step))
    with open(tmp_path / "history.jsonl", "a") as f:
        f.write('{"step": 5, "rew')                    # a crash mid-append
    st = RunState(run_id="r1", step=3)                 # resumed from the step-3 checkpoint
    trim_history(tmp_path, st)
    assert [r["step"] for r in st.history] == [1, 2, 3]
    assert [json.loads(line)["step"] for line in (tmp_path / "history.jsonl").read_text().splitlines()] == [1, 2, 3]
    append_history(tmp_path, _row(4, reward=0.9))      # the step trained again
    st.step = 4
    (tmp_path / "state.json").write_text(json.dumps({"run_id": "r1", "step": 4}))
    assert RunDir(tmp_path.parent, tmp_path.name).history == [_row(1), _row(2), _row(3), _row(4, 0.9)]


def test_a_run_from_before_the_file_moves_its_history_into_it(tmp_path):
    st = RunState(run_id="r1", step=2, history=[_row(1), _row(2), _row(3)])   # state.json's, as main wrote it
    trim_history(tmp_path, st)
    assert st.history == [_row(1), _row(2)]
    assert [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()] == st.history


def test_an_audit_line_cut_short_by_a_crash_is_dropped_not_fatal(tmp_path):
    """Regression: trim_audit parsed every consumed.jsonl line, so a line a crash cut short
    mid-append made every restart of the learner fail in json.loads."""
    from steadyrl.services.learner.resume import trim_audit

    path = tmp_path / "consumed.jsonl"
    path.write_text('{"step": 1, "prompt_id": "a"}\n{"step": 2, "prompt_id": "b"}\n{"step": 3, "prom')
    trim_audit(tmp_path, 2)
    assert [json.loads(line)["prompt_id"] for line in path.read_text().splitlines()] == ["a", "b"]
    trim_audit(tmp_path, 1)
    assert [json.loads(line)["prompt_id"] for line in path.read_text().splitlines()] == ["a"]

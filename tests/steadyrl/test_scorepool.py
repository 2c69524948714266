"""steadyrl.model.scorepool.ScoringPool: a user's reward item by item in worker processes with hard
limits (issue 46). A timeout kills and replaces the process, a crash costs its item, the
memory limit holds, the call's deadline bounds the wait; the pool serves on after each."""

import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from steadyrl.model.rewards import NotAReward, score_value
from steadyrl.model.scorepool import DEADLINE, ScoringLimits, ScoringPool, absolute_spec

REWARD = '''
import os, signal, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "pid":
        return {"score": 1.0, "pid": os.getpid()}
    if solution_str == "hang":
        time.sleep(600)
    if solution_str == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if solution_str == "alloc":
        hoard = []
        while True:
            hoard.append(bytearray(8 * 2**20))
    if solution_str == "cwd":
        return {"score": 1.0, "cwd": os.getcwd()}
    return 0.5
'''


def _item(response, truth="1"):
    return SimpleNamespace(data_source="d", prompt="p", response=response, ground_truth=truth, extra_info={})


@pytest.fixture
def pool(tmp_path, monkeypatch):
    (tmp_path / "r.py").write_text(REWARD)
    monkeypatch.chdir(tmp_path)
    with ScoringPool(1, item_timeout_s=0.5, memory_limit_mb=256) as p:
        yield p


def _pid(pool):
    [r] = pool.score("r.py:compute_score", [_item("pid")])
    return r["extra"]["pid"]


def test_a_timeout_kills_the_process_and_a_new_one_scores_the_next_item(pool):
    first = _pid(pool)
    t0 = time.monotonic()
    [r] = pool.score("r.py:compute_score", [_item("hang")])
    assert time.monotonic() - t0 < 3
    assert r["kind"] == "scorer_timeout" and "item_timeout_s (0.5 s)" in r["error"], r
    with pytest.raises(ProcessLookupError):
        os.kill(first, 0)   # killed
    assert _pid(pool) != first and pool.restarts["scorer_timeout"] == 1


def test_a_crash_costs_its_item_only(pool):
    out = pool.score("r.py:compute_score", [_item("x", "a"), _item("segv", "b"), _item("x", "c")])
    assert out[0] == out[2] == {"reward": 0.5, "extra": {}}
    assert out[1]["kind"] == "scorer_crash" and "killed by SIGSEGV" in out[1]["error"], out
    assert pool.restarts["scorer_crash"] == 1


def test_the_memory_limit_is_a_memory_error_of_the_item_and_the_process_goes_on(pool):
    before = _pid(pool)
    [r] = pool.score("r.py:compute_score", [_item("alloc")])
    assert r["kind"] == "scorer_error" and "MemoryError" in r["error"] and "memory_limit_mb 256" in r["error"], r
    assert _pid(pool) == before


def test_the_calls_deadline_bounds_it_what_waits_and_what_runs_are_left_not_failed(pool):
    t0 = time.monotonic()
    out = pool.score("r.py:compute_score", [_item("hang", "a"), _item("x", "b")], deadline=time.monotonic() + 0.3)
    assert time.monotonic() - t0 < 1.0
    assert [r.get("kind") for r in out] == [DEADLINE, DEADLINE], out   # not the scorer's failure
    assert "not scored before the call's deadline (running" in out[0]["error"]
    assert "not scored before the call's deadline (waiting" in out[1]["error"]
    assert pool.score("r.py:compute_score", [_item("x")]) == [{"reward": 0.5, "extra": {}}]


def test_the_processes_work_in_the_callers_folder_and_a_relative_file_is_made_absolute(pool, tmp_path):
    assert absolute_spec("r.py:compute_score") == f"{tmp_path}/r.py:compute_score"
    assert absolute_spec("numeric_match") == "numeric_match" and absolute_spec("pkg.mod:fn") == "pkg.mod:fn"
    [r] = pool.score("r.py:compute_score", [_item("cwd")])
    assert r["extra"]["cwd"] == str(tmp_path)


def test_a_spec_that_cannot_be_resolved_is_each_items_error(pool):
    [r] = pool.score("nowhere.py:fn", [_item("x")])
    assert r["kind"] == "scorer_error" and "nowhere.py" in r["error"], r


@pytest.mark.parametrize(("value", "kind"), [
    (float("nan"), "non_finite"), (float("inf"), "non_finite"), ("0.7", "scorer_error"), (True, "scorer_error"),
    (None, "scorer_error"), ({"pred": 1}, "scorer_error"), ({"score": "1"}, "scorer_error"),
    ({"score": 1.0, "x": float("nan")}, "non_finite"), ({"score": 1.0, "x": {1, 2}}, "scorer_error")])
def test_score_value_refuses_what_is_not_a_finite_reward(value, kind):
    with pytest.raises(NotAReward) as e:
        score_value(value)
    assert e.value.kind == kind


def test_score_value_takes_numpy_numbers_and_makes_extras_json():
    import numpy as np

    assert score_value(np.float32(0.5)) == (0.5, {})
    assert score_value(np.int64(1)) == (1.0, {})
    assert score_value({"score": np.float64(0.25), "n": np.int64(3), "ok": np.bool_(True), "v": np.arange(2),
                        "nested": {"a": [np.float32(1.5)]}}) == (0.25, {"n": 3, "ok": True, "v": [0, 1],
                                                                         "nested": {"a": [1.5]}})
    with pytest.raises(NotAReward):
        score_value(np.bool_(True))


SLOW_IMPORT = '''
import time
time.sleep(1.5)

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str)
'''


def test_a_load_the_deadline_cut_short_never_answers_for_an_item(tmp_path, monkeypatch):
    """Regression (review of issue 46): a load cut short by the deadline answered later, and
    that late answer was taken for the next item's, every reward one item off from then on."""
    (tmp_path / "slow.py").write_text(SLOW_IMPORT)
    monkeypatch.chdir(tmp_path)
    with ScoringPool(1, item_timeout_s=5.0) as p:
        [r] = p.score("slow.py:compute_score", [_item("0.1")], deadline=time.monotonic() + 0.3)
        assert r["kind"] == DEADLINE, r
        time.sleep(1.5)
        out = p.score("slow.py:compute_score", [_item("0.2", "a"), _item("0.3", "b"), _item("0.4", "c")])
        assert [x["reward"] for x in out] == [0.2, 0.3, 0.4], out
        assert p.score("slow.py:compute_score", [_item("0.5")])[0]["reward"] == 0.5


def test_whole_groups_are_done_by_the_deadline_and_a_hang_costs_its_group_one_timeout(tmp_path, monkeypatch):
    """Regression (review of issue 46): items went out in rounds over the groups, so a call the
    deadline cut short left every group a part short (all refused); and each item of a group
    that hangs took its own timeout."""
    (tmp_path / "r.py").write_text(REWARD)
    monkeypatch.chdir(tmp_path)
    with ScoringPool(1, item_timeout_s=0.5) as p:
        p.score("r.py:compute_score", [_item("x")])   # loaded
        items = [_item("hang", "h") for _ in range(4)] + [_item("x", "g") for _ in range(4)]
        t0 = time.monotonic()
        out = p.score("r.py:compute_score", items, deadline=time.monotonic() + 5.0)
        assert time.monotonic() - t0 < 3.0   # one timeout (0.5 s) and a restart, not four
        assert [r.get("kind") for r in out[:4]] == ["scorer_timeout"] * 4, out
        assert "another item of its group" in out[1]["error"]
        assert [r["reward"] for r in out[4:]] == [0.5] * 4


def test_an_item_timeout_as_long_as_the_call_is_refused():
    with pytest.raises(ValueError, match="item_timeout_s .* must be below call_deadline_s"):
        ScoringLimits(item_timeout_s=30, call_deadline_s=25)


def test_a_module_in_the_callers_folder_does_not_shadow_the_standard_library(tmp_path, monkeypatch):
    """Regression (review of issue 46): `python -m` put the caller's folder first on sys.path."""
    (tmp_path / "r.py").write_text(REWARD)
    (tmp_path / "random.py").write_text("raise RuntimeError('shadowed')\n")
    monkeypatch.chdir(tmp_path)
    with ScoringPool(1, item_timeout_s=5.0) as p:
        assert p.score("r.py:compute_score", [_item("x")]) == [{"reward": 0.5, "extra": {}}]


def test_a_load_the_deadline_cut_short_is_taken_when_another_scorers_item_runs_meanwhile(tmp_path, monkeypatch):
    """Found in review (issue 48's pool of loaded specs): scorer B's load cut short by a call's
    deadline, then an item of the loaded scorer A on the same process. A's read of its answer
    dropped B's "loaded" reply, and every later B item waited for a reply that had come: its
    whole deadline each, and after START_TIMEOUT_S a scorer_crash. Each B item now scores at once."""
    (tmp_path / "a.py").write_text("def fa(data_source, solution_str, ground_truth, extra_info=None):\n"
                                   "    return 1.0\n")
    (tmp_path / "b.py").write_text("import time\ntime.sleep(1.0)\n"
                                   "def fb(data_source, solution_str, ground_truth, extra_info=None):\n"
                                   "    return 0.5\n")
    monkeypatch.chdir(tmp_path)
    with ScoringPool(1, 5.0) as p:
        assert p.score("a.py:fa", [_item("1")], deadline=time.monotonic() + 30)[0]["reward"] == 1.0
        assert p.score("b.py:fb", [_item("1")], deadline=time.monotonic() + 0.3)[0]["kind"] == DEADLINE
        assert p.score("a.py:fa", [_item("1")], deadline=time.monotonic() + 30)[0]["reward"] == 1.0
        for _ in range(2):
            t0 = time.monotonic()
            assert p.score("b.py:fb", [_item("1")], deadline=time.monotonic() + 5)[0]["reward"] == 0.5
            assert time.monotonic() - t0 < 2.0


def test_a_pool_whose_caller_is_pid_1_scores(tmp_path):
    """Found by the compose test: in a container the learner (or reward server) is PID 1, and
    its scoring processes took a parent of PID 1 for a dead caller and left at once, so every
    item was 'its process did not start or load it within 60 s' and the learner exited 2 at
    its evaluation, restarted for ever. Here the caller is PID 1 of a new PID namespace."""
    import subprocess
    import sys

    (tmp_path / "r.py").write_text("def fa(data_source, solution_str, ground_truth, extra_info=None):\n"
                                   "    return 0.25\n")
    code = ("import os, time\nfrom types import SimpleNamespace as S\n"
            "from steadyrl.model.scorepool import ScoringPool\n"
            "assert os.getpid() == 1\n"
            "with ScoringPool(1, 5.0) as p:\n"
            "    it = S(data_source='d', prompt='p', response='r', ground_truth='g', extra_info={})\n"
            "    print(p.score('r.py:fa', [it], deadline=time.monotonic() + 30)[0])\n")
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a PID namespace here: {probe.stderr.decode().strip()}")
    done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", code],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert done.returncode == 0 and "'reward': 0.25" in done.stdout, done.stdout + done.stderr

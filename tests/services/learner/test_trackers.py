"""Experiment trackers (services/learner/trackers.py): verl's names for the history row, every
tracker's record read back with its own reader, a resumed run's record holding each step once,
and a tracker that fails logging one error while training goes on."""

import json
import logging
import math
import threading
import time

import pytest
from pydantic import ValidationError

from steadyrl.services.learner.config import LearnerSection
from steadyrl.services.learner.tracker_kinds import RENAME, STEP_KEY, mlflow_uri, tracked
from steadyrl.services.learner.trackers import Trackers
from tests.services.learner import tracker_readers as read
from tests.services.learner.conftest import Msg, scored

ALL = ["console", "tensorboard", "mlflow", "wandb", "jsonl"]


def _fill(learner, seed=0):
    learner.feeder.top_up()
    for i, pid in enumerate(list(learner.state.in_flight)):
        if pid not in learner.intake.ready:
            learner.intake.accept(Msg(scored(learner.state, pid, seed=seed), pid, offset=100 * seed + i))


def _steps(lrn, n: int, seed0: int = 0) -> None:
    for i in range(n):
        _fill(lrn, seed=seed0 + i)
        assert lrn.train_step() is not None


def _start(lrn) -> None:
    """What run() does before the loop: version 0 published, the trackers started."""
    lrn.store.publish(lrn.model, lrn.state)
    lrn.trackers.start(lrn.state.run_id, lrn.tracker_config(), lrn.resumed, lrn.state.history)


def test_the_history_row_is_logged_under_verls_names():
    row = {"step": 3, "reward_mean": 0.5, "reward_std": 0.1, "tokens": 100, "total_tokens": 160, "seconds": 2.0,
           "tokens_per_s": 50.0, "policy_versions": [1, 2], "cache_scored": 0, "time": 1.7e9,
           "actor/pg_loss": -0.2, "actor/pg_clipfrac": 0.01, "actor/ppo_kl": 1e-4, "actor/entropy": 2.5,
           "timing_s/update_actor": 0.7, "timing_s/wait": 1.1, "perf/safe_mode": 0.0}
    m = tracked(row)
    assert m["critic/score/mean"] == 0.5 and m["critic/score/std"] == 0.1
    assert m["timing_s/step"] == 2.0 and m["perf/time_per_step"] == 2.0
    assert m["perf/total_num_tokens"] == 160 and m["perf/throughput"] == 80.0   # verl: tokens / step time
    assert m["actor/pg_loss"] == -0.2 and m["actor/pg_clipfrac"] == 0.01 and m["timing_s/update_actor"] == 0.7
    assert m["steadyrl/staleness/max"] == 1 and m["steadyrl/staleness/min"] == 0
    assert m[STEP_KEY] == 3
    assert not {"step", "time", "policy_versions", "reward_mean", "seconds"} & set(m)
    assert all(isinstance(v, float) for v in m.values())
    # a row of an older run (fewer keys): fewer figures, none made up
    old = tracked({"step": 1, "reward_mean": 0.25, "seconds": 1.0})
    assert old == {"critic/score/mean": 0.25, "timing_s/step": 1.0, "perf/time_per_step": 1.0, STEP_KEY: 1.0}
    assert set(RENAME.values()) & {"critic/score/mean", "timing_s/step", "perf/total_num_tokens"}


def test_the_docs_table_names_every_renamed_key():
    from tests.helpers import ROOT

    doc = (ROOT / "docs" / "trackers.md").read_text()
    for ours, theirs in RENAME.items():
        assert f"`{ours}`" in doc and f"`{theirs}`" in doc, ours


def test_trackers_setting():
    assert LearnerSection().trackers == ["jsonl"]
    assert LearnerSection(trackers=["wandb", "jsonl", "wandb"]).trackers == ["wandb", "jsonl"]
    with pytest.raises(ValidationError, match="trackers"):
        LearnerSection(trackers=["neptune"])


def test_every_tracker_holds_every_metric_of_every_step(make_learner, capsys):
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    lrn = make_learner(trackers=ALL)
    _start(lrn)
    _steps(lrn, 2)
    for name in ("summary.json", "curve.png"):
        (lrn.run_dir / name).write_text("{}" if name.endswith("json") else "png")
        lrn.trackers.artifact(lrn.run_dir / name)
    lrn.trackers.close()
    want = {h["step"]: tracked(h) for h in lrn.state.history}
    assert list(want) == [1, 2] and "actor/pg_loss" in want[1] and "timing_s/update_actor" in want[1]

    tb, tb_n = read.tensorboard(lrn.run_dir / "tensorboard")
    ids = json.loads((lrn.run_dir / "trackers.json").read_text())
    uri = mlflow_uri(lrn.lc.state_dir)
    ml, ml_n = read.mlflow(uri, ids["mlflow_run_id"])
    wb, wb_n = read.wandb_offline(lrn.run_dir / "wandb")
    js, js_n = read.jsonl(lrn.run_dir / "metrics.jsonl")
    for name, got, n in (("tensorboard", tb, tb_n), ("mlflow", ml, ml_n), ("wandb", wb, wb_n), ("jsonl", js, js_n)):
        assert dict(n) == {1: 1, 2: 1}, (name, n)
        for step, metrics in want.items():
            for k, v in metrics.items():
                assert k in got[step], (name, step, k)
                assert math.isnan(v) or math.isclose(got[step][k], v, rel_tol=1e-6, abs_tol=1e-9), \
                    (name, step, k, got[step][k], v)
    out = capsys.readouterr().out
    assert "step:1 - " in out and "actor/pg_loss:" in out and "step:2 - " in out

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(ids["mlflow_run_id"])
    assert run.data.tags["steadyrl.run_id"] == lrn.state.run_id and run.data.tags["steadyrl.model"] == "tiny"
    assert run.data.params["learner.model"] == "tiny" and run.data.params["run_id"] == lrn.state.run_id
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"summary.json", "curve.png"}
    assert run.info.status == "FINISHED"
    files = {p.name for p in (lrn.run_dir / "wandb").rglob("*") if p.is_file()}
    assert {"summary.json", "curve.png"} <= files


def test_a_resumed_run_has_each_step_once_in_every_tracker(make_learner, tmp_path):
    """Three steps logged, then a restart that continues from step 1 (a checkpoint's history):
    steps 2 and 3 are redone. Every tracker ends with steps 1..4, each once."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    lrn = make_learner(trackers=ALL, steps=4)
    _start(lrn)
    _steps(lrn, 3)
    run_dir, run_id = lrn.run_dir, lrn.state.run_id
    history = [dict(h) for h in lrn.state.history]
    lrn.trackers.close()

    # the restart: the same run folder, the history of step 1 (what the checkpoint held)
    again = Trackers.of(lrn.lc, run_dir, {"steadyrl.run_id": run_id})
    again.start(run_id, lrn.tracker_config(), 1, history[:1])
    for h in history[1:]:
        again.log(h["step"], h)
    again.log(4, {**history[-1], "step": 4})
    assert [t.name for t in again.on] == ALL        # none failed
    again.close()

    for name, (got, n) in {"tensorboard": read.tensorboard(run_dir / "tensorboard"),
                           "mlflow": read.mlflow(mlflow_uri(lrn.lc.state_dir),
                                                 json.loads((run_dir / "trackers.json").read_text())["mlflow_run_id"]),
                           "wandb": read.wandb_offline(run_dir / "wandb"),
                           "jsonl": read.jsonl(run_dir / "metrics.jsonl")}.items():
        assert dict(n) == {1: 1, 2: 1, 3: 1, 4: 1}, (name, n)
        assert got[1]["critic/score/mean"] == pytest.approx(history[0]["reward_mean"]), name


def test_a_tracker_that_cannot_write_logs_one_error_and_training_goes_on(make_learner, tmp_path, caplog):
    """TensorBoard pointed under a regular file (unwritable for root too) and MLflow at a URI no
    store takes: each logs one error line at start; the steps train and jsonl still has them."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file")
    lrn = make_learner(trackers=["tensorboard", "mlflow", "jsonl"], tensorboard_dir=blocker / "tb",
                       mlflow_tracking_uri="nosuchscheme://nowhere")
    with caplog.at_level(logging.ERROR, logger="steadyrl.learner"):
        _start(lrn)
        _steps(lrn, 3)
        lrn.trackers.artifact(lrn.run_dir / "state.json")
        lrn.trackers.close()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name == "steadyrl.learner"]
    assert sorted(getattr(r, "tracker", "") for r in errors) == ["mlflow", "tensorboard"], \
        [(r.getMessage(), r.__dict__.get("error")) for r in errors]
    assert all(r.getMessage() == "experiment tracker failed; it is off for the rest of this process" for r in errors)
    assert lrn.state.step == 3
    assert dict(read.jsonl(lrn.run_dir / "metrics.jsonl")[1]) == {1: 1, 2: 1, 3: 1}


def test_a_tracker_failing_mid_run_is_turned_off_once(make_learner, caplog, monkeypatch):
    from steadyrl.services.learner import trackers

    lrn = make_learner(trackers=["console", "jsonl"])
    _start(lrn)
    calls = []

    def broken(self, step, metrics):
        calls.append(step)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(trackers.Console, "log", broken)
    with caplog.at_level(logging.ERROR, logger="steadyrl.learner"):
        _steps(lrn, 3)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name == "steadyrl.learner"]
    assert len(errors) == 1 and errors[0].tracker == "console" and "No space left" in errors[0].error
    assert calls == [1] and lrn.state.step == 3
    assert dict(read.jsonl(lrn.run_dir / "metrics.jsonl")[1]) == {1: 1, 2: 1, 3: 1}


def test_a_tracker_whose_library_is_missing_logs_one_error(make_learner, caplog, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_wandb(name, *a, **kw):
        if name == "wandb" or name.startswith("wandb."):
            raise ModuleNotFoundError("No module named 'wandb'")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    lrn = make_learner(trackers=["wandb", "jsonl"])
    with caplog.at_level(logging.ERROR, logger="steadyrl.learner"):
        _start(lrn)
        _steps(lrn, 1)
        lrn.trackers.close()   # W&B runs on its own thread: its error is in once it has drained
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name == "steadyrl.learner"]
    assert [r.tracker for r in errors] == ["wandb"] and "No module named" in errors[0].error
    assert lrn.state.step == 1


# ---- a slow or hung tracker never holds up the learner's loop --------------------------------

class Gate:
    """A remote tracker whose calls named in `hold` wait for `release` (a server that does not
    answer); it records the calls it made."""

    name = "gate"

    def __init__(self, hold=("start",)):
        self.hold, self.release, self.entered = set(hold), threading.Event(), threading.Event()
        self.calls: list = []

    def _wait(self, during):
        if during in self.hold:
            self.entered.set()
            assert self.release.wait(60), "the test never released the tracker"

    def start(self, run_id, config, resumed, history):
        self.calls.append("start")
        self._wait("start")

    def log(self, step, metrics):
        self.calls.append(step)
        self._wait("log")

    def artifact(self, path):
        self.calls.append(path.name)

    def close(self):
        self.calls.append("close")
        self._wait("close")


def _sample(name: str, tracker: str = "gate") -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, {"tracker": tracker}) or 0.0


def _until(cond, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_full_queue_drops_with_a_count_never_blocks_and_jsonl_stays_complete(tmp_path):
    """The remote tracker is stuck in its start; its queue holds 2 calls. 10 steps are logged
    on a thread of the test's: they all return (the logging thread ends while the tracker is
    still stuck), 8 of the 10 are dropped and counted, and the jsonl record has all 10."""
    from steadyrl.services.learner.tracker_kinds import Jsonl

    gate = Gate(hold=("start",))
    t = Trackers([Jsonl(tmp_path), gate], queue_size=2, timeout_s=60)
    dropped0 = _sample("steadyrl_learner_tracker_dropped_total")
    t.start("run", {}, None, [])
    assert gate.entered.wait(30)          # its thread is in start(): the queue is empty
    rows = [{"step": s, "reward_mean": s / 10} for s in range(1, 11)]
    logger = threading.Thread(target=lambda: [t.log(r["step"], r) for r in rows])
    logger.start()
    logger.join(timeout=30)
    assert not logger.is_alive(), "Trackers.log blocked on a tracker that does not answer"
    assert not gate.release.is_set() and gate.calls == ["start"]
    assert _sample("steadyrl_learner_tracker_dropped_total") - dropped0 == 8
    assert t.workers["gate"].dropped == 8 and _sample("steadyrl_learner_tracker_queued") == 2
    assert dict(read.jsonl(tmp_path / "metrics.jsonl")[1]) == dict.fromkeys(range(1, 11), 1)
    gate.release.set()
    t.close()
    assert gate.calls == ["start", 1, 2, "close"]      # what its queue held, in order; then closed
    assert [x.name for x in t.on] == []


def test_a_hung_tracker_is_reported_and_left_behind_and_answers_again(tmp_path, caplog):
    """A call past timeout_s: one error line naming the tracker and the call, the hung gauge
    at 1; when it returns, a line saying so and the gauge at 0. Hung again at the end: close
    does not wait for it, says it is left behind, and the local tracker is complete."""
    from steadyrl.services.learner.tracker_kinds import Jsonl

    gate = Gate(hold=("log",))
    t = Trackers([Jsonl(tmp_path), gate], queue_size=4, timeout_s=0.2)
    with caplog.at_level(logging.INFO, logger="steadyrl.learner"):
        t.start("run", {}, None, [])
        t.log(1, {"step": 1, "reward_mean": 0.5})
        _until(lambda: _sample("steadyrl_learner_tracker_hung") == 1, "the hang was not reported")
        hung = [r for r in caplog.records
                if r.getMessage() == "experiment tracker hangs; the learner goes on without it"]
        assert len(hung) == 1 and hung[0].levelno == logging.ERROR
        assert (hung[0].tracker, hung[0].during) == ("gate", "log") and hung[0].seconds >= 0.2
        assert t.check() == ["gate"] and len([r for r in caplog.records if "hangs" in r.getMessage()]) == 1  # once

        gate.release.set()
        _until(lambda: _sample("steadyrl_learner_tracker_hung") == 0, "its return was not noticed")
        assert any(r.getMessage() == "experiment tracker answered again" for r in caplog.records)

        gate.release.clear()
        t.log(2, {"step": 2, "reward_mean": 0.6})
        _until(lambda: t.check() == ["gate"], "the second hang was not reported")
        t.log(3, {"step": 3, "reward_mean": 0.7})
        t.close()           # returns while the tracker is still in log(2)
    assert t.workers["gate"].thread.is_alive() and gate.calls == ["start", 1, 2]
    behind = [r for r in caplog.records if r.getMessage() == "experiment tracker left behind at the end"]
    assert len(behind) == 1 and behind[0].tracker == "gate" and behind[0].during == "log" and behind[0].queued == 1
    assert dict(read.jsonl(tmp_path / "metrics.jsonl")[1]) == {1: 1, 2: 1, 3: 1}
    gate.release.set()
    _until(lambda: not t.workers["gate"].thread.is_alive(), "the left-behind thread did not end")
    assert gate.calls == ["start", 1, 2]      # left behind: nothing more is done with it, not even close


def test_close_waits_for_a_slow_tracker_beating_meanwhile():
    """A tracker still busy (not hung) at the end: close waits for it, calling the heartbeat
    while it does (the tracker's close returns only after two beats)."""
    beats = []
    gate = Gate(hold=("close",))
    t = Trackers([gate], timeout_s=120, beat=lambda: (beats.append(1), len(beats) >= 2 and gate.release.set()))
    t.start("run", {}, None, [])
    t.close()
    assert gate.calls == ["start", "close"] and len(beats) >= 2 and not t.workers["gate"].thread.is_alive()


def test_a_new_mlflow_store_is_made_whole_before_it_is_used(tmp_path):
    """The SQLite store is created beside its place and renamed in: a half-made one that a
    killed start left (`.tmp-<pid>`, here garbage) is removed, and the store opens."""
    pytest.importorskip("mlflow")
    from steadyrl.services.learner.tracker_kinds import _new_sqlite_store

    db = tmp_path / "mlflow.db"
    (tmp_path / "mlflow.db.tmp-999999").write_text("half a store")
    _new_sqlite_store(mlflow_uri(tmp_path))
    assert db.is_file() and not list(tmp_path.glob("mlflow.db.tmp-*"))
    from mlflow.tracking import MlflowClient

    assert [e.name for e in MlflowClient(tracking_uri=mlflow_uri(tmp_path)).search_experiments()] == ["Default"]
    before = db.stat().st_mtime_ns
    _new_sqlite_store(mlflow_uri(tmp_path))    # there already: left as it is
    assert db.stat().st_mtime_ns == before

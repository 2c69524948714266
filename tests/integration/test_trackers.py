"""The tiny pipeline under `steadyrl up` with every experiment tracker on (issue 24): each
tracker's own reader finds every metric of every step, once, across a learner SIGKILLed and
resumed from a checkpoint (redoing the steps after it)."""

from __future__ import annotations

import json
import math
import os
import signal

import pytest

from steadyrl.services.learner.tracker_kinds import mlflow_uri, tracked
from tests.integration.test_pipeline import Up, _config
from tests.services.learner import tracker_readers as read

ALL = ["console", "tensorboard", "mlflow", "wandb", "jsonl"]

pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")
pytest.importorskip("wandb")


def _records(run) -> dict:
    ids = json.loads((run.path / "trackers.json").read_text())
    uri = mlflow_uri(run.state_dir)
    return {"tensorboard": read.tensorboard(run.path / "tensorboard"),
            "mlflow": read.mlflow(uri, ids["mlflow_run_id"]),
            "wandb": read.wandb_offline(run.path / "wandb"),
            "jsonl": read.jsonl(run.path / "metrics.jsonl")}


def _check_every_step_once(run, steps: int, redone: bool = False) -> None:
    """Every tracker holds steps 1..steps once, with every figure of the history's rows. After a
    redo (`redone`), MLflow and W&B keep a redone step's first values (they cannot delete a
    point): on max_staleness 0 its training figures are the same bits, its timings are not."""
    want = {h["step"]: tracked(h) for h in run.history}
    assert sorted(want) == list(range(1, steps + 1))
    for name, (got, times) in _records(run).items():
        assert dict(times) == dict.fromkeys(range(1, steps + 1), 1), (name, times)
        first_kept = redone and name in ("mlflow", "wandb")
        for step, metrics in want.items():
            missing = set(metrics) - set(got[step])
            assert not missing, (name, step, sorted(missing))
            for k, v in metrics.items():
                if first_kept and k.startswith(("timing_s/", "perf/")):
                    continue
                assert math.isnan(v) or math.isclose(got[step][k], v, rel_tol=1e-6, abs_tol=1e-9), (name, step, k)


@pytest.mark.slow
def test_every_tracker_has_every_step_once_across_a_learner_kill(bootstrap, tmp_path):
    """Every tracker on; checkpoints every 3 steps; SIGKILL at step 5 of 10: the restart goes on
    from step 3's checkpoint and redoes steps 4 and 5. Each tracker's own reader finds every
    metric of every step, each step once; the summary and curve are MLflow artifacts; the
    config, run id and data are its params and tags. (Every tracker's values without a redo,
    exactly: tests/services/learner/test_trackers.py.)"""
    steps = 10
    up = Up(bootstrap, tmp_path, _config(tmp_path, steps=steps, trackers=ALL, checkpoint_every=3,
                                         max_staleness=0, eval_data=None))
    try:
        up.wait_step(5)
        os.kill(up.child_pid("learner-0"), signal.SIGKILL)
        rc = up.proc.wait(300)
    finally:
        up.close()
    out = up.log()
    assert rc == 0, out[-4000:]
    assert "learner-0       | exited with -9" in out and "resuming run from checkpoint" in out
    assert "experiment tracker failed" not in out, out[-4000:]
    run = up.run()
    _check_every_step_once(run, steps, redone=True)
    assert len(list((run.path / "wandb").rglob("*.wandb"))) == 2   # one offline folder per start, one id
    assert "step:10 - " in out and "actor/pg_clipfrac:" in out     # the console tracker
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_uri(run.state_dir))
    mrun = client.get_run(json.loads((run.path / "trackers.json").read_text())["mlflow_run_id"])
    assert {a.path for a in client.list_artifacts(mrun.info.run_id)} == {"summary.json", "curve.png"}
    assert mrun.data.tags["steadyrl.data"] == "tiny_copy:256" and mrun.data.tags["steadyrl.run_id"] == run.run_id
    assert mrun.data.params["learner.steps"] == str(steps) and mrun.info.status == "FINISHED"


@pytest.mark.slow
def test_a_hung_tracker_server_does_not_fail_the_learners_liveness(bootstrap, tmp_path):
    """MLflow pointed at a server that takes the connection and never answers (a hung tracking
    server; MLflow's client waits 120 s a request, then retries), for the whole run; the
    learner's liveness window 5 s. While the learner steps, every /livez answers 200, for many
    windows; the steps keep rising; the hang is reported (a log line, the hung gauge at 1, the
    calls its full queue dropped counted); the run ends (the tracker left behind) and the jsonl
    record has every step (issue 34). The watch is timed, not counted in steps: CI's machine ran
    200 tiny steps in 11 s, under the three windows this test needs."""
    import socket
    import time

    import httpx

    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)           # connections complete in the kernel; nobody ever reads or answers
    steps, window_s = 600, 5
    up = Up(bootstrap, tmp_path, _config(tmp_path, steps=steps, trackers=["mlflow", "jsonl"], eval_data=None,
                                         mlflow_tracking_uri=f"http://127.0.0.1:{hung.getsockname()[1]}",
                                         tracker_timeout_s=1.0, tracker_queue=2),
            env={"STEADYRL_LIVENESS_TIMEOUT_S": str(window_s)})
    try:
        up.wait_step(2)
        learner = up.url(8400)
        first = up.progress()["step"]
        t0, codes, seen = time.monotonic(), [], first
        while seen < steps - 2 and time.monotonic() - t0 < 4 * window_s:
            codes.append(httpx.get(f"{learner}/livez", timeout=5).status_code)
            seen = up.progress().get("step") or seen
            assert up.proc.poll() is None and time.monotonic() - t0 < 300, up.log()[-4000:]
            time.sleep(0.2)
        watched = time.monotonic() - t0
        metrics = httpx.get(f"{learner}/metrics", timeout=5).text
        rc = up.wait(600)
    finally:
        up.close()
        hung.close()
    out = up.log()
    assert rc == 0, out[-4000:]
    assert watched > 3 * window_s and set(codes) == {200}, (watched, codes)   # several liveness windows, all live
    assert seen - first >= 10
    assert 'steadyrl_learner_tracker_hung{tracker="mlflow"} 1.0' in metrics
    dropped = [float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith('steadyrl_learner_tracker_dropped_total{tracker="mlflow"}')]
    assert dropped and dropped[0] > 0, metrics[-2000:]
    assert "experiment tracker hangs; the learner goes on without it" in out
    assert "experiment tracker left behind at the end" in out
    assert dict(read.jsonl(up.run().path / "metrics.jsonl")[1]) == dict.fromkeys(range(1, steps + 1), 1)

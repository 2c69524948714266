"""The tiny pipeline under `steadyrl up` with every experiment tracker on (issue 24): each
tracker's own reader finds every metric of every step, once, across a learner SIGKILLed and
resumed from a checkpoint (redoing the steps after it)."""

from __future__ import annotations

import json
import math
import os
import signal

import pytest

from services.learner.trackers import mlflow_uri, tracked
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
        assert dict(times) == {s: 1 for s in range(1, steps + 1)}, (name, times)
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

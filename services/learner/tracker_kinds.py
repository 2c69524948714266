"""The experiment trackers themselves (`learner.trackers`: console, tensorboard, mlflow, wandb,
jsonl), one small class each behind trackers.Tracker, each through its own library;
trackers.Trackers runs them and keeps a failing or slow one from the learner.

What a tracker gets is `tracked(row)`: the history row of a step (parts.history_row, saved in
state.json) under verl's names (`RENAME`; docs/trackers.md has the table). Because the
history is saved with the run state and restored with a checkpoint, a resumed run hands each
tracker the history it continues from, and each tracker makes its record equal to it, each
step once:

- jsonl: `metrics.jsonl` in the run folder is rewritten from the history on resume;
- tensorboard: the same log dir, opened with `purge_step=0` (TensorBoard's readers drop
  everything logged before that point) and the history logged again: a step redone after a
  crash, or one lost in the writer's buffer by a SIGKILL, appears once;
- mlflow: the same MLflow run (default store: `<state_dir>/mlflow.db`, SQLite; the run's id
  in `<run_dir>/trackers.json`); the steps the store already holds (read back from it) are not
  logged again, missing ones are (MLflow cannot delete a point: a redone step keeps its first
  values);
- wandb: the same run id (the learner's run id) with `resume="allow"`; each start logs the
  history again from the run's next step (offline: from step 1, into a new offline-run folder
  of the same id; `wandb sync` uploads them in order and W&B drops a step below the run's
  last, so each step lands once, first values kept);
- console: one line per step, as verl's console logger prints.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Literal

from steadyrl.files import write_atomic

log = logging.getLogger("steadyrl.learner")

#: Keys of the history row that are not verl's, and the name a tracker shows them under: verl's
#: where it has one (docs/trackers.md); steadyrl's own in verl's style otherwise.
RENAME = {
    "reward_mean": "critic/score/mean",          # verl: mean sequence score of the batch
    "reward_std": "critic/score/std",            # verl logs mean/max/min; std in its style
    "seconds": "timing_s/step",                  # verl: wall time of one step
    "tokens": "response_length/total",           # response tokens trained this step
    "tokens_per_s": "perf/response_tokens_per_s",
    "total_tokens": "perf/total_num_tokens",     # verl: prompt + response tokens of the batch
    "cache_scored": "steadyrl/cache_scored_groups",
}
#: Row keys that are bookkeeping, not figures.
SKIP = ("step", "policy_versions", "time")
#: The one key every step has: MLflow reads it back to know which steps its store holds.
STEP_KEY = "training/global_step"


def tracked(row: dict[str, Any]) -> dict[str, float]:
    """A history row as a tracker logs it: verl's names, finite-or-NaN floats, plus the derived
    figures verl has (`perf/throughput`, `perf/time_per_step`) and the staleness of the batch.
    Rows of older runs (fewer keys) give fewer figures; none is invented."""
    out: dict[str, float] = {}
    for k, v in row.items():
        if k in SKIP or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        out[RENAME.get(k, k)] = float(v)
    step = int(row["step"])
    out[STEP_KEY] = float(step)
    seconds = row.get("seconds")
    if isinstance(seconds, (int, float)) and seconds > 0:
        out["perf/time_per_step"] = float(seconds)
        if isinstance(row.get("total_tokens"), (int, float)):
            # verl: tokens / (step time x GPUs); the learner trains on one device
            out["perf/throughput"] = row["total_tokens"] / seconds
    versions = row.get("policy_versions")
    if versions:  # the update making version `step` from groups of older versions
        out["steadyrl/staleness/max"] = float(step - 1 - min(versions))
        out["steadyrl/staleness/min"] = float(step - 1 - max(versions))
    return out


def flat(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as dotted keys with string values (MLflow params, TensorBoard text)."""
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, (list, tuple)) else str(v)
    return out


class _Ids:
    """`<run_dir>/trackers.json`: what a tracker needs to find its run again (MLflow's run id),
    read and written whole."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "trackers.json"

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return json.loads(self.path.read_text()).get(key, default)
        except (OSError, ValueError):
            return default

    def set(self, key: str, value: Any) -> None:
        try:
            d = json.loads(self.path.read_text())
        except (OSError, ValueError):
            d = {}
        d[key] = value
        write_atomic(self.path, json.dumps(d, indent=2))


class Console:
    """verl's console logger: `step:N - name:value - ...` on stdout."""

    name = "console"
    local = True  # on the caller's thread (Trackers)

    def start(self, run_id: str, config: dict[str, Any], resumed: int | None, history: list[dict[str, Any]]) -> None:
        pass

    def log(self, step: int, metrics: dict[str, float]) -> None:
        items = " - ".join(f"{k}:{v:.4g}" for k, v in sorted(metrics.items()) if k != STEP_KEY)
        print(f"step:{step} - {items}", flush=True)  # noqa: T201  the console tracker: for the person

    def artifact(self, path: Path) -> None:
        pass

    def close(self) -> None:
        pass


class Jsonl:
    """`<run_dir>/metrics.jsonl`: one line per step ({"step": N, name: value, ...}), fsynced;
    rewritten from the history on resume, so a redone step appears once (verl's `file` logger)."""

    name = "jsonl"
    local = True  # on the caller's thread: the record stays complete (Trackers)

    def __init__(self, run_dir: Path):
        self.path = run_dir / "metrics.jsonl"

    @staticmethod
    def _line(step: int, metrics: dict[str, float]) -> str:
        return json.dumps({"step": step, **{k: (None if math.isnan(v) else v) for k, v in metrics.items()}}) + "\n"

    def start(self, run_id: str, config: dict[str, Any], resumed: int | None, history: list[dict[str, Any]]) -> None:
        if resumed is not None or self.path.exists():
            write_atomic(self.path, "".join(self._line(int(h["step"]), tracked(h)) for h in history))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        with open(self.path, "a") as f:
            f.write(self._line(step, metrics))
            f.flush()
            os.fsync(f.fileno())

    def artifact(self, path: Path) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoard:
    """TensorBoard event files through torch's SummaryWriter, in `log_dir` (one per run). A
    resumed run opens the same dir with purge_step=0 and logs its history again."""

    name = "tensorboard"

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.writer: Any = None
        self.step = 0

    def start(self, run_id: str, config: dict[str, Any], resumed: int | None, history: list[dict[str, Any]]) -> None:
        from torch.utils.tensorboard import SummaryWriter  # lazy: optional: tensorboard, only when the tracker is on

        again = resumed is not None or self.log_dir.exists()
        self.writer = SummaryWriter(str(self.log_dir), purge_step=0 if again else None, flush_secs=30)
        self.writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in sorted(flat(config).items())), 0)
        for h in history:
            self._add(int(h["step"]), tracked(h), h.get("time"))
        self.writer.flush()

    def _add(self, step: int, metrics: dict[str, float], walltime: float | None = None) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step, walltime=walltime)
        self.step = max(self.step, step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._add(step, metrics)
        self.writer.flush()

    def artifact(self, path: Path) -> None:
        if path.suffix == ".json":  # no artifact store: the summary as text, at the last step
            self.writer.add_text(path.stem, "    " + path.read_text().replace("\n", "\n    "), self.step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class MLflow:
    """An MLflow run (MlflowClient) in `tracking_uri` (default: a local SQLite store beside the
    run folders, artifacts in `artifact_location`), experiment `experiment`; its id kept in
    trackers.json. Params: the config (dotted keys); tags: run id, model, data and its
    provenance."""

    name = "mlflow"

    def __init__(self, tracking_uri: str, experiment: str, ids: _Ids, tags: dict[str, str],
                 artifact_location: str | None = None):
        self.uri, self.experiment, self.ids, self.tags = tracking_uri, experiment, ids, tags
        self.artifact_location = artifact_location
        self.client: Any = None
        self.run_id = ""
        self.logged: set[int] = set()

    def start(self, run_id: str, config: dict[str, Any], resumed: int | None, history: list[dict[str, Any]]) -> None:
        from mlflow.tracking import MlflowClient  # lazy: optional: mlflow, only when the tracker is on

        _new_sqlite_store(self.uri)
        self.client = client = MlflowClient(tracking_uri=self.uri)
        exp = client.get_experiment_by_name(self.experiment)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(
            self.experiment, artifact_location=self.artifact_location)
        saved = self.ids.get("mlflow_run_id")
        run = None
        if saved:
            try:
                run = client.get_run(saved)
            except Exception:  # noqa: BLE001 - another store, or the run was deleted: a new MLflow run
                run = None
        if run is None:
            run = client.create_run(exp_id, run_name=run_id, tags={"steadyrl.run_id": run_id, **self.tags})
            self.ids.set("mlflow_run_id", run.info.run_id)
        else:
            client.update_run(run.info.run_id, status="RUNNING")
        self.run_id = run.info.run_id
        have = run.data.params
        params = {k: v[:6000] for k, v in flat(config).items() if k not in have}  # a param never changes
        from mlflow.entities import Metric, Param  # lazy: optional: mlflow, only when the tracker is on

        for i in range(0, len(params), 100):
            chunk = list(params.items())[i:i + 100]
            client.log_batch(self.run_id, params=[Param(k, v) for k, v in chunk])
        self.logged = {int(m.step) for m in client.get_metric_history(self.run_id, STEP_KEY)}
        self._metric = Metric
        for h in history:
            if int(h["step"]) not in self.logged:
                self.log(int(h["step"]), tracked(h), h.get("time"))

    def log(self, step: int, metrics: dict[str, float], walltime: float | None = None) -> None:
        if step in self.logged:  # already in the store (a step redone after a crash): once
            return
        ms = int((walltime or time.time()) * 1000)
        rest = [self._metric(k, v, ms, step) for k, v in metrics.items() if k != STEP_KEY]
        for i in range(0, len(rest), 1000):
            self.client.log_batch(self.run_id, metrics=rest[i:i + 1000])
        # last: its presence in the store says the step is complete
        self.client.log_batch(self.run_id, metrics=[self._metric(STEP_KEY, float(step), ms, step)])
        self.logged.add(step)

    def artifact(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def close(self) -> None:
        if self.client is not None and self.run_id:
            self.client.set_terminated(self.run_id, status="FINISHED")


def _new_sqlite_store(uri: str) -> None:
    """Where `uri` names a SQLite file that is not there yet, make the store whole beside it and
    rename it into place: MLflow creates its tables in a series of migrations, and a learner
    killed between two (the start runs on the tracker's thread while the learner steps) would
    leave a store that no later start opens. A `.tmp-<pid>` a killed start left is removed."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix):
        return
    path = Path(uri[len(prefix):])
    if path.exists():
        return
    for stale in path.parent.glob(f"{path.name}.tmp-*"):
        stale.unlink(missing_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    from mlflow.tracking import MlflowClient  # lazy: optional: mlflow, only when the tracker is on

    MlflowClient(tracking_uri=f"{prefix}{tmp}").search_experiments(max_results=1)  # creates the tables
    os.replace(tmp, path)


class WandB:
    """A W&B run with the learner's run id as its id (`resume="allow"`: a resumed run continues
    it). Offline (files under `dir`, `wandb sync` uploads them) unless `mode` is online and
    WANDB_API_KEY is set."""

    name = "wandb"

    def __init__(self, dir: Path, project: str, mode: str, tags: dict[str, str]):
        self.dir, self.project, self.mode, self.tags = dir, project, mode, tags
        self.run: Any = None
        self.last = 0

    def start(self, run_id: str, config: dict[str, Any], resumed: int | None, history: list[dict[str, Any]]) -> None:
        import wandb  # lazy: optional: wandb, only when the tracker is on

        mode: Literal["online", "offline"] = (
            "online" if self.mode == "online" and os.environ.get("WANDB_API_KEY") else "offline")
        if self.mode == "online" and mode == "offline":
            log.warning("learner.wandb_mode is online but WANDB_API_KEY is not set: W&B runs offline",
                        extra={"dir": str(self.dir)})
        self.dir.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(console="off", silent=True, save_code=False, disable_git=True,
                                  x_disable_stats=True, x_disable_meta=True)
        self.run = wandb.init(project=self.project, id=run_id, name=run_id, resume="allow", mode=mode,
                              dir=str(self.dir), config=config, tags=[f"{k}={v}"[:64] for k, v in self.tags.items()],
                              settings=settings)
        # The run's next step: 0 offline (each start writes a new offline-run folder), the
        # server's on an online resume. Offline, the history goes into the new folder again:
        # `wandb sync` uploads a run's folders in order and W&B drops a step below the run's
        # last, so each step lands once, also one a SIGKILL lost in wandb's write buffer.
        self.last = int(getattr(self.run, "step", 0) or 0) - 1
        for h in history:
            self.log(int(h["step"]), tracked(h))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if step <= self.last:  # W&B refuses a step below its last: logged once, first values kept
            return
        self.run.log(metrics, step=step)
        self.last = step

    def artifact(self, path: Path) -> None:
        self.run.save(str(path), base_path=str(path.parent), policy="now")

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


def mlflow_uri(state_dir: Path) -> str:
    """The default MLflow store: one SQLite file for every run of the state dir (MLflow 3.13 and
    later refuse the filesystem store `./mlruns` unless MLFLOW_ALLOW_FILE_STORE is set)."""
    return f"sqlite:///{(Path(state_dir) / 'mlflow.db').resolve()}"

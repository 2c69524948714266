"""Experiment trackers: the learner's per-step metrics, under verl's names, in the trackers
people compare runs with (`learner.trackers`: console, tensorboard, mlflow, wandb, jsonl).

Each tracker is one small class behind one interface (`Tracker`): `start(run_id, config,
resumed)`, `log(step, metrics)`, `artifact(path)`, `close()`, each through the tracker's own
library. `Trackers` holds the configured ones and never lets one stop training: a tracker
whose call raises (an import error, an unwritable folder, a bad URI, a full disk) logs one
error line and is off for the rest of the process.

Nor does one slow the learner's loop, the thread that proves the process alive (/livez): the
local trackers (`jsonl`, the default, and `console`) write on the caller's thread, so the
`metrics.jsonl` record is complete; the others (tensorboard, mlflow, wandb: a library, a
server) each run their calls on their own thread, fed through a bounded queue
(`learner.tracker_queue`). A full queue drops the record and counts it
(`steadyrl_learner_tracker_dropped_total`), never blocks; a call running past
`learner.tracker_timeout_s` (a server that does not answer) is reported (one error line,
`steadyrl_learner_tracker_hung`) and the learner goes on without it; at the end the learner
waits that long at most for their queues to drain, and not at all for a hung one.

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

import contextlib
import json
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from prometheus_client import Counter, Gauge

from steadyrl.files import sha256_file, write_atomic

if TYPE_CHECKING:
    from .config import LearnerSection

log = logging.getLogger("steadyrl.learner")

DROPPED = Counter("steadyrl_learner_tracker_dropped", "Calls (a step's figures, an artifact) an experiment tracker's "
                  "queue had no room for: dropped, not waited for", ["tracker"])
HUNG = Gauge("steadyrl_learner_tracker_hung", "1 while an experiment tracker's call has run past "
             "learner.tracker_timeout_s (the learner goes on without it), else 0", ["tracker"])
QUEUED = Gauge("steadyrl_learner_tracker_queued", "Calls waiting in an experiment tracker's queue", ["tracker"])

NAMES = ("console", "tensorboard", "mlflow", "wandb", "jsonl")

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


class Tracker(Protocol):
    """One experiment tracker. `resumed`: the step a continued run goes on from (None: a new run);
    `history`: the run's rows up to it (the tracker's record is made equal to them)."""

    name: str

    def start(self, run_id: str, config: dict[str, Any], resumed: int | None,
              history: list[dict[str, Any]]) -> None: ...
    def log(self, step: int, metrics: dict[str, float]) -> None: ...
    def artifact(self, path: Path) -> None: ...
    def close(self) -> None: ...


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


#: one queued tracker call: (what it is, for the logs; the function; its arguments)
_Call = tuple[str, Callable[..., object], tuple[Any, ...]]


class _Worker:
    """One tracker's own thread and its bounded queue of calls. `put` never blocks: a full
    queue drops the call and counts it. A call that raises turns the tracker off (one error
    line, its `close` tried); `closing` set: the thread closes the tracker once the queue is
    empty, and ends."""

    def __init__(self, tracker: Tracker, size: int):
        self.tracker, self.name = tracker, tracker.name
        #: (during, fn, args) of each call; None: close()'s wake-up
        self.q: queue.Queue[_Call | None] = queue.Queue(maxsize=size)
        self.dropped = 0
        self.off = False
        self.closing = threading.Event()
        self.woken = False   # close() queued its wake-up (None)
        #: (during, time.monotonic() it began) of the call in progress, None between calls
        self.call: tuple[str, float] | None = None
        HUNG.labels(self.name).set(0)
        QUEUED.labels(self.name).set_function(self.q.qsize)
        DROPPED.labels(self.name)
        self.thread = threading.Thread(target=self._run, name=f"tracker-{self.name}", daemon=True)
        self.thread.start()

    def put(self, during: str, fn: Callable[..., object], *args: Any) -> bool:
        """Queue `fn(*args)`; False when the queue was full (dropped, counted) or the tracker is off."""
        if self.off or self.closing.is_set():
            return False
        try:
            self.q.put_nowait((during, fn, args))
            return True
        except queue.Full:
            self.dropped += 1
            DROPPED.labels(self.name).inc()
            if math.log10(self.dropped).is_integer():  # the 1st, 10th, 100th ...: not a line per step
                log.warning("experiment tracker is behind; its queue is full and calls are dropped",
                            extra={"tracker": self.name, "during": during, "dropped": self.dropped,
                                   "queue": self.q.maxsize})
            return False

    def _run(self) -> None:
        while True:
            try:
                item = self.q.get(timeout=0.5)
            except queue.Empty:
                item = None
            if item is None:  # close()'s wake-up, or a timeout: the queue is empty
                if self.closing.is_set():
                    break
                continue
            during, fn, args = item
            if self.off:
                continue
            self.call = (during, time.monotonic())
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001 - an import error, a bad URI or a full disk must not stop training
                _failed(self.tracker, during, e)
                self.off = True
            finally:
                self.call = None
        if not self.off:
            self.call = ("close", time.monotonic())
            try:
                self.tracker.close()
            except Exception as e:  # noqa: BLE001 - a tracker plugin's close must not stop the learner
                _failed(self.tracker, "close", e)
            self.call = None
        self.off = True


def _failed(t: Tracker, during: str, e: Exception) -> None:
    """Report a tracker whose call raised, and try its close (it is off from now on)."""
    log.error("experiment tracker failed; it is off for the rest of this process",
              extra={"tracker": t.name, "during": during, "error": f"{type(e).__name__}: {e}"})
    if during != "close":
        with contextlib.suppress(Exception):  # already reported once
            t.close()


class Trackers:
    """The configured trackers; a call that raises turns that tracker off with one error line.

    A local tracker (`local = True`: jsonl, console) runs on the caller's thread; any other
    runs on its own thread (`_Worker`), so no call here waits for it: its queue holds
    `queue_size` calls, past that a call is dropped (counted). A call running longer than
    `timeout_s` is reported hung once (an error line, the `steadyrl_learner_tracker_hung`
    gauge at 1) and answered again when it returns; `close` waits up to `timeout_s` for the
    others to drain and close, calling `beat` meanwhile, and leaves a hung or late one behind
    (a warning line; its thread is a daemon, and nothing more is done with it).
    """

    def __init__(self, trackers: list[Tracker], queue_size: int = 1000, timeout_s: float = 60.0,
                 beat: Callable[[], None] = lambda: None):
        self.timeout_s, self.beat = timeout_s, beat
        self._all = list(trackers)
        self._local = [t for t in trackers if getattr(t, "local", False)]
        self._off: set[str] = set()   # local trackers turned off
        self.workers = {t.name: _Worker(t, queue_size) for t in trackers if not getattr(t, "local", False)}
        self._hung: dict[str, tuple[str, float]] = {}   # tracker -> the call reported hung
        self._lock = threading.Lock()   # check() runs on the watch thread and in close()
        self._done = threading.Event()
        if self.workers:
            threading.Thread(target=self._watch, name="tracker-watch", daemon=True).start()

    @property
    def on(self) -> list[Tracker]:
        """The trackers not turned off, in their configured order."""
        return [t for t in self._all if not (self.workers[t.name].off if t.name in self.workers
                                             else t.name in self._off)]

    @classmethod
    def of(cls, lc: LearnerSection, run_dir: Path, tags: dict[str, str],
           beat: Callable[[], None] = lambda: None) -> Trackers:
        """The trackers `lc.trackers` names (lc: a LearnerSection), for the run in `run_dir`;
        `beat`: the liveness heartbeat, called while `close` waits."""
        ids = _Ids(run_dir)
        made: dict[str, Any] = {
            "console": lambda: Console(),
            "jsonl": lambda: Jsonl(run_dir),
            "tensorboard": lambda: TensorBoard(Path(lc.tensorboard_dir) / run_dir.name if lc.tensorboard_dir
                                               else run_dir / "tensorboard"),
            "mlflow": lambda: (MLflow(lc.mlflow_tracking_uri, lc.mlflow_experiment, ids, tags)
                               if lc.mlflow_tracking_uri else
                               MLflow(mlflow_uri(lc.state_dir), lc.mlflow_experiment, ids, tags,
                                      (Path(lc.state_dir) / "mlartifacts").resolve().as_uri())),
            "wandb": lambda: WandB(run_dir / "wandb", lc.wandb_project, lc.wandb_mode, tags),
        }
        return cls([made[name]() for name in lc.trackers], queue_size=lc.tracker_queue, timeout_s=lc.tracker_timeout_s,
                   beat=beat)

    def _call(self, t: Tracker, during: str, fn: Callable[..., object], *args: Any) -> None:
        w = self.workers.get(t.name)
        if w is not None:
            w.put(during, fn, *args)
            return
        if t.name in self._off:
            return
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - an import error, a bad URI or a full disk must not stop training
            self._off.add(t.name)
            _failed(t, during, e)

    def _watch(self) -> None:
        """Report a call running past timeout_s once, and its return."""
        while not self._done.wait(min(1.0, self.timeout_s / 4)):
            self.check()

    def check(self) -> list[str]:
        """Report hung trackers and those that answered again; the names hung now."""
        with self._lock:
            return self._check()

    def _check(self) -> list[str]:
        now = time.monotonic()
        for name, w in self.workers.items():
            call, was = w.call, self._hung.get(name)
            if was is not None and call != was:
                del self._hung[name]
                HUNG.labels(name).set(0)
                log.warning("experiment tracker answered again", extra={
                    "tracker": name, "during": was[0], "seconds": round(now - was[1], 1),
                    "dropped": w.dropped})
            if call is not None and name not in self._hung and now - call[1] > self.timeout_s:
                self._hung[name] = call
                HUNG.labels(name).set(1)
                log.error("experiment tracker hangs; the learner goes on without it", extra={
                    "tracker": name, "during": call[0], "seconds": round(now - call[1], 1),
                    "timeout_s": self.timeout_s, "queue": w.q.maxsize})
        return list(self._hung)

    def start(self, run_id: str, config: dict[str, Any], resumed: int | None, history: list[dict[str, Any]]) -> None:
        history = list(history)  # the caller's list grows while a tracker's thread replays it
        for t in self._all:
            self._call(t, "start", t.start, run_id, config, resumed, history)

    def log(self, step: int, row: dict[str, Any]) -> None:
        """Log the history row of `step`."""
        metrics = tracked(row)
        for t in self._all:
            self._call(t, "log", t.log, step, dict(metrics))

    def artifact(self, path: Path) -> None:
        if not path.exists():
            return
        for t in self._all:
            self._call(t, "artifact", t.artifact, path)

    def close(self) -> None:
        """Close the local trackers; let the others drain and close, for timeout_s at most
        (beating), not waiting for a hung one. Returns with every tracker off."""
        for t in self._local:
            self._call(t, "close", t.close)
            self._off.add(t.name)
        for w in self.workers.values():
            w.closing.set()
            try:
                w.q.put_nowait(None)  # wakes its thread at once if the queue is empty
                w.woken = True
            except queue.Full:
                pass
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            hung = self.check()
            waiting = [w for n, w in self.workers.items() if w.thread.is_alive() and n not in hung]
            if not waiting:
                break
            waiting[0].thread.join(timeout=0.5)
            self.beat()
        self._done.set()
        for name, w in self.workers.items():
            if w.thread.is_alive():
                call = w.call
                log.warning("experiment tracker left behind at the end", extra={
                    "tracker": name, "during": call[0] if call else None, "queued": w.q.qsize() - w.woken,
                    "dropped": w.dropped})
            w.off = True


def provenance(data: str | list[str]) -> dict[str, str]:
    """Tags naming the training data: its path, the file's sha256, and the PROVENANCE.json
    beside it (generator, script, modules) where there is one. Several files: each one's tags,
    their values joined by ', ' in the files' order."""
    if not isinstance(data, str):
        each = [provenance(one) for one in data]
        return {k: ", ".join(t.get(k, "-") for t in each) for k in dict.fromkeys(k for t in each for k in t)}
    tags = {"steadyrl.model.data": data}
    p = Path(data)
    if p.suffix and p.is_file():
        tags["steadyrl.model.data.sha256"] = sha256_file(p)
    prov = p.parent / "PROVENANCE.json"
    if p.suffix and prov.is_file():
        try:
            d = json.loads(prov.read_text())
        except ValueError:
            return tags
        for k in ("generator", "script", "modules"):
            if k in d:
                tags[f"steadyrl.model.data.{k}"] = str(d[k])[:500]
    return tags

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

What a tracker gets is `tracked(row)` (tracker_kinds.py): the history row of a step under verl's
names. Each tracker makes its record equal to a resumed run's history, each step once
(tracker_kinds.py says how, tracker by tracker).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import Counter, Gauge

from steadyrl.files import sha256_file

from .tracker_kinds import Console, Jsonl, MLflow, TensorBoard, WandB, _Ids, mlflow_uri, tracked

if TYPE_CHECKING:
    from .config import LearnerSection

log = logging.getLogger("steadyrl.learner")

DROPPED = Counter("steadyrl_learner_tracker_dropped", "Calls (a step's figures, an artifact) an experiment tracker's "
                  "queue had no room for: dropped, not waited for", ["tracker"])
HUNG = Gauge("steadyrl_learner_tracker_hung", "1 while an experiment tracker's call has run past "
             "learner.tracker_timeout_s (the learner goes on without it), else 0", ["tracker"])
QUEUED = Gauge("steadyrl_learner_tracker_queued", "Calls waiting in an experiment tracker's queue", ["tracker"])

NAMES = ("console", "tensorboard", "mlflow", "wandb", "jsonl")

class Tracker(Protocol):
    """One experiment tracker. `resumed`: the step a continued run goes on from (None: a new run);
    `history`: the run's rows up to it (the tracker's record is made equal to them)."""

    name: str

    def start(self, run_id: str, config: dict[str, Any], resumed: int | None,
              history: list[dict[str, Any]]) -> None: ...
    def log(self, step: int, metrics: dict[str, float]) -> None: ...
    def artifact(self, path: Path) -> None: ...
    def close(self) -> None: ...


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
    tags = {"steadyrl.data": data}   # tag names (MLflow, W&B), not a module path
    p = Path(data)
    if p.suffix and p.is_file():
        tags["steadyrl.data.sha256"] = sha256_file(p)
    prov = p.parent / "PROVENANCE.json"
    if p.suffix and prov.is_file():
        try:
            d = json.loads(prov.read_text())
        except ValueError:
            return tags
        for k in ("generator", "script", "modules"):
            if k in d:
                tags[f"steadyrl.data.{k}"] = str(d[k])[:500]
    return tags

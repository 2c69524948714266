"""A user's code -- a rule reward, a tool, an environment -- run in worker processes with hard limits.

Two kinds of job share the processes and their plumbing: `ScoringPool.score` (a reward item by
item, below) and `ScoringPool.call` (a user's function with keyword arguments: a tool call, an
environment's reset or step; its result comes back as text cut to the call's `max_chars` in the
worker process, before it crosses the socket; outcomes ok / cut / too_large / error / timeout /
crash, CALL_OUTCOMES). The rollout worker's episodes use `call` (steadyrl/model/agents.py).

The reward function is code the user brings: it may hang, exit the process (`os._exit`,
`sys.exit`), crash it (a segfault in a C extension), allocate without bound or return what
is not a reward. `ScoringPool.score(spec, items)` scores each item in one of `processes`
worker processes, so that any of these costs that item only:

    the item's outcome                         its result
    a reward (steadyrl.model.rewards.score_value)    {"reward": float, "extra": {...}}
    raised (SystemExit too), or a return       {"reward": None, "error": "scorer S raised ...",
      that is not a reward ("0.7", True)        "kind": "scorer_error"}
    NaN or infinity returned                   ... "kind": "non_finite"
    ran past `item_timeout_s`                  ... "kind": "scorer_timeout"; the process is killed
                                                (SIGKILL) and replaced; the other items of its
                                                group are not run (scorer_timeout too)
    not done by the call's deadline (not       ... "kind": "deadline" (DEADLINE): not the scorer's
      started, cut short, or still loading)     failure; the caller asks again
    the process died (os._exit, a signal)      ... "kind": "scorer_crash"; replaced
    MemoryError past `memory_limit_mb`         ... "kind": "scorer_error" (the process lives on)

Each worker process is a fresh interpreter (`python -m steadyrl.model.scorepool`, started with
subprocess: safe in a threaded service, and it does not import the caller's `__main__` as
multiprocessing's spawn and forkserver do) in its own session (Ctrl-C on `up` does not reach
it; the caller stops it) in the caller's folder. It sets a memory limit (RLIMIT_DATA, what it
allocates: `memory_limit_mb`; 0: none; importing torch takes ~0.8 GB of it) and asks Linux
to kill it when the caller dies (PR_SET_PDEATHSIG) before it resolves the scorer spec itself
(a file-loaded module cannot be pickled; a relative file is made absolute here). It talks to
the caller over a socket pair.

One thread of the caller per process hands items over the socket and waits for the answer, at
most until the item's end: min(its start + item_timeout_s, the call's deadline). A new
process first imports the scorer (within START_TIMEOUT_S of being asked, across calls: a
load the deadline cut short goes on, and the next call waits for it): that time is not the
item's. Each request and its answer carry a number, so an answer that comes late is never
taken for another's. Items of a call are handed out group by group (items sharing
data_source, prompt and ground_truth): at the deadline whole groups are done, not a part of
each; once an item of a group has run past item_timeout_s, the group's other items are not
run, so a reward that hangs on one answer costs one timeout a group. The answer is a few
primitives, checked in the worker (`score_value`), so nothing the user returns is unpickled
here.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from steadyrl.model.rewards import ERROR_MESSAGE_CHARS, NotAReward, raised, resolve_scorer, score_value

log = logging.getLogger(__name__)

#: The failure kinds of an item (its `kind`, and the reward worker's rl.dlq reason).
KINDS = ("scorer_error", "scorer_timeout", "scorer_crash", "non_finite")
#: The kind of an item the call's deadline left unscored (not started, cut short, or its process
#: still loading the scorer): not the scorer's failure. The reward worker holds its group and
#: sends it again (alone); the evaluation scores it again in a new call.
DEADLINE = "deadline"
#: /readyz: the pool is full when an item has waited this long for a process.
QUEUE_WAIT_NOT_READY_S = 5.0
#: Seconds a new process may take to start and import the scorer (not counted in item_timeout_s).
START_TIMEOUT_S = 60.0
#: Seconds a process that was killed is given to go before the next one starts.
_JOIN_S = 5.0
_PR_SET_PDEATHSIG = 1   # linux/prctl.h


def absolute_spec(spec: str) -> str:
    """`spec` with a relative reward file made absolute (`my_reward.py:fn` ->
    `/home/u/my_reward.py:fn`), so a process started elsewhere finds the same file."""
    module, sep, attr = spec.rpartition(":")
    if sep and module.endswith(".py") and not os.path.isabs(module):
        return f"{os.path.abspath(module)}:{attr}"
    return spec


# ---- in the worker process ---------------------------------------------------------------------
_resolved: dict[str, Any] = {}


def _score_here(spec: str, name: str, args: tuple[Any, ...]) -> tuple[str, Any, Any]:
    """One item, in this process: ("ok", reward, extra as JSON text) or (kind, error, None)."""
    try:
        fn = _resolved.get(spec)
        if fn is None:
            fn = _resolved[spec] = resolve_scorer(spec)
        value = fn(*args)
    except MemoryError as e:
        limit = resource.getrlimit(resource.RLIMIT_DATA)[0]
        shown = f" (memory_limit_mb {limit // 2**20} per scoring process)" if limit > 0 else ""
        return "scorer_error", raised(name, e) + shown, None
    except BaseException as e:  # noqa: BLE001 - SystemExit, KeyboardInterrupt too: the item's error
        return "scorer_error", raised(name, e), None
    try:
        reward, extra = score_value(value)
    except NotAReward as e:
        return e.kind, f"scorer {name} {e}", None
    except Exception as e:  # noqa: BLE001 - a user's type that breaks on being looked at (__eq__, tolist)
        return "scorer_error", f"scorer {name} returned a {type(value).__name__} that cannot be read: " \
                               f"{type(e).__name__}: {e}", None
    return "ok", reward, json.dumps(extra, allow_nan=False)


def _call_here(spec: str, name: str, kwargs: dict[str, Any], via: str | None, max_chars: int,
               cut: bool) -> tuple[str, Any, Any]:
    """One call, in this process: `spec(**kwargs)` (or `via(spec, **kwargs)`), its result as
    text (a str as it is, anything else as JSON), at most `max_chars` characters:
    ("ok", text, None); ("cut", text cut to max_chars with a note, full length) when `cut`;
    ("too_large", error, None) when not; ("error", "Type: message", None) when it raised."""
    try:
        fn = _resolved.get(spec)
        if fn is None:
            fn = _resolved[spec] = resolve_scorer(spec)
        if via is not None:
            wrap = _resolved.get(via)
            if wrap is None:
                wrap = _resolved[via] = resolve_scorer(via)
            value = wrap(fn, **kwargs)
        else:
            value = fn(**kwargs)
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
        text = str(text)   # a str subclass with odd methods: plain text from here
    except MemoryError as e:
        limit = resource.getrlimit(resource.RLIMIT_DATA)[0]
        shown = f" (memory_limit_mb {limit // 2**20} per process)" if limit > 0 else ""
        return "error", f"{type(e).__name__}: {e}{shown}", None
    except BaseException as e:  # noqa: BLE001 - SystemExit, KeyboardInterrupt too: the call's error
        msg = str(e)
        return "error", f"{type(e).__name__}: {msg[:ERROR_MESSAGE_CHARS]}", None
    if len(text) > max_chars:
        if cut:
            return "cut", text[:max_chars] + f" [... {len(text) - max_chars} characters cut]", len(text)
        return "too_large", f"{name} returned {len(text)} characters, more than the {max_chars} allowed", None
    return "ok", text, None


def _worker(conn: multiprocessing.connection.Connection, memory_limit_mb: int, caller: int) -> None:
    """A worker process's life: limits, then items until the socket closes."""
    with contextlib.suppress(OSError, AttributeError):   # Linux: die with the caller, even mid-item
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != caller:   # the caller (pid `caller`: PID 1 itself in a container) died before that
        return
    if memory_limit_mb > 0:
        limit = memory_limit_mb * 2**20
        with contextlib.suppress(ValueError, OSError):   # a hard limit below it: keep the hard one
            resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    while True:
        try:
            seq, what, spec, name, args = conn.recv()
        except (EOFError, OSError):   # the caller went away
            return
        if what == "load":   # load the scorer before items come (its errors are the items')
            with contextlib.suppress(BaseException):
                _resolved[spec] = resolve_scorer(spec)
            conn.send((seq, "loaded", None, None))
        elif what == "call":
            conn.send((seq, *_call_here(spec, name, *args)))
        else:
            conn.send((seq, *_score_here(spec, name, args)))


if __name__ == "__main__":   # python -m steadyrl.model.scorepool FD MEMORY_LIMIT_MB CALLER_PID (ScoringPool._start)
    _worker(multiprocessing.connection.Connection(int(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3]))
    sys.exit(0)


# ---- in the caller -----------------------------------------------------------------------------
class ScoringLimits(BaseModel):
    """The limits of a rule scorer's processes: the reward server's (`reward_server:` section),
    which the learner's evaluation reads too, so both score the user's reward alike. The rest
    of the section is ignored here."""

    model_config = ConfigDict(extra="ignore")

    processes: int | None = Field(None, ge=0,
                                  description="Worker processes that run the rule scorers, item by item, with the "
                                              "limits below (None: the CPU count, between 2 and 8). 0: in the "
                                              "server's own threads, without limits (a hang holds a call, a crash "
                                              "kills the server; for debugging only).")
    item_timeout_s: float = Field(10.0, gt=0,
                                  description="Longest one item may take in a rule scorer; past it its process is "
                                              "killed and replaced and the item's error is scorer_timeout.")
    call_deadline_s: float = Field(25.0, gt=0,
                                   description="Every /score call is answered within this many seconds of its "
                                               "body: items of rule scorers not scored by then are scorer_timeout. "
                                               "Keep it below the reward worker's reward.timeout_s (30 s), which "
                                               "takes a call not answered in time for a server down. Model "
                                               "scorers: a call not answered by then gets 504 and its slot back. "
                                               "The learner's evaluation gives each batch of rows the same.")
    memory_limit_mb: int = Field(4096, ge=0,
                                 description="Memory each rule scorer process may allocate (RLIMIT_DATA), MiB; past "
                                             "it the scorer gets MemoryError (the item's scorer_error). 0: no "
                                             "limit. Importing torch in a reward takes ~800 MiB of it.")

    @model_validator(mode="after")
    def _item_within_call(self) -> ScoringLimits:
        if self.item_timeout_s >= self.call_deadline_s:
            raise ValueError(f"item_timeout_s ({self.item_timeout_s:g}) must be below call_deadline_s "
                             f"({self.call_deadline_s:g}): an item that may take the whole call would never be "
                             "scored in one")
        return self

    def pool_processes(self) -> int:
        """processes, or its default: the CPU count, between 2 and 8."""
        return self.processes if self.processes is not None else min(8, max(2, os.cpu_count() or 2))

    def pool(self) -> ScoringPool:
        """A ScoringPool with these limits (at least one process)."""
        return ScoringPool(max(1, self.pool_processes()), self.item_timeout_s, self.memory_limit_mb)


@dataclass
class _Call:
    """One `score` call: its results as they come, its deadline (monotonic seconds), and the
    groups an item of which ran past item_timeout_s (their other items are not run: the group is
    refused anyway, and a reward that hangs on one answer costs one timeout, not one an item)."""

    results: list[dict[str, Any] | None]
    deadline: float
    left: int
    done: threading.Event = field(default_factory=threading.Event)
    timed_out: dict[tuple[Any, ...], str] = field(default_factory=dict)


@dataclass
class _Job:
    call: _Call
    index: int
    spec: str
    name: str
    args: tuple[Any, ...]
    group: tuple[Any, ...] = ()
    queued: float = field(default_factory=time.monotonic)
    what: str = "score"              # or "call" (ScoringPool.call)
    timeout_s: float | None = None   # None: the pool's item_timeout_s

    @property
    def label(self) -> str:
        """How errors name it: `scorer my_reward.py:fn`, or a call's own name (`tool calc`)."""
        return f"scorer {self.name}" if self.what == "score" else self.name


#: The outcomes of a ScoringPool.call: ok; cut (its text was longer than max_chars and comes
#: cut, with a note); too_large (longer, and the call asked for no cut); error (it raised, or its
#: arguments cannot be sent); timeout (past its timeout_s or the deadline: the process killed and
#: replaced); crash (it ended its process: os._exit, a signal; replaced).
CALL_OUTCOMES = ("ok", "cut", "too_large", "error", "timeout", "crash")
_CALL_OUTCOME = {"scorer_error": "error", "scorer_timeout": "timeout", DEADLINE: "timeout", "scorer_crash": "crash",
                 "error": "error", "too_large": "too_large"}


@dataclass
class Call:
    """One call of a user's function in a pool process: `spec(**kwargs)`, or, with `via` (a
    function of ours, `module:function`), `via(spec's object, **kwargs)`. The arguments are
    pickled to the process; the result comes back as text (a str as it is, else JSON), at most
    `max_chars` characters (cut, or too_large when `cut` is False). `name` names it in errors
    (`tool calc`)."""

    spec: str
    kwargs: dict[str, Any]
    timeout_s: float
    max_chars: int
    name: str = ""
    cut: bool = True
    via: str | None = None


@dataclass
class CallResult:
    """A Call's outcome (CALL_OUTCOMES) and text: the result, or the error."""

    outcome: str
    text: str


class _Slot:
    """One worker process and the thread that feeds it."""

    def __init__(self, n: int):
        self.n = n
        self.proc: subprocess.Popen[bytes] | None = None
        self.conn: multiprocessing.connection.Connection | None = None
        self.busy_since: float | None = None
        self.started = 0   # processes started for this slot
        self.loaded: set[str] = set()   # the specs (scorers, tools) its process has loaded
        self.loading: str | None = None   # the scorer its process was asked to load, not yet loaded
        self.load_started = 0.0
        self.load_seq = 0   # the request number of that load
        self.seq = 0   # requests sent to its process; a reply carries its request's number


class ScoringPool:
    """Worker processes that score rule rewards item by item, or call a user's functions, with
    hard limits (module doc).

    Args:
        processes: worker processes (>= 1); items beyond them wait their turn.
        item_timeout_s: longest one item may run; past it the process is killed and replaced.
        memory_limit_mb: memory each process may allocate (RLIMIT_DATA), MiB (0: none).
    """

    def __init__(self, processes: int, item_timeout_s: float, memory_limit_mb: int = 0):
        if processes < 1:
            raise ValueError(f"processes {processes} < 1")
        self.processes, self.item_timeout_s, self.memory_limit_mb = processes, item_timeout_s, memory_limit_mb
        self._cwd = os.getcwd()
        self._queue: deque[_Job] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self.slots = [_Slot(n) for n in range(processes)]
        self.restarts = {"scorer_timeout": 0, "scorer_crash": 0}
        self._threads = [threading.Thread(target=self._serve, args=(s,), name=f"scorepool-{s.n}", daemon=True)
                         for s in self.slots]
        for t in self._threads:
            t.start()

    # ---- the API ---------------------------------------------------------------------------
    def score(self, spec: str, items: Sequence[Any], deadline: float | None = None,
              name: str | None = None) -> list[dict[str, Any]]:
        """One result per item of `items` (steadyrl.model.scorers.ScoreInput: data_source, prompt, response,
        ground_truth, extra_info), in order (module doc's table), by `deadline`
        (time.monotonic(); None: no deadline but each item's timeout). `name` is the scorer as
        errors name it (default: `spec`). Never raises for what the scorer does."""
        spec_abs = absolute_spec(spec)
        call = _Call([None] * len(items), deadline if deadline is not None else float("inf"), len(items))
        if not items:
            return []
        jobs = [_Job(call, i, spec_abs, name or spec, (it.data_source, it.response, it.ground_truth, it.extra_info),
                     (it.data_source, getattr(it, "prompt", ""), it.ground_truth)) for i, it in enumerate(items)]
        with self._cond:
            if self._closed:
                raise RuntimeError("the scoring pool is closed")
            self._queue.extend(_by_group(jobs))
            self._cond.notify_all()
        if not call.done.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
            with self._cond:   # the deadline: what waits is dropped, what runs is killed by its thread
                mine = [j for j in self._queue if j.call is call]
                for j in mine:
                    self._queue.remove(j)
            for j in jobs:
                self._finish(j, _failed(DEADLINE, f"scorer {j.name}: not scored before the call's deadline "
                                                  f"({'waiting' if j in mine else 'running'}; "
                                                  f"item_timeout_s {self.item_timeout_s:g}, "
                                                  f"{self.processes} scoring processes)"))
        return [r for r in call.results if r is not None]

    def call(self, calls: Sequence[Call], deadline: float | None = None) -> list[CallResult]:
        """Run each of `calls` (a user's function with keyword arguments: a tool, an
        environment's reset or step) in a worker process, as items are scored: each within its
        own `timeout_s`, all by `deadline` (time.monotonic(); None: none), in parallel up to
        `processes`; one CallResult each, in order (CALL_OUTCOMES). The result crosses the
        socket as text already cut to the call's `max_chars` in the worker process. Never
        raises for what the user's code does."""
        if not calls:
            return []
        call = _Call([None] * len(calls), deadline if deadline is not None else float("inf"), len(calls))
        jobs = [_Job(call, i, absolute_spec(c.spec), c.name, (c.kwargs, c.via, c.max_chars, c.cut), (i,),
                     what="call", timeout_s=c.timeout_s) for i, c in enumerate(calls)]
        with self._cond:
            if self._closed:
                raise RuntimeError("the pool is closed")
            self._queue.extend(jobs)
            self._cond.notify_all()
        if not call.done.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
            with self._cond:
                mine = [j for j in self._queue if j.call is call]
                for j in mine:
                    self._queue.remove(j)
            for j in jobs:
                self._finish(j, _failed(DEADLINE, f"{j.name}: not done before the call's deadline"))
        out = []
        for r in call.results:
            assert r is not None
            if "outcome" in r:
                out.append(CallResult(r["outcome"], r["text"]))
            else:
                out.append(CallResult(_CALL_OUTCOME.get(r["kind"], "error"), r["error"]))
        return out

    def ready(self) -> tuple[bool, str]:
        """(can take work, detail): False when an item has waited QUEUE_WAIT_NOT_READY_S for a
        process, or when the pool is closed (the reward server's /readyz)."""
        now = time.monotonic()
        with self._cond:
            waiting = len(self._queue)
            oldest = now - self._queue[0].queued if self._queue else 0.0
            closed = self._closed
        busy = sum(1 for s in self.slots if s.busy_since is not None)
        detail = (f"scoring processes: {busy} of {self.processes} busy, {waiting} items waiting"
                  + (f" (oldest {oldest:.1f} s)" if waiting else ""))
        if closed:
            return False, "scoring pool closed"
        return oldest < QUEUE_WAIT_NOT_READY_S, detail

    def close(self) -> None:
        """Stop every process; calls in progress get scorer_timeout for what is left."""
        with self._cond:
            self._closed = True
            left = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for job in left:
            self._finish(job, _failed("scorer_timeout", f"{job.label}: not run: the pool closed"))
        for s in self.slots:
            self._stop(s)

    def __enter__(self) -> ScoringPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the threads -----------------------------------------------------------------------
    def _serve(self, slot: _Slot) -> None:
        try:
            self._start(slot)
        except Exception:   # noqa: BLE001 - told on the first item (the start is tried again there)
            log.exception("scoring process did not start", extra={"slot": slot.n})
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._queue.popleft()
                slot.busy_since = time.monotonic()
            try:
                first = job.call.timed_out.get(job.group)
                if first is not None:
                    self._finish(job, _failed("scorer_timeout", f"not run: another item of its group ran past "
                                                                f"item_timeout_s: {first}"))
                    continue
                result = self._run(slot, job)
                if result.get("kind") == "scorer_timeout":
                    job.call.timed_out.setdefault(job.group, result["error"])
                self._finish(job, result)
            except BaseException as e:  # noqa: BLE001 - never leave a call waiting
                log.exception("scoring pool failed on an item", extra={"slot": slot.n})
                self._finish(job, _failed("scorer_crash", f"{job.label}: the pool failed: "
                                                          f"{type(e).__name__}: {e}"))
                self._stop(slot)
            finally:
                slot.busy_since = None

    def _run(self, slot: _Slot, job: _Job) -> dict[str, Any]:
        now = time.monotonic()
        if now >= job.call.deadline:
            return _failed(DEADLINE, f"{job.label}: not started before the call's deadline (the "
                                     f"{self.processes} scoring processes were busy with other items)")
        if slot.proc is None or slot.proc.poll() is not None or job.spec not in slot.loaded:
            failed = self._ready(slot, job)
            if failed is not None:
                return failed
            now = time.monotonic()   # the item's time starts once its process is ready
        proc, conn = slot.proc, slot.conn   # close() may clear the slot's meanwhile
        assert conn is not None and proc is not None   # _start set them
        timeout_s = job.timeout_s if job.timeout_s is not None else self.item_timeout_s
        limit = f"item_timeout_s ({timeout_s:g} s)" if job.what == "score" else f"{timeout_s:g} s"
        process = "scoring process" if job.what == "score" else "process"
        end = min(now + timeout_s, job.call.deadline)
        try:
            slot.seq += 1
            conn.send((slot.seq, job.what, job.spec, job.name, job.args))
            while conn.poll(max(0.0, end - time.monotonic())):
                seq, status, a, b = conn.recv()
                if seq != slot.seq:   # an earlier request's answer: not this item's
                    if slot.loading is not None and seq == slot.load_seq:   # a load a deadline cut short: done
                        slot.loaded.add(slot.loading)
                        slot.loading = None
                    continue
                if job.what == "call":
                    return {"outcome": status, "text": a, "chars": b} if status in ("ok", "cut") \
                        else _failed(status, a)
                if status == "ok":
                    return {"reward": a, "extra": json.loads(b)}
                return _failed(status, a)
        except (EOFError, OSError, BrokenPipeError):
            ended = True  # its end of the socket closed: the process is dying (below)
        except Exception as e:  # noqa: BLE001 - its arguments cannot be pickled (an odd extra_info)
            return _failed("scorer_error", f"{job.label}: the item cannot be sent to a {process}: "
                                           f"{type(e).__name__}: {e}")
        else:
            ended = False
        if self._closed:
            return _failed("scorer_timeout", f"{job.label}: not run: the pool closed")
        with contextlib.suppress(subprocess.TimeoutExpired):   # a dying process may take a moment to go
            proc.wait(_JOIN_S if ended else 0.05)
        if proc.poll() is None:   # still running at its end: a timeout, or cut short by the deadline
            self._stop(slot)
            if end >= job.call.deadline:
                return _failed(DEADLINE, f"{job.label}: not done before the call's deadline ({end - now:.1f} "
                                         f"s after it started; its {process} was killed and replaced)")
            self.restarts["scorer_timeout"] += 1
            return _failed("scorer_timeout", f"{job.label} did not return within {limit}: its {process} was "
                                             "killed and replaced")
        code = proc.returncode
        self._stop(slot)
        self.restarts["scorer_crash"] += 1
        how = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0
               and -code in signal.valid_signals() else f"exited with code {code}")
        return _failed("scorer_crash", f"{job.label} crashed its {process} ({how}) on this "
                                       f"{'item' if job.what == 'score' else 'call'}")

    def _ready(self, slot: _Slot, job: _Job) -> dict[str, Any] | None:
        """Make `slot`'s process (started anew when it has none or it ended) load `job`'s scorer.
        None once it has; else the item's failure: the call's deadline came first (the load goes
        on), or the process did not start or load (it is stopped, counted as a crash)."""
        if slot.proc is None or slot.proc.poll() is not None:
            self._stop(slot)
            self._start(slot)
        loaded = self._load(slot, job.spec, job.call.deadline)
        if loaded == "later":   # still loading (kept: the next call finds it loaded)
            return _failed(DEADLINE, f"{job.label}: not done before the call's deadline (its process was "
                                     "still loading it)")
        if loaded == "failed":
            self._stop(slot)
            self.restarts["scorer_crash"] += 1
            return _failed("scorer_crash", f"{job.label}: its process did not start or load it within "
                                           f"{START_TIMEOUT_S:g} s")
        return None

    def _load(self, slot: _Slot, spec: str, deadline: float) -> str:
        """Have `slot`'s process import the scorer `spec` (a user's module may take seconds to
        import), waiting until it says so, `deadline`, or START_TIMEOUT_S from when it was asked:
        "ok"; "later" (the deadline came first: the process goes on loading, and a later call
        waits for the same load); "failed" (it died, or took START_TIMEOUT_S)."""
        conn = slot.conn   # close() may clear the slot's meanwhile (then conn is closed: OSError)
        assert conn is not None
        try:
            if slot.loading != spec:
                slot.loading, slot.load_started = spec, time.monotonic()
                slot.seq += 1
                slot.load_seq = slot.seq
                conn.send((slot.seq, "load", spec, spec, None))
            give_up = slot.load_started + START_TIMEOUT_S
            while conn.poll(max(0.0, min(give_up, deadline) - time.monotonic())):
                if conn.recv()[0] == slot.load_seq:
                    slot.loaded.add(spec)
                    slot.loading = None
                    return "ok"
        except (EOFError, OSError):
            return "failed"
        return "failed" if time.monotonic() >= give_up else "later"

    def _start(self, slot: _Slot) -> None:
        ours, theirs = socket.socketpair()
        try:
            proc = subprocess.Popen(   # -P: the working folder last on sys.path, not first (a user's
                # random.py there must not shadow the standard library; rewards._import appends it)
                [sys.executable, "-P", "-m", "steadyrl.model.scorepool", str(theirs.fileno()),
                 str(self.memory_limit_mb), str(os.getpid())],
                pass_fds=(theirs.fileno(),), cwd=self._cwd, stdin=subprocess.DEVNULL, start_new_session=True)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        slot.proc, slot.conn = proc, multiprocessing.connection.Connection(ours.detach())
        slot.started += 1

    def _stop(self, slot: _Slot) -> None:
        proc, conn = slot.proc, slot.conn
        slot.proc = slot.conn = None
        slot.loaded = set()
        slot.loading = None
        if conn is not None:
            conn.close()
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(_JOIN_S)

    def _finish(self, job: _Job, result: dict[str, Any]) -> None:
        call = job.call
        with self._cond:
            if call.results[job.index] is not None:
                return
            call.results[job.index] = result
            call.left -= 1
            last = call.left == 0
        if last:
            call.done.set()


def _failed(kind: str, error: str) -> dict[str, Any]:
    return {"reward": None, "error": error, "kind": kind}


def _by_group(jobs: list[_Job]) -> list[_Job]:
    """`jobs` group by group (items sharing data_source, prompt and ground_truth), groups in the
    order of their first item: when the call's deadline comes, whole groups are done rather than
    a part of each, and the rest are held and sent again (DEADLINE)."""
    groups: dict[tuple[Any, ...], list[_Job]] = {}
    for job in jobs:
        groups.setdefault(job.group, []).append(job)
    return [j for g in groups.values() for j in g]

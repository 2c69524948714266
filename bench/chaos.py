"""Chaos soak: the tiny pipeline under `steadyrl up` while a scheduler SIGKILLs its services
and restarts the broker, then an audit of exactly-once.

    .venv/bin/python bench/chaos.py [--seed 1] [--kills 20] [--steps 300] [--budget-s 600]
                                    [--out bench/results/chaos.json]

What runs (`steadyrl.testing.stack.Pipeline`): our own broker (`LocalBroker` under
`--state-dir`/broker, `--port`) and `steadyrl up --bootstrap` on it with configs/tiny.yaml
(`--steps` steps, `--scale` rollout=2 reward=2 by default), its services on `--port-offset`.

The schedule is fixed by `--seed` before anything starts: `--kills` SIGKILLs over every
kind (reward-server, actor, rollout, reward, learner; each kind at least kills // 5 times,
shuffled, or `--order round-robin`), the instance of a scaled kind drawn at random, and
`--broker-restarts` broker restarts (SIGKILL by default, `--broker-down-s` later started
again on the same data dir and port) placed in the middle third. Events are spread over
the learner's steps: event i fires once the learner reports step >= its step (and
`--min-gap-s` after the previous one, except a "burst" event, which fires together with
the previous one: two services down at once). A victim that is not running (in its
restart backoff) is killed as soon as it is. The whole run is bounded by `--budget-s`.

Afterwards the audit (`steadyrl.testing.audit.audit_pipeline`), from the broker's topics and
the learner's files only:
- the learner reached its final step and marked the run finished;
- every prompt id published on rl.prompts was trained exactly once (consumed.jsonl), or
  went to rl.dlq (listed with its reason); none trained twice, none lost;
- each stage (rollout: rl.prompts -> rl.rollouts, reward: rl.rollouts -> rl.scored) turned
  every input record below its consumer group's committed offsets into exactly one output
  record (read_committed) or one DLQ record, and produced nothing else.
Result as JSON (`--out`), with per kill the time until the restarted process was running,
answered /readyz, and had recovered (see `bench/recovery.py` for the criteria, measured
there one kill at a time). Exit status 1 when the audit fails or the schedule did not
complete within the budget.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from steadyrl.testing.audit import audit_pipeline  # noqa: E402
from steadyrl.testing.run import RunDir  # noqa: E402
from steadyrl.testing.stack import KINDS, Pipeline, alive, kind_of, proc_start_epoch  # noqa: E402

MARKER = ".steadyrl-bench-state"  # a --state-dir this bench may wipe


# ---- recovery of one killed instance --------------------------------------------------------

STAGE_COMMIT = "steadyrl_stage_last_commit_timestamp_seconds"
REWARD_OK = ("steadyrl_reward_calls_total", frozenset({("outcome", "ok")}))


def _reward_ok_calls(pipe: Pipeline) -> dict[str, float]:
    out = {}
    for inst in pipe.instances:
        if kind_of(inst) == "reward":
            v = pipe.metrics(inst).get(REWARD_OK)
            if v is not None:
                out[f"{inst}:{pipe.pid(inst)}"] = v
    return out


def _breaker_opens(pipe: Pipeline) -> float:
    key = ("steadyrl_reward_breaker_transitions_total", frozenset({("to", "open")}))
    return sum(pipe.metrics(i).get(key, 0.0) for i in pipe.instances if kind_of(i) == "reward")


def _last_commit(pipe: Pipeline, instance: str) -> float | None:
    return pipe.metrics(instance).get((STAGE_COMMIT, frozenset({("stage", kind_of(instance))})))


def kill_and_measure(pipe: Pipeline, instance: str, pid: int, timeout_s: float = 180.0,
                     stop: threading.Event | None = None) -> dict:
    """SIGKILL `pid` (the running `instance`) and poll until the service has recovered:

    - rollout, reward: the restarted instance committed a transaction (its
      steadyrl_stage_last_commit_timestamp_seconds exists: input partitions consumed again);
    - actor: its /readyz answers 200 and then a rollout worker commits (a rollout completed);
    - reward-server: its /readyz answers 200 and a reward worker's ok calls to it grow (a
      score call succeeded through the worker);
    - learner: the restarted learner completes a step (`/progress`); also the time until it
      is past the step it was killed at (a resume from a checkpoint redoes up to
      checkpoint_every - 1 steps).

    Returns seconds since the kill: spawn_s (new process started), ready_s, recovered_s
    (None if not within timeout_s), and the log phases of the restarted instance.
    """
    kind = kind_of(instance)
    step_at_kill = pipe.progress().get("step") if kind == "learner" else None
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)
    while alive(pid) and time.time() - t_kill < 10:
        time.sleep(0.01)
    rec: dict = {"instance": instance, "kind": kind, "pid": pid, "t_kill": round(t_kill, 3)}
    if step_at_kill is not None:
        rec["step_at_kill"] = step_at_kill
    ok_calls = _reward_ok_calls(pipe) if kind == "reward-server" else {}  # after the kill: only the new server adds
    opens = _breaker_opens(pipe) if kind == "reward-server" else 0.0
    new_pid, t_ready, s0 = None, None, None
    deadline = t_kill + timeout_s
    while time.time() < deadline and not (stop is not None and stop.is_set()):
        now = time.time()
        if new_pid is None:
            p = pipe.pid(instance)
            if p is not None and p != pid:
                new_pid = p
                rec["new_pid"] = p
                started = proc_start_epoch(p)
                rec["spawn_s"] = round((started or now) - t_kill, 3)
        if new_pid is not None:
            if t_ready is None and pipe.ready(instance):
                t_ready = time.time()
                rec["ready_s"] = round(t_ready - t_kill, 3)
            if kind in ("rollout", "reward"):
                v = _last_commit(pipe, instance)
                if v is not None and v > t_kill:
                    rec["recovered_s"] = round(v - t_kill, 3)
                    break
            elif kind == "actor" and t_ready is not None:
                commits = [_last_commit(pipe, i) for i in pipe.instances if kind_of(i) == "rollout"]
                if any(c is not None and c > t_ready for c in commits):
                    rec["recovered_s"] = round(max(c for c in commits if c is not None) - t_kill, 3)
                    break
            elif kind == "reward-server" and t_ready is not None:
                calls = _reward_ok_calls(pipe)
                if any(v > ok_calls.get(k, 0) for k, v in calls.items()):
                    rec["recovered_s"] = round(time.time() - t_kill, 3)
                    rec["breaker_opened"] = _breaker_opens(pipe) > opens  # the workers fell back to cached scores
                    break
            elif kind == "learner":
                p = pipe.progress()
                if "step" in p and p.get("phase") not in (None, "loading"):
                    if s0 is None:
                        s0 = p["step"]
                        rec["restored_step"] = s0
                    elif p["step"] > s0 and "recovered_s" not in rec:
                        rec["recovered_s"] = round(time.time() - t_kill, 3)
                    if "recovered_s" in rec and p["step"] > (step_at_kill or 0):
                        rec["caught_up_s"] = round(time.time() - t_kill, 3)
                        break
                    if p.get("done"):
                        break
        time.sleep(0.1)
    rec.setdefault("recovered_s", None)
    rec["phases"] = phases(pipe, instance, t_kill)
    if kind == "learner" and rec["recovered_s"] is not None:
        # the step's own log line is more precise than polling /progress
        steps = [r for r in pipe.log_lines(instance, t_kill) if r.get("msg") == "step"]
        if steps:
            rec["recovered_s"] = round(steps[0]["ts"] - t_kill, 3)
            past = [r for r in steps if r.get("step", 0) > (step_at_kill or 0)]
            if past and "caught_up_s" in rec:
                rec["caught_up_s"] = round(past[0]["ts"] - t_kill, 3)
    return rec


#: Log messages that mark the phases of a restart, per kind (first occurrence after the kill).
PHASE_MSGS = {
    "http": "http server listening",          # imports, config, the HTTP server: the process is up
    "txn_init": "stage running",              # init_transactions: the predecessor fenced, its txn aborted
    "assigned": "partitions assigned",        # group join: the dead member's session timed out
    "resumed": ("resuming run from checkpoint", "resuming run without a checkpoint yet"),
    "policy": "policy caught up",             # the actor read rl.policy and loaded the newest version
    "first_step": "step",
}


def phases(pipe: Pipeline, instance: str, t_kill: float) -> dict:
    out = {}
    for rec in pipe.log_lines(instance, t_kill):
        for name, msg in PHASE_MSGS.items():
            if name not in out and rec.get("msg") in ((msg,) if isinstance(msg, str) else msg):
                out[name] = round(rec["ts"] - t_kill, 3)
    return out


# ---- the schedule -----------------------------------------------------------------------------

@dataclass
class Event:
    at_step: int
    target: str            # an instance name, or "broker"
    burst: bool = False    # fires together with the previous event
    fired: dict = field(default_factory=dict)


def make_schedule(seed: int, kills: int, steps: int, scale: dict[str, int], order: str = "random",
                  broker_restarts: int = 1, burst: float = 0.15, warmup: int = 6, tail: int = 10) -> list[Event]:
    """The deterministic list of events for `seed` (see the module doc)."""
    rng = random.Random(seed)
    if order == "round-robin":
        kinds = [KINDS[i % len(KINDS)] for i in range(kills)]
    else:
        kinds = [k for k in KINDS for _ in range(kills // len(KINDS))]
        kinds += rng.sample(KINDS, kills - len(kinds))
        rng.shuffle(kinds)
    targets = [f"{k}-{rng.randrange(scale.get(k, 1))}" for k in kinds]
    n = len(targets) + broker_restarts
    for _ in range(broker_restarts):
        targets.insert(rng.randrange(n // 3, 2 * n // 3 + 1), "broker")
    span = max(steps - warmup - tail, n)
    gap = span / n
    events: list[Event] = []
    for i, target in enumerate(targets):
        ev = Event(at_step=warmup + int(i * gap + rng.uniform(0, gap / 2)), target=target)
        prev = events[-1] if events else None
        if (prev is not None and target != "broker" and prev.target != "broker" and kind_of(prev.target) !=
                kind_of(target) and not prev.burst and rng.random() < burst):
            ev.at_step, ev.burst = prev.at_step, True
        events.append(ev)
    return events


# ---- the run ----------------------------------------------------------------------------------

def prepare_state(state_dir: Path) -> None:
    """An empty --state-dir: created, or wiped if this bench made it (it holds MARKER)."""
    if state_dir.exists() and any(state_dir.iterdir()):
        if not (state_dir / MARKER).exists():
            raise SystemExit(f"{state_dir} is not empty and was not made by this bench ({MARKER} missing): "
                             "give another --state-dir")
        shutil.rmtree(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / MARKER).write_text("made by bench/chaos.py or bench/recovery.py; wiped on their next run\n")


def write_config(state_dir: Path, steps: int, **learner) -> Path:
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg["learner"].update(steps=steps, **learner)
    path = state_dir / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _parse_scale(items: list[str]) -> dict[str, int]:
    out = {}
    for item in items:
        k, _, n = item.partition("=")
        out[k] = int(n)
    return out


def summarize(values: list[float]) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"n": 0}
    return {"n": len(values), "median": round(statistics.median(values), 2), "max": round(max(values), 2),
            "min": round(min(values), 2)}


def run(args) -> dict:
    state_dir = Path(args.state_dir).resolve()
    prepare_state(state_dir)
    scale = {"rollout": 2, "reward": 2} | _parse_scale(args.scale)
    events = make_schedule(args.seed, args.kills, args.steps, scale, args.order, args.broker_restarts, args.burst)
    config = write_config(state_dir, args.steps)
    lc = yaml.safe_load(config.read_text())["learner"]
    pipe = Pipeline(state_dir, args.port, args.port_offset, config, scale)
    t0 = time.time()
    deadline = t0 + args.budget_s - args.audit_reserve_s
    stop = threading.Event()
    measurers: list[threading.Thread] = []
    failures: list[str] = []
    rc = None
    result: dict = {}
    print(f"chaos: seed {args.seed}, {len(events)} events over {args.steps} steps, budget {args.budget_s:.0f} s, "
          f"state {state_dir}", flush=True)
    try:
        pipe.start()
        i, last_fire = 0, 0.0
        while pipe.running() and time.time() < deadline:
            if i < len(events):
                ev = events[i]
                step = pipe.progress().get("step")
                due = (step is not None and step >= ev.at_step
                       and (ev.burst or time.time() - last_fire >= args.min_gap_s))
                if due:
                    fire(pipe, ev, step, measurers, stop, deadline, args)
                    last_fire = time.time()
                    print(f"chaos: event {i + 1}/{len(events)} at step {step}: {ev.target} {ev.fired.get('what')}",
                          flush=True)
                    i += 1
                    continue
            time.sleep(0.2)
        if i < len(events):
            failures.append(f"only {i} of {len(events)} events fired before "
                            + ("the run ended" if not pipe.running() else "the budget ran out"))
        while pipe.running() and time.time() < deadline:
            time.sleep(0.5)
        if pipe.running():
            failures.append(f"the run did not finish within the budget ({args.budget_s:.0f} s)")
        rc = pipe.up.poll()
        stop.set()
        for t in measurers:
            t.join(timeout=5)
    finally:
        stop.set()
        up_rc = pipe.stop() if pipe.up is not None else None
        rc = rc if rc is not None else up_rc
    # the broker is stopped: the audit needs it again (same data)
    wall_run = time.time() - t0
    if rc != 0:
        failures.append(f"steadyrl up exited with {rc}")
    pipe.broker.start(timeout_s=120)
    try:
        aud = audit_pipeline(pipe.bootstrap, "", RunDir.of_up(state_dir), args.steps, lc["prompts_per_step"],
                             client="chaos-audit")
    except Exception as e:  # noqa: BLE001 - a run that never got going has no state to audit
        aud = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    finally:
        pipe.broker.stop()
    if not aud["ok"]:
        failures.append("audit failed: "
                        + (aud.get("error") or ", ".join(k for k, v in aud["checks"].items() if not v)))
    fired = [e for e in events if e.fired]
    kills = [e.fired for e in fired if e.target != "broker"]
    per_kind = Counter(k["kind"] for k in kills if k.get("pid"))
    if sum(per_kind.values()) < args.kills:
        failures.append(f"{sum(per_kind.values())} kills < {args.kills}")
    missing_kinds = [k for k in KINDS if not per_kind.get(k)]
    if missing_kinds:
        failures.append(f"no kill of {missing_kinds}")
    log = pipe.log_path.read_text(errors="replace")
    steps = [(r["ts"], r["step"]) for r in pipe.log_lines("learner-0", t0) if r.get("msg") == "step"]
    for e in fired:  # what each event cost the training: when the learner got 1, 2, 5, 10 steps further
        t_event = e.fired.get("t", e.fired.get("t_kill"))
        if t_event is not None and e.fired.get("step") is not None:
            e.fired["learner_step_at"] = learner_progress_after(steps, t_event, e.fired["step"])
    result = {
        "benchmark": "chaos",
        "what": "tiny pipeline under steadyrl up; SIGKILL of every kind of service on a seeded schedule, broker "
                "restarted; then an exactly-once audit from the topics and the learner's audit log",
        "passed": not failures, "failures": failures,
        "seed": args.seed, "order": args.order, "budget_s": args.budget_s, "steps": args.steps,
        "scale": scale, "batch": lc["prompts_per_step"], "group_size": lc["group_size"],
        "max_staleness": lc["max_staleness"], "checkpoint_every": lc.get("checkpoint_every", 5),
        "wall_s": round(wall_run, 1),
        "kills": sum(per_kind.values()), "kills_per_kind": {k: per_kind.get(k, 0) for k in KINDS},
        "broker_restarts": [e.fired for e in fired if e.target == "broker"],
        "restarts_seen_by_up": {inst: log.count(f"{inst.ljust(max(map(len, pipe.instances)))} | exited with")
                                for inst in pipe.instances},
        "recovery_under_chaos_s": {k: summarize([x.get("recovered_s") for x in kills if x.get("kind") == k])
                                   for k in KINDS},
        # from the event until the learner had completed 5 more steps (the first one or two may
        # come from groups scored before the event: max_staleness 1 keeps 2 batches in flight)
        "training_stall_s": {k: summarize([x.get("learner_step_at", {}).get("+5") for x in kills
                                           if x.get("kind") == k]) for k in KINDS}
        | {"broker": summarize([e.fired.get("learner_step_at", {}).get("+5") for e in fired if e.target == "broker"])},
        "audit": aud,
        "schedule": [{"at_step": e.at_step, "target": e.target, "burst": e.burst} for e in events],
        "events": [e.fired for e in fired],
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    return result


def learner_progress_after(steps: list[tuple[float, int]], t: float, step: int) -> dict:
    """Seconds after `t` at which the learner completed step + k (k = 1, 2, 5, 10): how long
    an event stalled training (the first step may come from groups scored before it)."""
    out = {}
    for k in (1, 2, 5, 10):
        done = [ts for ts, s in steps if ts >= t and s >= step + k]
        out[f"+{k}"] = round(done[0] - t, 1) if done else None
    return out


def fire(pipe: Pipeline, ev: Event, step: int, measurers: list, stop: threading.Event, deadline: float,
         args: argparse.Namespace) -> None:
    """Carry out one event: restart the broker (blocking), or SIGKILL the target and measure its
    recovery in a thread."""
    if ev.target == "broker":
        ev.fired = {"target": "broker", "step": step,
                    "what": f"broker {'SIGKILL' if args.broker_signal == 'kill' else 'SIGTERM'}, restarted"}
        ev.fired.update(pipe.restart_broker(args.broker_signal, args.broker_down_s))
        # until the learner completes a step again
        t_up = time.time()
        s0 = pipe.progress().get("step")
        while time.time() < deadline and pipe.running():
            s = pipe.progress().get("step")
            if s is not None and s0 is not None and s > s0:
                ev.fired["next_step_after_start_s"] = round(time.time() - t_up, 2)
                break
            s0 = s if s0 is None else s0
            time.sleep(0.2)
        return
    pid, waited = pipe.pid(ev.target), time.time()
    while pid is None and time.time() < deadline and pipe.running():  # in its restart backoff: wait
        time.sleep(0.1)
        pid = pipe.pid(ev.target)
    ev.fired = {"target": ev.target, "kind": kind_of(ev.target), "step": step, "burst": ev.burst,
                "what": "SIGKILL", "waited_for_process_s": round(time.time() - waited, 2)}
    if pid is None:
        ev.fired["what"] = "not running; no kill"
        return
    ev.fired["pid"] = pid
    box = ev.fired

    def measure():
        box.update(kill_and_measure(pipe, ev.target, pid, timeout_s=120, stop=stop))

    t = threading.Thread(target=measure, daemon=True)
    t.start()
    measurers.append(t)
    deadline_kill = time.time() + 5
    while alive(pid) and time.time() < deadline_kill:  # the kill has happened before we go on
        time.sleep(0.02)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1, help="fixes the schedule (targets, order, steps)")
    ap.add_argument("--kills", type=int, default=20, help="SIGKILLs in all (each kind at least kills // 5)")
    ap.add_argument("--order", choices=["random", "round-robin"], default="random",
                    help="random: kinds shuffled; round-robin: reward-server, actor, rollout, reward, learner, ...")
    ap.add_argument("--steps", type=int, default=300, help="learner steps of the run (events spread over them)")
    ap.add_argument("--budget-s", type=float, default=600.0, help="wall-clock bound of the whole run and audit")
    ap.add_argument("--audit-reserve-s", type=float, default=60.0, help="part of the budget kept for the audit")
    ap.add_argument("--broker-restarts", type=int, default=1)
    ap.add_argument("--broker-signal", choices=["kill", "term"], default="kill")
    ap.add_argument("--broker-down-s", type=float, default=3.0, help="seconds between the broker's stop and start")
    ap.add_argument("--min-gap-s", type=float, default=3.0, help="least seconds between two events (not bursts)")
    ap.add_argument("--burst", type=float, default=0.15, help="chance an event fires with the previous one")
    ap.add_argument("--scale", action="append", default=[], metavar="SERVICE=N",
                    help="rollout/reward instances (default rollout=2, reward=2)")
    ap.add_argument("--state-dir", default="/tmp/steadyrl-chaos")
    ap.add_argument("--port", type=int, default=19592, help="broker port (controller: port + 1)")
    ap.add_argument("--port-offset", type=int, default=6000, help="added to every service port")
    ap.add_argument("--out", default=str(ROOT / "bench/results/chaos.json"))
    return ap


def main() -> int:
    args = build_parser().parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # finally blocks stop what we started
    result = run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    brief = {k: result[k] for k in ("passed", "failures", "wall_s", "kills", "kills_per_kind",
                                    "recovery_under_chaos_s", "training_stall_s")}
    brief["broker_restarts"] = len(result["broker_restarts"])
    brief["audit"] = {k: result["audit"].get(k) for k in ("ok", "checks", "trained", "published_ids",
                                                           "dlq_reasons", "error") if k in result["audit"]}
    print(json.dumps(brief, indent=2))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

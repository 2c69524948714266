"""Recovery time after kill -9 of each service, one kill at a time, on the tiny pipeline.

    .venv/bin/python bench/recovery.py [--rounds 3] [--seed 0] [--out bench/results/recovery.json]

`steadyrl up` (configs/tiny.yaml, one instance of each service, no evaluation, steps enough
never to finish) on our own broker (`--port`, services on `--port-offset`). `--rounds`
rounds of one SIGKILL of each kind (order shuffled by `--seed`). Before each kill the
pipeline must be healthy: every /readyz 200, the learner 3 steps past the last recovery, and
the victim up for more than 60 s (so `up` restarts it after its first backoff, 1 s, not a
doubled one). Recovered means (bench/chaos.py `kill_and_measure`):

    rollout, reward   the restarted instance commits a transaction: its input partitions
                      are consumed again (steadyrl_stage_last_commit_timestamp_seconds)
    actor             /readyz 200, then a rollout worker commits a rollout
    reward-server     /readyz 200, then a reward worker's call to it succeeds
                      (steadyrl_reward_calls_total{outcome="ok"} grows)
    learner           the restarted learner completes a step (/progress); also reported:
                      the time until it is past the step it was killed at

Per kill the phases come from the restarted process's own log lines (ts): process start,
HTTP up, init_transactions done ("stage running"), partitions assigned, policy caught up,
run resumed, first step. Result: median and max per service and the median of each phase.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.chaos import kill_and_measure, prepare_state, summarize, write_config  # noqa: E402
from steadyrl.testing.stack import KINDS, Pipeline, proc_start_epoch  # noqa: E402

#: Phases of a restart, in order, per kind: (name, from, to) over kill_and_measure's record
#: (spawn_s, ready_s, recovered_s, caught_up_s) and its log phases (http, txn_init, ...).
SEGMENTS = {
    "rollout": [("exit noticed + backoff", None, "spawn"), ("imports, HTTP up", "spawn", "http"),
                ("init_transactions (fencing)", "http", "txn_init"),
                ("group join (dead member's session times out)", "txn_init", "assigned"),
                ("first batch + commit", "assigned", "recovered")],
    "actor": [("exit noticed + backoff", None, "spawn"), ("imports, HTTP up", "spawn", "http"),
              ("model load + rl.policy + newest weights", "http", "policy"), ("readyz", "policy", "ready"),
              ("rollout worker retry backoff + generate + commit", "ready", "recovered")],
    "reward-server": [("exit noticed + backoff", None, "spawn"), ("imports, HTTP up", "spawn", "http"),
                      ("scorers ready", "http", "ready"),
                      ("worker: retry backoff / breaker probe, then a call", "ready", "recovered")],
    "learner": [("exit noticed + backoff", None, "spawn"), ("imports, HTTP up", "spawn", "http"),
                ("torch + model + checkpoint restore", "http", "resumed"),
                ("first step (re-read groups, regenerate what the lost steps' weights made)", "resumed",
                 "recovered"),
                ("redo the steps after the checkpoint", "recovered", "caught_up")],
}
SEGMENTS["reward"] = SEGMENTS["rollout"]


def _points(rec: dict) -> dict:
    p = {"spawn": rec.get("spawn_s"), "ready": rec.get("ready_s"), "recovered": rec.get("recovered_s"),
         "caught_up": rec.get("caught_up_s")}
    p.update(rec.get("phases", {}))
    return p


def breakdown(kind: str, recs: list[dict]) -> dict:
    """Median seconds of each phase of `kind`'s restarts, and which one dominates."""
    out = {}
    for name, a, b in SEGMENTS[kind]:
        vals = []
        for r in recs:
            p = _points(r)
            start = 0.0 if a is None else p.get(a)
            if start is not None and p.get(b) is not None:
                vals.append(p[b] - start)
        if vals:
            out[name] = round(statistics.median(vals), 2)
    dominant = max(out, key=out.get) if out else None
    return {"phases_median_s": out, "dominated_by": dominant}


def wait_healthy(pipe: Pipeline, victim: str, last_step: int, min_age_s: float, deadline: float) -> int:
    """Until every instance is ready, the learner is 3 steps past `last_step` and the victim has
    run for `min_age_s`. Returns the learner's step."""
    while time.time() < deadline:
        step = pipe.progress().get("step")
        pid = pipe.pid(victim)
        started = proc_start_epoch(pid) if pid else None
        if (step is not None and step >= last_step + 3 and started is not None and time.time() - started >= min_age_s
                and all(pipe.ready(i) for i in pipe.instances)):
            return step
        time.sleep(0.5)
    raise TimeoutError(f"pipeline not healthy before the deadline (victim {victim})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="kills per service")
    ap.add_argument("--seed", type=int, default=0, help="order of the kinds within each round")
    ap.add_argument("--min-age-s", type=float, default=62.0,
                    help="least uptime of a victim (up resets its restart backoff to 1 s after 60 s)")
    ap.add_argument("--budget-s", type=float, default=1500.0, help="wall-clock bound of the whole bench")
    ap.add_argument("--state-dir", default="/tmp/steadyrl-recovery")
    ap.add_argument("--port", type=int, default=19592, help="broker port (controller: port + 1)")
    ap.add_argument("--port-offset", type=int, default=6000)
    ap.add_argument("--out", default=str(ROOT / "bench/results/recovery.json"))
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    state_dir = Path(args.state_dir).resolve()
    prepare_state(state_dir)
    config = write_config(state_dir, steps=1_000_000, eval_data=None)
    pipe = Pipeline(state_dir, args.port, args.port_offset, config, {"rollout": 1, "reward": 1})
    rng = random.Random(args.seed)
    t0 = time.time()
    deadline = t0 + args.budget_s
    kills: list[dict] = []
    try:
        pipe.start()
        last_step = 2
        for r in range(args.rounds):
            order = list(KINDS)
            rng.shuffle(order)
            for kind in order:
                victim = f"{kind}-0"
                last_step = wait_healthy(pipe, victim, last_step, args.min_age_s, deadline)
                rec = kill_and_measure(pipe, victim, pipe.pid(victim), timeout_s=180)
                rec["round"] = r
                kills.append(rec)
                print(json.dumps({k: v for k, v in rec.items() if k != "phases"} | {"phases": rec["phases"]}),
                      flush=True)
                if rec["recovered_s"] is None:
                    raise RuntimeError(f"{victim} did not recover within 180 s")
                last_step = pipe.progress().get("step") or last_step
    finally:
        rc = pipe.stop()
    per_kind = {}
    for kind in KINDS:
        recs = [k for k in kills if k["kind"] == kind]
        per_kind[kind] = {"recovered_s": summarize([k["recovered_s"] for k in recs]),
                          "ready_s": summarize([k.get("ready_s") for k in recs]),
                          **breakdown(kind, recs)}
        if kind == "learner":
            per_kind[kind]["caught_up_s"] = summarize([k.get("caught_up_s") for k in recs])
            per_kind[kind]["steps_redone"] = [k["step_at_kill"] - k["restored_step"] for k in recs
                                              if "restored_step" in k and "step_at_kill" in k]
        if kind == "reward-server":
            per_kind[kind]["breaker_opened"] = [k.get("breaker_opened") for k in recs]
    out = {
        "benchmark": "recovery",
        "what": "seconds from SIGKILL of one service (tiny pipeline under steadyrl up) until it is recovered: "
                "stage partitions consumed again, actor serving a rollout, reward server scoring through the "
                "worker, learner's next completed step",
        "rounds": args.rounds, "seed": args.seed, "config": "configs/tiny.yaml (eval off), one instance each",
        "supervisor_backoff_s": 1.0, "group_session_timeout_s": 10.0, "checkpoint_every": 5,
        "wall_s": round(time.time() - t0, 1), "up_exit": rc,
        "per_service": per_kind, "kills": kills,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(per_kind, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

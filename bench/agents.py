"""Agents (issue 48): episode turns per second at the actor, episodes interleaved against one
episode at a time, and what a turn's Kafka transaction costs against the turn's generation.

    .venv/bin/python bench/agents.py [--out bench/results/agents_<date>.json] [--repeats 5]

Starts a broker (temporary folder) and the real actor (tiny model, `python -m
steadyrl.services.actor`), and drives the rollout worker's own episode code
(services/rollout/episodes.py EpisodeRunner) against it:

- turns: G groups x n episodes, T assistant turns each, an environment that never ends the
  episode (so every episode has T turns) and answers each turn with a short message. Interleaved:
  one `EpisodeRunner.turn` of all G groups per turn, as a rollout worker does with a batch (one
  /generate of the G x n episodes). One at a time: each episode alone, its T turns one /generate
  each. Same prompts, seeds, max_new_tokens and turns; reported as episode turns per second.
- transaction: the G groups' states after their T turns, passed round rl.episodes by a
  transactional Stage (steadyrl/bus/stage.py) whose handler only counts the turn: consume the
  states, produce the next states, send the offsets and commit, then read them back: the turn
  cycle without generation, and the commit alone, against the interleaved turn's generation.

Every figure is repeated (`--repeats`): min and median. The machine is named in the output; a
shared machine makes every time noisy (say so beside the figures).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from steadyrl.bus.stage import Output, Stage  # noqa: E402
from steadyrl.bus.topics import create_topics  # noqa: E402
from steadyrl.local.broker import LocalBroker  # noqa: E402
from steadyrl.local.jars import fetch  # noqa: E402
from steadyrl.local.ports import free_port  # noqa: E402
from steadyrl.model.models import tiny_tokenizer  # noqa: E402
from steadyrl.services.rollout.episodes import AgentSection, EpisodeRunner  # noqa: E402
from steadyrl.testing.procs import ServiceProc, produce_all  # noqa: E402
from steadyrl.wire import codec  # noqa: E402
from steadyrl.wire.contracts import EpisodeState, Prompt  # noqa: E402


class Again:
    """Never done: every answer gets "again", so every episode runs max_turns turns."""

    def reset(self, row: dict[str, Any]) -> list[dict[str, str]]:
        return list(row["messages"])

    def step(self, messages: list[dict[str, str]]) -> tuple[list[dict[str, str]], float | None, bool]:
        return [{"role": "user", "content": "again"}], None, False


def _timed(obj: Any, method: str) -> list[float]:
    """Wrap `obj.method` so that each call's seconds are appended to the list returned."""
    seconds: list[float] = []
    call = getattr(obj, method)

    def timed(*args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return call(*args)
        finally:
            seconds.append(time.perf_counter() - t0)

    setattr(obj, method, timed)
    return seconds


def prompt(i: int, n: int, max_new: int) -> Prompt:
    return Prompt(prompt_id=f"bench/e0-i{i}", epoch=0, index=i, n_samples=n, ground_truth=str(i % 10),
                  max_new_tokens=max_new, messages=[{"role": "user", "content": str(i % 10)}], seed=1000 + i)


def runner(url: str, turns: int) -> tuple[EpisodeRunner, list[float]]:
    """The worker's EpisodeRunner on the actor at `url`, and the list its /generate times go to."""
    r = EpisodeRunner(AgentSection(model="tiny", max_turns=turns), url, httpx.Client(), 120.0, 1.0,
                      tok=tiny_tokenizer(), factory=Again)
    return r, _timed(r, "_generate")


def started(r: EpisodeRunner, p: Prompt) -> EpisodeState:
    s = r.start(p)
    assert isinstance(s, EpisodeState), s
    return s


def run_turns(url: str, groups: int, n: int, turns: int, max_new: int,
              interleaved: bool) -> tuple[dict[str, float], list[EpisodeState]]:
    """G x n episodes of `turns` turns; interleaved (a batch's turn per call) or one episode at a time."""
    r, gen_s = runner(url, turns)
    if interleaved:
        states = [started(r, prompt(i, n, max_new)) for i in range(groups)]
        t0 = time.perf_counter()
        for _ in range(turns):
            out = r.turn(states)
            assert all(isinstance(s, EpisodeState) for s in out), out
    else:
        states = []
        for i in range(groups):
            for _ in range(n):   # each episode as a group of one (started before the clock)
                one = started(r, prompt(i, n, max_new))
                one.episodes = one.episodes[:1]
                states.append(one)
        t0 = time.perf_counter()
        for one in states:
            for _ in range(turns):
                assert isinstance(r.turn([one])[0], EpisodeState)
    wall = time.perf_counter() - t0
    done = sum(len(ep.turn_versions) for s in states for ep in s.episodes)
    assert done == groups * n * turns, done
    return {"seconds": wall, "turns": done, "turns_per_s": done / wall, "generate_calls": len(gen_s),
            "generate_s": sum(gen_s), "generate_per_call_ms": 1000 * statistics.median(gen_s)}, states


def turn_transactions(bootstrap: str, prefix: str, states: list[EpisodeState], turns: int) -> dict[str, Any]:
    """`states` passed round rl.episodes `turns` times by a transactional Stage that only counts
    the turn (no generation): the seconds of each turn cycle and of each commit."""
    seen: dict[str, int] = {}
    done = threading.Event()
    cycles: list[float] = []
    last = [0.0]

    def handle(items: list[tuple[Any, Any]]) -> list[Any]:
        now = time.perf_counter()
        if last[0]:
            cycles.append(now - last[0])
        last[0] = now
        out: list[Any] = []
        for s, _ in items:
            s.turn += 1
            seen[s.prompt_id] = s.turn
            out.append([Output("rl.episodes", s.prompt_id, s)] if s.turn < turns else [])
        if len(seen) == len(states) and all(t >= turns for t in seen.values()):
            done.set()
        return out

    stage = Stage(name="bench-turn", bootstrap=bootstrap, topic_prefix=prefix, instance_id="b0",
                  input_topic="rl.episodes", input_contract=EpisodeState, group_id=f"{prefix}bench-turn",
                  handle_batch=handle, batch_size=len(states))
    commits = _timed(stage, "_commit_transaction")
    stop = threading.Event()
    th = threading.Thread(target=stage.run, args=(stop,), daemon=True)
    th.start()
    for s in states:
        s.turn = 0
    sizes = [len(codec.encode(s)[0]) for s in states]
    produce_all(bootstrap, f"{prefix}rl.episodes", [(s.prompt_id, *codec.encode(s)) for s in states])
    assert done.wait(300), seen
    stop.set()
    th.join(60)
    # the first cycle waits for the group to form and the first fetch: left out
    return {"cycles": len(cycles), "cycle_ms": [1000 * c for c in cycles[1:]],
            "commit_ms": [1000 * c for c in commits], "state_bytes_median": statistics.median(sizes)}


def summary(xs: list[float]) -> dict[str, float]:
    return {"min": round(min(xs), 2), "median": round(statistics.median(xs), 2), "n": len(xs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / f"agents_{datetime.date.today():%Y%m%d}.json"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-new", type=int, nargs="+", default=[4, 16])
    args = ap.parse_args()
    fetch()
    result: dict[str, Any] = {
        "bench": "agents", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"nproc": os.cpu_count(), "cpu": _cpu(), "platform": platform.platform(),
                    "load_avg_start": os.getloadavg()},
        "shape": {"groups": args.groups, "episodes_per_group": args.n, "turns": args.turns, "model": "tiny",
                  "env_message": "again"},
        "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        broker = LocalBroker(Path(tmp) / "broker", port=free_port(), controller_port=free_port())
        broker.start()
        actor = None
        try:
            prefix = "bench."
            create_topics(broker.bootstrap, prefix)
            actor = ServiceProc("actor", ["--bootstrap", broker.bootstrap, "--topic-prefix", prefix,
                                          "--instance-id", "a0", "--actor.model", "tiny", "--actor.policy-root",
                                          tmp, "--metrics-port", str(free_port())], Path(tmp) / "actor.log")
            actor.wait_ready()
            run_turns(actor.url, 2, 2, 2, 4, True)   # warm up: the first calls build caches
            for max_new in args.max_new:
                row: dict[str, Any] = {"max_new_tokens": max_new}
                for how in ("interleaved", "one_at_a_time"):
                    reps = [run_turns(actor.url, args.groups, args.n, args.turns, max_new, how == "interleaved")[0]
                            for _ in range(args.repeats)]
                    row[how] = {"turns_per_s": summary([r["turns_per_s"] for r in reps]),
                                "generate_calls": reps[0]["generate_calls"],
                                "generate_per_call_ms": summary([r["generate_per_call_ms"] for r in reps])}
                    print(max_new, how, row[how], flush=True)  # noqa: T201
                row["speedup_median"] = round(row["interleaved"]["turns_per_s"]["median"]
                                              / row["one_at_a_time"]["turns_per_s"]["median"], 1)
                _, states = run_turns(actor.url, args.groups, args.n, args.turns, max_new, True)
                cyc: list[float] = []
                com: list[float] = []
                size = 0.0
                for k in range(args.repeats):
                    p = f"bench{max_new}x{k}."
                    create_topics(broker.bootstrap, p)
                    t = turn_transactions(broker.bootstrap, p, [s.model_copy(deep=True) for s in states], 20)
                    cyc += t["cycle_ms"]
                    com += t["commit_ms"]
                    size = t["state_bytes_median"]
                gen_ms = row["interleaved"]["generate_per_call_ms"]
                row["transaction"] = {"turn_cycle_ms": summary(cyc), "commit_ms": summary(com),
                                      "state_bytes_median": size, "groups_per_transaction": args.groups,
                                      "cycle_over_generate_median": round(statistics.median(cyc)
                                                                          / gen_ms["median"], 2)}
                print(max_new, "transaction", row["transaction"], flush=True)  # noqa: T201
                result["rows"].append(row)
        finally:
            if actor is not None:
                actor.stop()
            broker.stop()
    result["machine"]["load_avg_end"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")  # noqa: T201
    return 0


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return platform.processor()
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "")


if __name__ == "__main__":
    raise SystemExit(main())

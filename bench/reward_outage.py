"""Reward stage throughput with the reward server down (breaker open, cached scores) vs healthy.

    .venv/bin/python bench/reward_outage.py [--groups 960] [--rounds 5] [--out bench/results/reward_outage.json]

One reward worker (real process, transactional stage) between a real broker and the real
reward server (numeric_match). Prompts: the first `--groups` rows of the arithmetic train
set, 8 samples each ("The answer is N", right for about a third of them). After a warm-up
pass with the server healthy (which fills the worker's score cache), `--rounds` rounds of:

    healthy   the server answers; a backlog of `--groups` groups is produced up front and
              the time until the last scored group is read (read_committed) is measured
    outage    the server is SIGSTOPped (a hang: connections accepted, nothing answered);
              a small batch first trips the breaker (3 timeouts of `--timeout` s, timed as
              time_to_open); then the same backlog measurement with the breaker open; then
              SIGCONT and the time until the breaker closes again (probe, trial call)

Each pass uses the same prompt texts with new prompt ids and new responses. For the outage
passes it also reports how often the cached reward equals the reward the scorer would have
given: the share of repeated responses (exact) and the mean absolute error. Starts and stops its
own broker, server and worker.
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

from bench._reward_stack import reward_stack  # noqa: E402
from bench.kafka_roundtrip import consumer, drain  # noqa: E402
from steadyrl.model.rewards import numeric_match  # noqa: E402
from steadyrl.testing.procs import produce_all  # noqa: E402
from steadyrl.wire import codec  # noqa: E402
from steadyrl.wire.contracts import Prompt, RolloutGroup, Sample  # noqa: E402

G = 8


def load_prompts(n: int) -> list[tuple[str, str]]:
    import pyarrow.parquet as pq

    rows = pq.read_table(ROOT / "data/arithmetic/train.parquet").slice(0, n).to_pylist()
    return [(r["prompt"][-1]["content"], r["reward_model"]["ground_truth"]) for r in rows]


def make_groups(prompts, tag: str, rng: random.Random) -> list[RolloutGroup]:
    out = []
    for i, (text, truth) in enumerate(prompts):
        p = Prompt(prompt_id=f"{tag}-{i}", epoch=0, index=i, n_samples=G, data_source="arith", ground_truth=truth,
                   messages=[{"role": "user", "content": text}])
        answers = [truth if rng.random() < 0.35 else str(rng.randrange(0, 1000)) for _ in range(G)]
        out.append(RolloutGroup(prompt=p, policy_version=0,
                                samples=[Sample(text=f"The answer is {a}", token_ids=[1], logprobs=[-0.1])
                                         for a in answers]))
    return out


def produce(bootstrap: str, topic: str, groups: list[RolloutGroup]) -> float:
    """Produce the groups and wait for every acknowledgement; returns the start time."""
    t0 = time.time()
    produce_all(bootstrap, topic, [(g.prompt_id, *codec.encode(g)) for g in groups])
    return t0


def run_pass(bootstrap: str, prefix: str, groups: list[RolloutGroup], timeout_s: float = 600) -> dict:
    c = consumer(bootstrap, f"{prefix}rl.scored")
    t0 = produce(bootstrap, f"{prefix}rl.rollouts", groups)
    got = drain(c, len(groups), timeout_s)
    c.close()
    if len(got) < len(groups):
        raise RuntimeError(f"only {len(got)} of {len(groups)} groups scored in {timeout_s} s")
    elapsed = max(t for t, _ in got) - t0
    scored = [s for _, s in got]
    sources = {}
    for s in scored:
        sources[s.reward_source.value] = sources.get(s.reward_source.value, 0) + 1
    errors, repeats = [], 0
    for s in scored:
        if s.reward_source.value != "cache":
            continue
        truth = [numeric_match("", x.text, s.group.prompt.ground_truth)["score"] for x in s.group.samples]
        errors += [abs(a - b) for a, b in zip(truth, s.rewards, strict=True)]
        repeats += sum(e.get("response_similarity") == 1.0 for e in s.reward_extra)
    return {"groups": len(scored), "seconds": round(elapsed, 3), "groups_per_s": round(len(scored) / elapsed, 1),
            "sources": sources,
            # cache-scored samples: share that repeat a scored response (their reward is exact),
            # and the mean |cached reward - the scorer's reward| over all of them
            "cached_repeat_share": round(repeats / len(errors), 4) if errors else None,
            "cached_reward_mae": round(sum(errors) / len(errors), 4) if errors else None,
            "cache_similarity_median": (statistics.median(s.cache_similarity for s in scored
                                                          if s.cache_similarity is not None)
                                        if sources.get("cache") else None)}


def unseen_prompt_matches(n: int, floors=(0.8, 0.9, 0.95)) -> dict:
    """Offline: cache the first n prompts' scored groups, look up the next n (never scored).
    At each floor: how many match another prompt on text alone (what the answer-key check
    refuses), and how many match one with the same data_source and ground truth (served)."""
    from steadyrl.services.reward.cache import ScoreCache

    prompts = load_prompts(2 * n)
    rng = random.Random(1)
    seen, unseen = make_groups(prompts[:n], "s", rng), make_groups(prompts[n:], "u", rng)
    out = {}
    for floor in floors:
        text_only, keyed = ScoreCache(1000, floor), ScoreCache(1000, floor)
        for g in seen:
            rewards = [numeric_match("", x.text, g.prompt.ground_truth)["score"] for x in g.samples]
            args = (g.prompt_id, g.prompt.messages[-1].content, [x.text for x in g.samples], rewards, "rule")
            text_only.add(*args)
            keyed.add(*args, (g.prompt.data_source, g.prompt.ground_truth))
        responses = lambda g: [x.text for x in g.samples]  # noqa: E731
        out[str(floor)] = {
            "unseen_prompts": len(unseen),
            "match_on_text_alone": sum(text_only.lookup(g.prompt.messages[-1].content, responses(g)) is not None
                                       for g in unseen),
            "match_with_same_answer": sum(keyed.lookup(g.prompt.messages[-1].content, responses(g),
                                                       (g.prompt.data_source, g.prompt.ground_truth)) is not None
                                          for g in unseen)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=960, help="prompts per pass (<= the worker cache, 1000)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=2.0, help="reward.timeout_s of the worker")
    ap.add_argument("--out", default=str(ROOT / "bench/results/reward_outage.json"))
    args = ap.parse_args()
    prompts = load_prompts(args.groups)
    rng = random.Random(0)
    rounds = []
    prefix = "bench."
    worker_args = ["--reward.timeout-s", str(args.timeout), "--reward.retry-backoff-s", "0.2",
                   "--reward.probe-interval-s", "0.5"]
    with reward_stack(worker_args, prefix) as (bootstrap, server, worker):
        run_pass(bootstrap, prefix, make_groups(prompts, "warm", rng))  # fills the score cache
        for r in range(args.rounds):
            healthy = run_pass(bootstrap, prefix, make_groups(prompts, f"h{r}", rng))
            server.proc.send_signal(signal.SIGSTOP)
            t0 = time.monotonic()
            run_pass(bootstrap, prefix, make_groups(prompts[:16], f"trip{r}", rng))
            time_to_open = time.monotonic() - t0
            assert worker.metric("steadyrl_reward_breaker_state", {"state": "open"}) == 1
            outage = run_pass(bootstrap, prefix, make_groups(prompts, f"o{r}", rng))
            server.proc.send_signal(signal.SIGCONT)
            t0 = time.monotonic()
            while worker.metric("steadyrl_reward_breaker_state", {"state": "closed"}) != 1:
                run_pass(bootstrap, prefix, make_groups(prompts[:1], f"back{r}-{time.time_ns()}", rng))
            time_to_close = time.monotonic() - t0
            rounds.append({"healthy": healthy, "outage": outage, "time_to_open_s": round(time_to_open, 2),
                           "time_to_close_s": round(time_to_close, 2)})
            print(json.dumps(rounds[-1]), flush=True)
    healthy = statistics.median(r["healthy"]["groups_per_s"] for r in rounds)
    outage = statistics.median(r["outage"]["groups_per_s"] for r in rounds)
    out = {
        "benchmark": "reward_outage",
        "what": "groups/s through one reward worker (produce backlog -> transactional stage -> read_committed), "
                "reward server healthy vs hanging (SIGSTOP) with the breaker open and cached scores",
        "groups_per_pass": args.groups, "samples_per_group": G, "worker_timeout_s": args.timeout,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "healthy_groups_per_s_median": healthy, "outage_groups_per_s_median": outage,
        "outage_vs_healthy": round(outage / healthy, 3), "target": ">= 0.90",
        "unseen_prompts_matched_by_floor": unseen_prompt_matches(args.groups),
        "rounds": rounds,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "rounds"}, indent=2))


if __name__ == "__main__":
    main()

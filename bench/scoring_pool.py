"""What scoring rule rewards in worker processes costs per item (issue 46).

    .venv/bin/python bench/scoring_pool.py [--calls 200] [--rounds 3] [--out bench/results/scoring_pool.json]

The reward server's /score logic (RewardServer.score, without HTTP) at the default shape:
64 items a call (a reward worker's 16 groups of 4 samples), `numeric_match`, answers that
differ. Two arms, alternated round by round: `in_thread` (reward_server.processes 0: the
scorer called in the request's thread, as before issue 46) and `pool` (the default: a
steadyrl.model.scorepool.ScoringPool of min(8, max(2, CPUs)) processes, each item sent over a
socket and checked there). Reports, per arm, the median over rounds of the mean seconds per
item and per call, and the pool's extra cost per item. Also one call of 64 items through
HTTP for each arm (the client's view). CPU-shared machines: repeat it and say so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from steadyrl.services.reward.server import RewardServer, RewardServerSection, ScoreItem, ScoreRequest  # noqa: E402

ITEMS = 64


def _request() -> ScoreRequest:
    items = [ScoreItem(data_source="arith", prompt=f"What is {i // 4} + {i % 7}?",
                       response=f"Let me think. {i // 4} + {i % 7} = \\boxed{{{i // 4 + i % 7 + (i % 3 == 0)}}}",
                       ground_truth=str(i // 4 + i % 7)) for i in range(ITEMS)]
    return ScoreRequest(scorer="numeric_match", items=items)


def _arm(server: RewardServer, req: ScoreRequest, calls: int) -> float:
    """Mean seconds per call over `calls` calls (after 5 warm-up calls)."""
    for _ in range(5):
        server.score(req)
    t0 = time.perf_counter()
    for _ in range(calls):
        out = server.score(req)
    took = (time.perf_counter() - t0) / calls
    assert all(s["reward"] is not None for s in out["scores"])
    return took


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "scoring_pool.json"))
    args = ap.parse_args()
    req = _request()
    load_before = os.getloadavg()[0]
    servers = {"in_thread": RewardServer(RewardServerSection(processes=0)), "pool": RewardServer(RewardServerSection())}
    per_call: dict[str, list[float]] = {k: [] for k in servers}
    try:
        time.sleep(1.0)   # the pool's processes start
        for _ in range(args.rounds):
            for name, server in servers.items():
                per_call[name].append(_arm(server, req, args.calls))
    finally:
        for s in servers.values():
            s.close()
    med = {k: statistics.median(v) for k, v in per_call.items()}
    result = {
        "bench": "scoring_pool", "items_per_call": ITEMS, "scorer": "numeric_match", "calls": args.calls,
        "rounds": args.rounds, "pool_processes": RewardServerSection().pool_processes(),
        "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],   # before, after: a shared CPU
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "processor": platform.processor() or platform.machine()},
        "per_call_s": {k: [round(x, 6) for x in v] for k, v in per_call.items()},
        "per_item_us": {k: round(v / ITEMS * 1e6, 1) for k, v in med.items()},
        "pool_extra_per_item_us": round((med["pool"] - med["in_thread"]) / ITEMS * 1e6, 1),
        "pool_over_in_thread": round(med["pool"] / med["in_thread"], 1),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("per_item_us", "pool_extra_per_item_us", "pool_over_in_thread")}))  # noqa: T201
    return 0


if __name__ == "__main__":
    sys.exit(main())

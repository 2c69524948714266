"""bench/make_run.py --report: a seed's change is the mean of its runs, the figure is the mean
+- sd over seeds, and runs recorded before the seed was are listed but not averaged (before
this, the oldest run of seed 0, from another machine and feed order, stood for the seed)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import make_run  # noqa: E402


def run(run_id: str, delta: float, seed: int | None, weights: str = "w") -> dict:
    r = {"run_id": run_id, "code": "abc1234", "wall_seconds_total": 600.0, "final_weights": weights,
         "reward_per_step": [0.1], "eval_splits": {},
         "eval": {"before": 0.1, "after": 0.1 + delta, "delta": delta, "mcnemar_p": 0.01}}
    if seed is not None:
        r["seed"] = seed
    return r


def test_seed_mean_of_its_runs_then_mean_and_sd_over_seeds():
    runs = [run("old", 0.50, None), run("a", 0.10, 0, "x"), run("b", 0.20, 0, "y"), run("c", 0.05, 1)]
    text = make_run.report(runs, None)
    # seed 0: (10 + 20) / 2 = 15, seed 1: 5 -> mean 10.0, sd sqrt(50) = 7.1; the unseeded 50 left out
    assert "test: change +10.0 ± 7.1 points (mean ± sd over 2 seeds: seed 0 +15.0 (mean of 2), seed 1 +5.0)" in text
    assert "seed 0, 2 runs:" in text and "final_weights DIFFER" in text
    assert "1 run(s) without a recorded seed" in text
    assert "| none recorded | old |" in text


def test_code_filter_keeps_only_that_commit():
    runs = [run("a", 0.10, 0), {**run("b", 0.30, 1), "code": "def5678"}]
    text = make_run.report(runs, "abc")
    assert "| 0 | a |" in text and "| 1 | b |" not in text
    assert "over 2 seeds" not in text   # one seed left: no spread to give

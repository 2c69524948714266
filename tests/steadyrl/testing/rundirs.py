"""Learner run folders written by hand, as the learner lays them out (steadyrl.testing.run)."""

from __future__ import annotations

import json
from pathlib import Path


def write_run(state_dir: Path, run_id: str = "r20260101T000000-abcd", *, steps: int = 3, batch: int = 2,
              counts: dict | None = None, finished: bool = True, consumed: list[dict] | None = None,
              history: list[dict] | None = None, current: bool = True, summary: dict | None = None,
              abandoned: dict[str, str] | None = None) -> Path:
    """A run folder under `state_dir` (CURRENT names it unless current=False). By default an
    exactly-once run: `steps` steps of `batch` prompts `<run_id>/e0-i<k>`, each trained once."""
    run = state_dir / run_id
    run.mkdir(parents=True)
    if consumed is None:
        consumed = [{"step": s, "prompt_id": f"{run_id}/e0-i{(s - 1) * batch + j}", "partition": j % 8,
                     "offset": s, "policy_version": s - 1, "reward_mean": 0.5}
                    for s in range(1, steps + 1) for j in range(batch)]
    if history is None:
        history = [{"step": s, "reward_mean": 0.1 * s, "reward_std": 0.1, "tokens": 100 + s, "seconds": 0.5,
                    "policy_versions": [s - 1]} for s in range(1, steps + 1)]
    state = {"run_id": run_id, "config": {}, "step": steps, "policy_uri": f"{run_id}/v{steps}.safetensors",
             "policy_sha256": "0" * 64, "offsets": {}, "dlq_offset": -1, "feeder_position": steps * batch,
             "fed": steps * batch, "gate": {}, "in_flight": {}, "requeue": [], "quarantined": {}, "watch": {},
             "trained": [c["prompt_id"] for c in consumed], "counts": counts or {}, "history": history,
             "eval_before": None, "eval_after": None, "finished": finished, "abandoned": abandoned or {}}
    (run / "state.json").write_text(json.dumps(state))
    (run / "consumed.jsonl").write_text("".join(json.dumps(c) + "\n" for c in consumed))
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))
    if current:
        (state_dir / "CURRENT").write_text(run_id + "\n")
    return run


def published_ids(run_id: str = "r20260101T000000-abcd", n: int = 6) -> list[str]:
    """The prompt ids the feeder of write_run's default run published, one record each."""
    return [f"{run_id}/e0-i{k}" for k in range(n)]

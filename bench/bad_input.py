"""What a user's bad input costs a run (issue 33): the tiny pipeline with and without it.

    .venv/bin/python bench/bad_input.py [--steps 20] [--out bench/results/bad_input.json]

One broker of our own; `steadyrl up` (configs/tiny.yaml, no evaluation, `--steps` steps) on a
dataset of 40 good copy-task rows, in four arms, each at max_staleness 0 and 1:

    clean      the 40 rows
    bad_rows   + 5 rows the start-time check leaves out: a NaN in extra_info, a role `tool`,
               a null content, a prompt longer than the model's context, a prompt as a string
    refused    + 3 rows the reward server's scorer raises on, every time (abandoned after
               learner.prompt_max_refusals 2 refusals over prompt_min_refusal_s 1 s; the
               defaults are 5 and 60 s)
    both       the 48 rows

Per run: up's wall time to its exit, the seconds of the steps (history), restarts seen in the
log, bad rows reported and prompts abandoned. The scorer is this module's
`refusing_tiny_copy`, loaded by the reward server as `bench.bad_input:refusing_tiny_copy`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GOOD = 40


def refusing_tiny_copy(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """tiny_copy, raising on every item whose ground truth is `refuse`."""
    from steadyrl.model.rewards import tiny_copy

    if ground_truth == "refuse":
        raise ValueError("this row cannot be scored")
    return tiny_copy(data_source, solution_str, ground_truth, extra_info)


def rows(arm: str) -> list[dict]:
    """The arm's dataset, verl records."""
    out = [{"prompt": [{"role": "user", "content": str(i % 10)}], "reward_model": {"ground_truth": str(i % 10)}}
           for i in range(GOOD)]
    if arm in ("bad_rows", "both"):
        out += [{"prompt": [{"role": "user", "content": "3"}], "extra_info": {"x": math.nan}},
                {"prompt": [{"role": "tool", "content": "3"}]},
                {"prompt": [{"role": "user", "content": None}]},
                {"prompt": [{"role": "user", "content": "3" * 200}]},
                {"prompt": "3"}]
    if arm in ("refused", "both"):
        out += [{"prompt": [{"role": "user", "content": "5"}], "reward_model": {"ground_truth": "refuse"}}] * 3
    return [{"data_source": "tiny_copy", "reward_model": {"ground_truth": "3"}} | r for r in out]


def run_arm(bootstrap: str, work: Path, arm: str, staleness: int, steps: int, offset: int) -> dict:
    import yaml

    from steadyrl.testing import RunDir, audit_pipeline, unique_prefix

    folder = work / f"{arm}-s{staleness}"
    folder.mkdir(parents=True)
    data = folder / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows(arm)))
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg["learner"].update(data=str(data), eval_data=None, steps=steps, max_staleness=staleness,
                          prompt_max_refusals=2, prompt_min_refusal_s=1.0)
    cfg["reward_server"].update(scorers=["bench.bad_input:refusing_tiny_copy"],
                                default_scorer="bench.bad_input:refusing_tiny_copy")
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    prefix = unique_prefix()
    t0 = time.monotonic()
    with open(folder / "up.log", "wb") as log:
        rc = subprocess.run([sys.executable, "-m", "steadyrl.cli", "up", "--bootstrap", bootstrap, "--state-dir",
                             str(folder / "state"), "--prefix", prefix, "--port-offset", str(offset),
                             "--config", str(folder / "config.yaml")], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=900).returncode
    wall = time.monotonic() - t0
    text = (folder / "up.log").read_text(errors="replace")
    run = RunDir.of_up(folder / "state")
    st = run.state
    audit = audit_pipeline(bootstrap, prefix, run, steps, cfg["learner"]["prompts_per_step"], excuse_dlq=False)
    return {"arm": arm, "max_staleness": staleness, "rows": len(rows(arm)), "exit": rc, "wall_s": round(wall, 1),
            "steps_s": round(sum(h["seconds"] for h in run.history), 1), "step": st["step"],
            "restarts": text.count("restart #"), "bad_rows": st["counts"].get("bad_rows", 0),
            "abandoned": st["counts"].get("abandoned", 0), "dlq": st["counts"].get("dlq", 0),
            "audit_ok": audit["ok"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "bad_input.json")
    ap.add_argument("--work", type=Path, default=Path("/tmp/steadyrl-bench-bad-input"))
    args = ap.parse_args()
    from steadyrl.local.broker import LocalBroker
    from steadyrl.local.jars import fetch
    from steadyrl.local.ports import free_port

    fetch()
    import shutil

    shutil.rmtree(args.work, ignore_errors=True)
    broker = LocalBroker(args.work / "broker", port=free_port(), controller_port=free_port())
    broker.start()
    results = []
    try:
        for i, (arm, s) in enumerate((a, s) for s in (0, 1) for a in ("clean", "bad_rows", "refused", "both")):
            r = run_arm(broker.bootstrap, args.work, arm, s, args.steps, 3000 + 10 * i + os.getpid() % 7)
            print(json.dumps(r), flush=True)  # noqa: T201
            results.append(r)
    finally:
        broker.stop()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    args.out.write_text(json.dumps({"bench": "bad_input", "commit": commit, "steps": args.steps,
                                    "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
                                    "date": time.strftime("%Y-%m-%d"), "runs": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

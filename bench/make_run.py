"""`make run` measured: the whole `steadyrl up` with its defaults (SmolLM2-135M-Instruct through every
service, evaluation before and after), timed from start to exit, its summary appended to
bench/results/make_run.json.

    flock /tmp/steadyrl-bench.lock .venv/bin/python bench/make_run.py [--steps N] [--note TEXT]

`--steps N` sets `learner.steps` (STEADYRL_LEARNER__STEPS) to try another run length inside the
20-minute budget; without it the defaults are measured as they are. The run gets a fresh state
folder (`--state-dir`, removed first), so nothing is resumed; the broker is the one `up` starts
there. Prints the SUMMARY lines and the wall time; exits 1 when `up` fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def code_commit() -> str:
    """HEAD's short hash, with `+dirty` when the code the services run (services/, steadyrl/,
    configs/, data/) has uncommitted changes. Taken before the run starts."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "services", "steadyrl",
                            "configs", "data"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return head.strip() + ("+dirty" if dirty else "")


def phases(log_text: str) -> dict:
    """Seconds of the run's phases, from the learner's log lines (`evaluation`, `step`, and the
    first `policy published`): the evaluations before and after (all splits), the steps after
    the first (whose time holds the generation that overlapped the evaluation before), and the
    medians of their `train_step` and `wait` (the generation hop) timings."""
    import statistics

    from steadyrl.testing.stack import log_records

    learner = [rec for name, rec in log_records(log_text) if name.startswith("learner-")]

    def records(msg: str) -> list[dict]:
        return [rec for rec in learner if rec.get("msg") == msg]

    start = records("policy published")[0]["ts"]
    evals, steps = records("evaluation"), records("step")
    before = [e["ts"] for e in evals if e["when"] == "before"]
    after = [e["ts"] for e in evals if e["when"] == "after"]
    later = steps[1:]
    return {"eval_before_s": round(max(before) - start, 1) if before else None,
            "eval_after_s": round(max(after) - steps[-1]["ts"], 1) if after else None,
            "first_step_after_eval_s": round(steps[0]["ts"] - max(before), 1) if before else None,
            "step_s_after_the_first": [round(b["ts"] - a["ts"], 2) for a, b in zip(steps, later, strict=False)],
            "train_step_median_s": round(statistics.median(s["timing_s/train_step"] for s in later), 2),
            "generation_hop_median_s": round(statistics.median(s["timing_s/wait"] for s in later), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, help="learner.steps (default: the learner's default)")
    ap.add_argument("--state-dir", default="/tmp/steadyrl-make-run", help="removed first, then used by `up`")
    ap.add_argument("--note", default="", help="what this run is (written into the JSON)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/make_run.json"))
    args = ap.parse_args()

    state = Path(args.state_dir)
    shutil.rmtree(state, ignore_errors=True)
    env = dict(os.environ)
    if args.steps:
        env["STEADYRL_LEARNER__STEPS"] = str(args.steps)
    log = state.with_name(state.name + ".log")
    code = code_commit()
    t0 = time.monotonic()
    with open(log, "wb") as lf:
        up = subprocess.Popen([str(ROOT / ".venv/bin/steadyrl"), "up", "--state-dir", str(state)], cwd=ROOT,
                              env=env, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True)
        # stopped ourselves: `up` stops its services and its broker on SIGTERM; wait for that
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
        try:
            rc = up.wait()
        except BaseException:
            up.send_signal(signal.SIGTERM)
            up.wait(120)
            raise
    wall = time.monotonic() - t0
    text = log.read_text(errors="replace")
    for line in text.splitlines():
        if "SUMMARY" in line:
            print(line)  # noqa: T201
    print(f"wall {wall:.1f} s ({int(wall // 60)} min {wall % 60:.0f} s), rc {rc}, log {log}")  # noqa: T201
    if rc != 0:
        sys.exit(1)
    run = state / "learner" / (state / "learner" / "CURRENT").read_text().strip()
    s = json.loads((run / "summary.json").read_text())
    entry = {**s, "wall_seconds_total": round(wall, 1), "phases": phases(text), "code": code,
             "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             "machine": f"{os.cpu_count()} vCPU {platform.processor() or platform.machine()}, no GPU, torch CPU",
             "command": "bench/make_run.py" + (f" --steps {args.steps}" if args.steps else "") + " (steadyrl up)",
             "note": args.note}
    out = Path(args.out)
    doc = json.loads(out.read_text()) if out.exists() else {"runs": []}
    doc["runs"].append(entry)
    out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()

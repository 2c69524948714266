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
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def code_commit() -> str:
    """HEAD's short hash, with `+dirty` when the tree has uncommitted changes."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return head.strip() + ("+dirty" if dirty else "")


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
    t0 = time.monotonic()
    with open(log, "wb") as lf:
        rc = subprocess.run([str(ROOT / ".venv/bin/steadyrl"), "up", "--state-dir", str(state)], cwd=ROOT, env=env,
                            stdout=lf, stderr=subprocess.STDOUT).returncode
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
    entry = {**s, "wall_seconds_total": round(wall, 1), "code": code_commit(),
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

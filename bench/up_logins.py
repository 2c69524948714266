"""What closing `steadyrl up` to other local processes adds to its start (issue 46): `up
--exit-when-ready` on the tiny config, its own broker in a fresh state folder each time, by
default (SCRAM logins, ACLs, per-route HTTP tokens proven both ways) and with `--insecure`,
alternated, `--repeat` times each. Per run: the wall time from launch to exit (every service
ready), split at the lines `up` prints: the broker's start (from "starting Kafka broker" to its
topics line), what follows its `closed:` line (the services' start, their logins included), and,
by default, the seconds `up` itself spent on credentials, ACLs and tokens (the `closed: ... (N s)`
figure). Results appended to bench/results/up_logins.json.

    flock /tmp/steadyrl-bench.lock .venv/bin/python bench/up_logins.py [--repeat 2] [--note TEXT]

A fresh folder's broker is formatted each time (with the admin's SCRAM credential by default),
so the start measured is a new stack's, the longest one: a resumed state folder formats nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from steadyrl.local.ports import free_port_pair  # noqa: E402 - after the path


def one(insecure: bool, offset: int) -> dict[str, Any]:
    """One `up --exit-when-ready` in a fresh state folder; its wall time and `closed:` figure."""
    state = Path(tempfile.mkdtemp(prefix="up-logins-"))
    cmd = [sys.executable, "-m", "steadyrl.cli", "up", "--exit-when-ready", "--plain", "--config", "configs/tiny.yaml",
           "--state-dir", str(state), "--port", str(free_port_pair()), "--port-offset", str(offset),
           *(["--insecure"] if insecure else [])]
    t0 = time.monotonic()
    at: dict[str, float] = {}   # phase -> seconds from launch its line came
    lines = []
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        assert p.stdout is not None
        for line in p.stdout:
            lines.append(line)
            for phase, start in (("broker", "starting Kafka broker"), ("topics", "broker "),
                                 ("closed", "closed:"), ("closed", "--insecure:")):
                if line.startswith(start) and phase not in at:
                    at[phase] = round(time.monotonic() - t0, 2)
        rc = p.wait(600)
    wall = time.monotonic() - t0
    shutil.rmtree(state, ignore_errors=True)
    text = "".join(lines)
    closed = re.search(r"closed: .*\(([0-9.]+) s\)", text)
    return {"insecure": insecure, "rc": rc, "wall_s": round(wall, 2), "lines_at_s": at,
            "broker_start_s": round(at["topics"] - at["broker"], 2) if {"broker", "topics"} <= set(at) else None,
            "services_ready_s": round(wall - at["closed"], 2) if "closed" in at else None,
            "closing_s": float(closed[1]) if closed else None, "tail": text[-300:] if rc else ""}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    runs: list[dict[str, Any]] = []
    for _ in range(args.repeat):
        for insecure in (False, True):   # alternated: a drift of the machine's load hits both
            runs.append(one(insecure, 3500 + (os.getpid() + len(runs)) % 400))
            print(json.dumps(runs[-1]), flush=True)
    ok = [r for r in runs if r["rc"] == 0]
    closed = [r["wall_s"] for r in ok if not r["insecure"]]
    open_ = [r["wall_s"] for r in ok if r["insecure"]]
    result = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "nproc": os.cpu_count(),
              "machine": platform.processor() or platform.machine(), "note": args.note, "runs": runs,
              "median_wall_default_s": statistics.median(closed) if closed else None,
              "median_wall_insecure_s": statistics.median(open_) if open_ else None,
              "median_closing_s": statistics.median([r["closing_s"] for r in ok if r["closing_s"] is not None])
              if closed else None}
    for part in ("broker_start_s", "services_ready_s"):
        for name, insecure in (("default", False), ("insecure", True)):
            got = [r[part] for r in ok if r["insecure"] == insecure and r[part] is not None]
            result[f"median_{part.removesuffix('_s')}_{name}_s"] = statistics.median(got) if got else None
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}), flush=True)
    out = ROOT / "bench" / "results" / "up_logins.json"
    history = json.loads(out.read_text()) if out.exists() else []
    out.write_text(json.dumps([*history, result], indent=1) + "\n")
    return 0 if len(ok) == len(runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())

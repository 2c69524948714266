"""The start of a run on 1 000 000 rows against the same run on 1 000 (issue 46).

    flock /tmp/steadyrl-bench.lock .venv/bin/python bench/big_data.py [--repeats 2] [--out bench/results/big_data.json]
        [--code PATH --label before]   # the same arms with another checkout's code (e.g. main before the change)

One broker of our own; `steadyrl up` (configs/tiny.yaml: the tiny model on the copy task, no
evaluation, 2 steps) on a JSONL file of tiny copy-task rows (every 1 000th a bad one, role
`tool`), 1 000 rows and 1 000 000 rows, the arms alternated `--repeats` times. Per run:

    first_step_s    up's start to the learner's first step (its log's `step` line)
    start_s         the learner's start (its first log line) to its first step
    index_check_s   the learner's start to "dataset checked at start" (the file indexed and the
                    rows of the first step checked; absent with code of before the change, which
                    logged "dataset checked" after checking every row)
    cpu_s           the learner's CPU seconds (user + system) at its first step (sampled every
                    0.25 s): what the start cost, less sensitive to other work on the machine
    peak_rss_mb     the learner process's peak resident memory (VmHWM, polled every 0.25 s)

and the medians per arm. The machine is shared (2 cores, other work running): figures vary
by a few seconds from run to run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def write_rows(path: Path, n: int) -> None:
    """`n` tiny copy-task rows in verl's JSONL, every 1 000th with role `tool` (left out)."""
    lines = [json.dumps({"data_source": "tiny_copy", "prompt": [{"role": "tool" if d == 0 and k == 0 else "user",
                                                                  "content": str(d)}],
                         "reward_model": {"ground_truth": str(d)}}) + "\n" for k in range(100) for d in range(10)]
    block = "".join(lines)
    with open(path, "w") as f:
        for _ in range(n // 1000):
            f.write(block)


class PeakRss(threading.Thread):
    """The largest VmHWM (MB) of any process whose command line names the learner and `marker`,
    and its CPU seconds (user + system) over time: `cpu` [(unix time, seconds)]."""

    def __init__(self, marker: str):
        super().__init__(daemon=True)
        self.marker, self.peak, self.stop = marker, 0.0, threading.Event()
        self.cpu: list[tuple[float, float]] = []
        self._tick = os.sysconf("SC_CLK_TCK")

    def run(self) -> None:
        while not self.stop.wait(0.25):
            for proc in Path("/proc").iterdir():
                if not proc.name.isdigit():
                    continue
                try:
                    cmd = (proc / "cmdline").read_bytes()
                    if b"steadyrl.services.learner" not in cmd or self.marker.encode() not in cmd:
                        continue
                    for line in (proc / "status").read_text().splitlines():
                        if line.startswith("VmHWM"):
                            self.peak = max(self.peak, int(line.split()[1]) / 1024)
                    fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
                    self.cpu.append((time.time(), (int(fields[11]) + int(fields[12])) / self._tick))
                except OSError:
                    continue

    def cpu_at(self, t: float) -> float | None:
        """The learner's CPU seconds at the last sample before unix time `t`."""
        before = [c for ts, c in self.cpu if ts <= t]
        return round(before[-1], 1) if before else None


def run_arm(bootstrap: str, work: Path, rows: int, repeat: int, offset: int, code: Path | None) -> dict:
    import yaml

    from steadyrl.testing import unique_prefix

    folder = work / f"{rows}-{repeat}"
    folder.mkdir(parents=True)
    data = work / f"rows-{rows}.jsonl"
    if not data.exists():
        write_rows(data, rows)
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg["learner"].update(data=str(data), eval_data=None, steps=2)
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    state = folder / "state"
    env = {**os.environ, **({"PYTHONPATH": str(code)} if code else {})}
    for _ in range(5):   # a port another process holds (the machine is shared): another offset
        shutil.rmtree(state, ignore_errors=True)
        rss = PeakRss(str(state))
        rss.start()
        t0 = time.time()
        with open(folder / "up.log", "wb") as log:
            rc = subprocess.run([sys.executable, "-m", "steadyrl.cli", "up", "--bootstrap", bootstrap, "--state-dir",
                                 str(state), "--prefix", unique_prefix(), "--port-offset", str(offset),
                                 "--config", str(folder / "config.yaml")], cwd=code or ROOT, stdout=log, env=env,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=1800).returncode
        rss.stop.set()
        rss.join()
        if rc != 2 or "is held by pid" not in (folder / "up.log").read_text(errors="replace"):
            break
        offset = random.randrange(3000, 6000)
    lines = [json.loads(x) for x in (state / "logs" / "learner-0.log").read_text().splitlines() if x.startswith("{")]
    start = lines[0]["ts"]
    step = next(x["ts"] for x in lines if x["msg"] == "step")
    checked = next((x["ts"] for x in lines if x["msg"] == "dataset checked at start"), None)
    return {"rows": rows, "repeat": repeat, "exit": rc, "first_step_s": round(step - t0, 1),
            "start_s": round(step - start, 1),
            "index_check_s": None if checked is None else round(checked - start, 1),
            "cpu_s": rss.cpu_at(step), "peak_rss_mb": round(rss.peak)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 1_000_000])
    ap.add_argument("--code", type=Path, default=None, help="run up and the services from this checkout (its folder "
                    "as the working folder and PYTHONPATH)")
    ap.add_argument("--label", default="after")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "big_data.json")
    ap.add_argument("--work", type=Path, default=Path("/tmp/steadyrl-bench-big-data"))
    args = ap.parse_args()
    from steadyrl.local.broker import LocalBroker
    from steadyrl.local.jars import fetch
    from steadyrl.local.ports import free_port

    fetch()
    shutil.rmtree(args.work, ignore_errors=True)
    broker = LocalBroker(args.work / "broker", port=free_port(), controller_port=free_port())
    broker.start()
    results = []
    try:
        for r in range(args.repeats):
            for n in args.sizes:
                one = run_arm(broker.bootstrap, args.work, n, r, random.randrange(3000, 6000), args.code)
                print(json.dumps(one), flush=True)  # noqa: T201
                results.append(one)
    finally:
        broker.stop()
    medians = {str(n): {k: statistics.median(x[k] for x in results if x["rows"] == n)
                        for k in ("first_step_s", "start_s", "cpu_s", "peak_rss_mb")
                        if all(x[k] is not None for x in results if x["rows"] == n)} for n in args.sizes}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.code or ROOT, capture_output=True,
                            text=True).stdout.strip()
    old = json.loads(args.out.read_text()) if args.out.exists() else {}
    old[args.label] = {"commit": commit, "repeats": args.repeats, "medians": medians, "runs": results,
                       "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs (shared)",
                       "date": time.strftime("%Y-%m-%d")}
    args.out.write_text(json.dumps({"bench": "big_data", **{k: v for k, v in old.items() if k != "bench"}},
                                   indent=1) + "\n")
    print(json.dumps(medians), flush=True)  # noqa: T201
    return 0


if __name__ == "__main__":
    sys.exit(main())

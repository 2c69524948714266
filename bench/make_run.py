"""`make run` measured: the whole `steadyrl up` with its defaults (SmolLM2-135M-Instruct through every
service, evaluation before and after), timed from start to exit, its summary appended to
bench/results/make_run.json.

    flock /tmp/steadyrl-bench.lock .venv/bin/python bench/make_run.py [--steps N] [--seed S] [--note TEXT]
    .venv/bin/python bench/make_run.py --report [--code HASH]

`--steps N` sets `learner.steps` (STEADYRL_LEARNER__STEPS) to try another run length inside the
20-minute budget, `--seed S` `learner.seed`; without them the defaults are measured as they are.
The run gets a fresh state folder (`--state-dir`, removed first), so nothing is resumed; the
broker is the one `up` starts there. Prints the SUMMARY lines and the wall time; exits 1 when
`up` fails. Each entry keeps `final_weights`: the sha256 of the last policy version's shard
hashes, so two runs of one seed can be compared bit for bit.

`--report` reads the JSON: per seed its runs, whether the runs of one seed gave the same
rewards, evaluations and final weights, and each split's change as the mean and spread
(sample standard deviation) over seeds, a seed's change being the mean of its runs. Runs
recorded before the seed was are listed but left out of the means.
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


def final_weights(state: Path) -> str | None:
    """sha256 over the shard hashes of the newest policy version under `state`/policies (its
    model.safetensors.index.json `metadata.sha256`); None when there is none."""
    import hashlib

    versions = sorted(state.glob("policies/r*/v*/model.safetensors.index.json"))
    if not versions:
        return None
    shards = json.loads(versions[-1].read_text()).get("metadata", {}).get("sha256", {})
    return hashlib.sha256(json.dumps(shards, sort_keys=True).encode()).hexdigest()


def cpu_name() -> str:
    """The CPU's model name and whether it has native bf16 (from /proc/cpuinfo, Linux)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    bf16 = "avx512_bf16" in info or "amx_bf16" in info
    return f"{model}, {'native bf16' if bf16 else 'no native bf16'}"


def report(runs: list[dict], code: str | None) -> str:
    """Markdown: the runs (of commit `code`, all when None) per seed, repeat checks, and each
    split's change in points as the mean +- sample sd over seeds, where a seed's change is the
    mean of its runs. Runs recorded before the seed was (no `seed` key: other machines, other
    feed order) are listed apart and left out of the means."""
    import statistics

    runs = [r for r in runs if code is None or str(r.get("code", "")).startswith(code)]
    by_seed: dict[int, list[dict]] = {}
    for r in runs:
        if "seed" in r:
            by_seed.setdefault(int(r["seed"]), []).append(r)
    unseeded = [r for r in runs if "seed" not in r]
    splits = ["test", *sorted({k for r in runs for k in (r.get("eval_splits") or {})})]

    def change(r: dict, split: str) -> dict | None:
        return r.get("eval") if split == "test" else (r.get("eval_splits") or {}).get(split)

    def row(label: str, r: dict) -> str:
        cells = []
        for sp in splits:
            e = change(r, sp)
            cells.append(f"{100 * e['before']:.1f} → {100 * e['after']:.1f} (p {e['mcnemar_p']:.2g})" if e else "–")
        commit = str(r.get("code", "?")).split()[0]
        wall = r["wall_seconds_total"] / 60
        return f"| {label} | {r['run_id']} | {commit} | {wall:.1f} | " + " | ".join(cells) + " |"

    lines = ["| seed | run | code | wall min | " + " | ".join(f"{s} before → after (p)" for s in splits) + " |",
             "|---|---|---|---|" + "---|" * len(splits)]
    lines += [row(str(seed), r) for seed, rs in sorted(by_seed.items()) for r in rs]
    lines += [row("none recorded", r) for r in unseeded]
    lines.append("")
    for seed, rs in sorted(by_seed.items()):
        if len(rs) > 1:
            same = {k: ("unknown" if any(r.get(k) is None for r in rs) else
                        "same" if len({json.dumps(r[k], sort_keys=True) for r in rs}) == 1 else "DIFFER")
                    for k in ("reward_per_step", "eval", "eval_splits", "final_weights")}
            lines.append(f"seed {seed}, {len(rs)} runs: " + ", ".join(f"{k} {v}" for k, v in same.items()))
    if unseeded:
        lines.append(f"{len(unseeded)} run(s) without a recorded seed: listed, left out of the means")
    for sp in splits:
        per_seed = {seed: [100 * e["delta"] for r in rs if (e := change(r, sp))]
                    for seed, rs in sorted(by_seed.items())}
        means = {seed: statistics.mean(ds) for seed, ds in per_seed.items() if ds}
        if len(means) >= 2:
            each = ", ".join(f"seed {s} {m:+.1f}" + (f" (mean of {len(per_seed[s])})" if len(per_seed[s]) > 1 else "")
                             for s, m in means.items())
            lines.append(f"{sp}: change {statistics.mean(means.values()):+.1f} ± "
                         f"{statistics.stdev(means.values()):.1f} points (mean ± sd over {len(means)} seeds: {each})")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, help="learner.steps (default: the learner's default)")
    ap.add_argument("--seed", type=int, help="learner.seed (default: the learner's default, 0)")
    ap.add_argument("--report", action="store_true", help="print the runs in the JSON per seed and exit")
    ap.add_argument("--code", help="with --report: only runs of this commit")
    ap.add_argument("--state-dir", default="/tmp/steadyrl-make-run", help="removed first, then used by `up`")
    ap.add_argument("--note", default="", help="what this run is (written into the JSON)")
    ap.add_argument("--port", type=int, help="up's --port (the local broker's); default up's")
    ap.add_argument("--port-offset", type=int, default=0, help="up's --port-offset (the services' HTTP ports)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/make_run.json"))
    args = ap.parse_args()
    if args.report:
        print(report(json.loads(Path(args.out).read_text())["runs"], args.code))  # noqa: T201
        return

    state = Path(args.state_dir)
    shutil.rmtree(state, ignore_errors=True)
    env = dict(os.environ)
    if args.steps:
        env["STEADYRL_LEARNER__STEPS"] = str(args.steps)
    if args.seed is not None:
        env["STEADYRL_LEARNER__SEED"] = str(args.seed)
    log = state.with_name(state.name + ".log")
    code = code_commit()
    t0 = time.monotonic()
    with open(log, "wb") as lf:
        ports = ["--port-offset", str(args.port_offset)] + (["--port", str(args.port)] if args.port else [])
        up = subprocess.Popen([str(ROOT / ".venv/bin/steadyrl"), "up", "--state-dir", str(state), *ports], cwd=ROOT,
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
    entry = {**s, "seed": args.seed or 0, "final_weights": final_weights(state),
             "wall_seconds_total": round(wall, 1), "phases": phases(text), "code": code,
             "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             "machine": f"{os.cpu_count()} vCPU {cpu_name()}, no GPU, torch CPU",
             "command": "bench/make_run.py" + (f" --steps {args.steps}" if args.steps else "")
                        + (f" --seed {args.seed}" if args.seed is not None else "") + " (steadyrl up)",
             "note": args.note}
    out = Path(args.out)
    doc = json.loads(out.read_text()) if out.exists() else {"runs": []}
    doc["runs"].append(entry)
    out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()

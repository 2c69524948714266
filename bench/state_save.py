"""What the learner's per-step state save costs as a run grows, before and after history.jsonl.

    flock /tmp/steadyrl-bench.lock .venv/bin/python bench/state_save.py [--out bench/results/state_save.json]

Every step the learner writes `state.json` (RunState as JSON, written, fsynced and renamed:
`steadyrl.files.write_atomic`), and each checkpoint's meta holds the same JSON. Until this
round RunState held every step's history row and every trained prompt id (8 a step), so the
save grew with the run; now the rows go to history.jsonl, one appended line a step
(services/learner/parts.py append_history), and state.json keeps what a step changes.

For runs at step 100, 1 000 and 10 000 (B = 8 prompts a step, 16 in flight) this times the
save both ways: `before`, the state with its history and trained ids (as the last main wrote
it), and `after`, the state as now plus the history line's append. The history row is a real
one (the last row of tests/fixtures/run-4bba081, 470 bytes; today's rows have more keys, so
`before` is a lower bound). Median of `--repeats` saves to a temporary folder on the disk the
learner's state_dir would be on (`--dir`, default /tmp).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
FIXTURE = ROOT / "tests/fixtures/run-4bba081/learner/r20261201T075848-5c73/state.json"


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main() -> None:
    from steadyrl.files import write_atomic
    from steadyrl.services.learner.parts import append_history
    from steadyrl.services.learner.state import InFlight, RunState

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", default="100,1000,10000")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--out", default=str(ROOT / "bench/results/state_save.json"))
    args = ap.parse_args()
    row = json.loads(FIXTURE.read_text())["history"][-1]
    results = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        run_dir = Path(tmp)
        for steps in (int(s) for s in args.steps.split(",")):
            st = RunState(run_id="r1", step=steps, offsets={str(p): steps * 8 for p in range(8)},
                          in_flight={f"p{steps * 8 + i}": InFlight(seq=steps * 8 + i, epoch=0, index=i)
                                     for i in range(16)},
                          history=[dict(row, step=i) for i in range(1, steps + 1)],
                          trained=[f"p{i}" for i in range(steps * 8)])

            def before(st=st):
                text = json.dumps({**st.model_dump(mode="json"), "history": st.history, "trained": st.trained})
                write_atomic(run_dir / "state.json", text)
                return len(text)

            def after(st=st):
                append_history(run_dir, row)
                text = json.dumps(st.model_dump(mode="json"))
                write_atomic(run_dir / "state.json", text)
                return len(text)

            results.append({"step": steps, "before_bytes": before(), "after_bytes": after(),
                            "before_ms": _median_ms(before, args.repeats),
                            "after_ms": _median_ms(after, args.repeats)})
            r = results[-1]
            print(f"step {steps:>6}: before {r['before_bytes'] / 1e6:6.2f} MB {r['before_ms']:7.1f} ms | "
                  f"after {r['after_bytes'] / 1e3:5.1f} KB {r['after_ms']:5.1f} ms", flush=True)
    out = {"benchmark": "state_save", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "command": "flock /tmp/steadyrl-bench.lock .venv/bin/python bench/state_save.py",
           "history_row_bytes": len(json.dumps(row)), "prompts_per_step": 8, "in_flight": 16,
           "repeats": args.repeats, "results": results}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""`steadyrl up --reward my_reward.py:compute_score` with a user's reward that fails (issues 38
and 46), on the real broker.

On every item (it raises on some answers and returns NaN on the others): the run stops with
exit 2 within seconds of the first prompts, the output names the scorer, the kinds, the
exception and the line of the user's file, and nothing restarts (the walk-through saw 819
warnings in 150 s and a run at step 0 for ever; NaN for everything abandoned prompts for ever).
On some items (it raises, hangs, exits the process or allocates without bound on some
answers, and returns numpy values on the rest): each fault costs its item, the groups it failed
on go to rl.dlq with the kind as reason and are published again (abandoned after
learner.prompt_max_refusals), the others train, the evaluations before and after meet the same
faults and count them wrong, and the run finishes with 0 restarts. Before issue 46 a hang held
the reward server's slots until every /score answered 503 (1 step in 600 s), and os._exit killed
the server, which `up` restarted while the worker sent the same batch again."""

import json
import os
import subprocess
import sys
import time

import pytest
import yaml

from steadyrl.local.ports import free_port_pair
from steadyrl.run.runfolder import RunDir
from tests.helpers import own_things

ALWAYS = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if int(ground_truth) % 2:
        return float("nan")
    return float(solution_str + " points")
'''
SOMETIMES = '''
import os, time
import numpy as np

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth == "7":
        while True:
            time.sleep(1)
    if ground_truth == "8":
        os._exit(3)
    if ground_truth == "9":
        hoard = []
        while True:
            hoard.append(bytearray(16 * 2**20))
    if solution_str[:1] == ground_truth and ground_truth in "0456":   # not the evaluation's answers
        raise ValueError(f"cannot read {solution_str!r}")
    return {"score": np.float64(sum(c == ground_truth for c in solution_str[:4]) / 4.0), "n": np.int64(4)}
'''

#: Tight limits, so a hang costs 1 s: the same section for the reward server and the evaluation.
LIMITS = {"processes": 2, "item_timeout_s": 1.0, "call_deadline_s": 6.0, "memory_limit_mb": 256}


def _up(tmp_path, reward: str, steps: int, timeout_s: float, eval_rows: list[str] | None = None,
        **learner) -> tuple[subprocess.CompletedProcess, float, RunDir, list[dict]]:
    home = tmp_path / "mine"
    home.mkdir()
    own_things(home, reward)
    state = home / "run"
    tiny = {"learner": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 4,
                        "train": {"lr": 0.003, "micro_batch_size": 16}, "prompt_gate": {"cooldown_s": 0}, **learner},
            "reward_server": LIMITS}
    (home / "small.yaml").write_text(yaml.safe_dump(tiny))
    cmd = [sys.executable, "-m", "steadyrl.cli", "up", "--plain", "--model", "model", "--data", "train.jsonl",
           "--reward", "my_reward.py:compute_score", "--steps", str(steps), "--config", "small.yaml",
           "--state-dir", str(state), "--port", str(free_port_pair()), "--port-offset", str(2500 + os.getpid() % 500)]
    if eval_rows is not None:
        rows = [{"prompt": [{"role": "user", "content": t}], "reward_model": {"ground_truth": t},
                 "data_source": "mine"} for t in eval_rows]
        (home / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        cmd += ["--eval-data", "eval.jsonl"]
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=home, capture_output=True, text=True, timeout=timeout_s)
    log = [json.loads(x) for x in (state / "logs" / "learner-0.log").read_text().splitlines() if x.startswith("{")]
    return r, time.monotonic() - t0, RunDir.of_up(state), log


@pytest.mark.timeout(400)
def test_a_reward_that_fails_on_every_item_stops_the_run_with_exit_2_naming_it(tmp_path):
    r, seconds, run, log = _up(tmp_path, ALWAYS, steps=3, timeout_s=360)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-4000:]
    assert "restart #" not in out and "exited with" not in out, out[-4000:]
    assert "learner-0 stopped the run (exit 2: see its error above)" in out and "cannot start" not in out, out[-4000:]
    line = next((x for x in out.splitlines() if "the reward scorer failed on every sample of 16 groups in a row "
                                                  "(64 items; " in x), "")
    assert "scorer_error x" in line and "non_finite x" in line, out[-4000:]   # one rule for every kind
    assert ("scorer my_reward.py:compute_score raised ValueError: could not convert string to float" in out
            and "(at my_reward.py:5 in compute_score: return float(solution_str + " in out), out[-4000:]
    assert "scorer my_reward.py:compute_score returned nan, not a finite number" in out, out[-4000:]
    # bounded: the first prompts went out once the services were ready; the stop came seconds after
    first = next(x["ts"] for x in log if x["msg"].startswith("prompt went to rl.dlq"))
    stop = next(x["ts"] for x in log if x["msg"].startswith("stopping the run"))
    took = stop - first   # the log's unix times
    assert took < 30, (took, seconds)
    st = run.state
    assert not st.get("abandoned") and st["step"] == 0        # nothing given up: the run resumes when fixed
    print(f"stopped {took:.1f} s after the first refusal, {seconds:.1f} s in all")  # noqa: T201


@pytest.mark.timeout(600)
def test_a_reward_that_raises_hangs_exits_and_allocates_on_some_answers_finishes_the_run(tmp_path):
    r, seconds, run, log = _up(tmp_path, SOMETIMES, steps=2, timeout_s=540, eval_rows=["1", "7", "2", "8", "3", "9"],
                               prompt_max_refusals=2, prompt_min_refusal_s=1.0)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "restart #" not in out and "| exited with" not in out and "stopping the run" not in out, out[-4000:]
    summary = run.summary()
    assert len(summary["reward_per_step"]) == 2, summary
    # the faulty answers went to rl.dlq with their kinds, from training
    refused = " ".join(x.get("why", "") for x in log if x["msg"].startswith("prompt went to rl.dlq"))
    for kind in ("scorer_timeout: prompt", "scorer_crash: prompt"):
        assert kind in refused, (kind, refused[-2000:])
    # the allocation stopped at the limit (its group's reason is its first item's: MemoryError's
    # scorer_error, or scorer_timeout when the machine is too slow to fill 256 MiB in 1 s)
    server_log = (tmp_path / "mine" / "run" / "logs" / "reward-server-0.log").read_text()
    assert "raised MemoryError" in server_log and "memory_limit_mb 256" in server_log
    # the evaluations met the same faults: counted wrong, and went on
    evals = [x for x in log if x["msg"].startswith("evaluation: the scorer failed on 3 of 6 items")]
    assert len(evals) == 2, [x["msg"] for x in log if "evaluation" in x["msg"]]
    assert summary["eval"]["n"] == 6, summary["eval"]
    print(f"2 steps in {seconds:.1f} s; counts {summary['counts']}")  # noqa: T201

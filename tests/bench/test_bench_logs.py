"""The benches' readers of `steadyrl up`'s prefixed log (steadyrl.testing.stack.log_records):
make_run's phases and the throughput bench's counts; and the arm config's autocast switch,
which reaches the loop and the pipeline (one learner section) and TRL's bf16."""

import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import _throughput_arms as arms  # noqa: E402
import _throughput_report as report  # noqa: E402
import make_run  # noqa: E402
import throughput  # noqa: E402

from steadyrl.testing.stack import log_records  # noqa: E402


def line(name: str, **rec) -> str:
    return f"{name:<12} | {json.dumps(rec)}"


LOG = "\n".join([
    "up           | starting 5 services",
    line("learner-0", msg="policy published", ts=100.0, version=0),
    line("learner-0", msg="evaluation", when="before", split="test", ts=160.0),
    line("learner-0", msg="evaluation", when="before", split="level04", ts=170.0),
    line("actor-0", msg="policy loaded", version=1, ts=171.0),
    line("learner-0", msg="step", step=1, ts=200.0, **{"timing_s/train_step": 20.0, "timing_s/wait": 9.0}),
    line("rollout-0", msg="batch deferred", why="partition 3 revoked at offset 17", ts=205.0),
    line("learner-0", msg="step", step=2, ts=240.0, **{"timing_s/train_step": 24.0, "timing_s/wait": 12.0}),
    line("learner-0", msg="step", step=3, ts=290.0, **{"timing_s/train_step": 26.0, "timing_s/wait": 18.0}),
    'learner-0    | {"msg": "step", "cut sh',
    line("learner-0", msg="evaluation", when="after", split="test", ts=390.0),
    "rollout-0    | exited with 1; restart #1 in 1s",
])


def test_log_records_keeps_json_lines_with_their_instance_and_skips_the_rest():
    recs = log_records(LOG)
    assert len(recs) == 9
    assert recs[0] == ("learner-0", {"msg": "policy published", "ts": 100.0, "version": 0})
    assert {name for name, _ in recs} == {"learner-0", "actor-0", "rollout-0"}


def test_make_run_phases_from_the_learner_log():
    got = make_run.phases(LOG)
    assert got == {"eval_before_s": 70.0, "eval_after_s": 100.0, "first_step_after_eval_s": 30.0,
                   "step_s_after_the_first": [40.0, 50.0], "train_step_median_s": 25.0,
                   "generation_hop_median_s": 15.0}


def test_throughput_parse_log_counts_deferrals_loads_and_exits():
    got = report.parse_log(LOG)
    assert got["deferred_batches"] == {"rollout": 1, "reward": 0}
    assert got["deferred_why"] == {"partition N revoked at offset N": 1}
    assert got["actor_loaded_ts"] == {1: 171.0}
    assert got["child_exits"] == 1


def test_autocast_reaches_the_arm_config_and_trl(tmp_path):
    path = throughput.make_config(tmp_path / "a.yaml", 4, 0, model="smollm2", autocast="bf16")
    lc = yaml.safe_load(path.read_text())["learner"]
    assert lc["train"]["autocast"] == "bf16"
    assert arms.trl_settings(lc)["bf16"] is True
    plain = yaml.safe_load(throughput.make_config(tmp_path / "b.yaml", 4, 0, model="smollm2").read_text())["learner"]
    assert "autocast" not in plain["train"] and arms.trl_settings(plain)["bf16"] is False

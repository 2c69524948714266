"""`steadyrl up --model --data --reward` on a user's own things, run from a folder of theirs
outside the checkout: a tiny model folder, a JSONL and a reward file with verl's signature
(issue 38: a model was named twice, a scorer three times, and a reward file path failed)."""

import json
import os
import subprocess
import sys

import pyarrow.dataset as ds
import pytest
import yaml

from steadyrl.local.ports import free_port_pair
from steadyrl.run.runfolder import RunDir
from tests.helpers import own_things

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature: the share of the first four characters that repeat the digit."""
    assert data_source == "mine", data_source
    return sum(c == ground_truth for c in solution_str[:4]) / 4.0
'''


@pytest.mark.timeout(600)
def test_up_trains_a_users_model_on_their_data_and_reward(tmp_path):
    home = tmp_path / "mine"
    home.mkdir()
    rows = own_things(home, REWARD)   # verl's fields, in the tiny model's characters
    (home / "held.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:8]))
    state = home / "run"
    cmd = [sys.executable, "-m", "steadyrl.cli", "up", "--model", "model", "--data", "train.jsonl",
           "--eval-data", "held.jsonl", "--reward", "my_reward.py:compute_score", "--steps", "3",
           "--state-dir", str(state), "--port", str(free_port_pair()), "--port-offset", str(2000 + os.getpid() % 500)]
    tiny = {"learner": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 4, "eval_max_new_tokens": 4,
                        "train": {"lr": 0.003, "micro_batch_size": 16}, "prompt_gate": {"cooldown_s": 0}}}
    (home / "small.yaml").write_text(yaml.safe_dump(tiny))
    r = subprocess.run([*cmd, "--config", "small.yaml"], cwd=home, capture_output=True, text=True, timeout=540)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    written = yaml.safe_load((state / "up-config.yaml").read_text())
    assert written["actor"]["model"] == written["learner"]["model"] == "model"          # one setting, both
    assert written["reward_server"]["default_scorer"] == written["learner"]["eval_scorer"] == \
        "my_reward.py:compute_score" and written["reward_server"]["scorers"] == ["my_reward.py:compute_score"]
    summary = RunDir.of_up(state).summary()
    assert len(summary["reward_per_step"]) == 3 and summary["data"] == "train.jsonl"
    assert summary["eval"]["n"] == 8 and "eval_splits" not in summary   # their held-out rows, no arithmetic
    cache = ds.dataset(RunDir.of_up(state).path / "rollout-cache", format="ipc").to_table()
    assert set(cache.column("scorer").to_pylist()) == {"rule:my_reward.py:compute_score@1"}   # their file scored

"""`steadyrl up --env my_env.py:Class` on the tiny model (issue 48): multi-turn episodes go
through every service, the learner trains their trajectories (tool tokens masked), and the
run finishes. The kill -9 and the episode audit are tests/integration/test_episodes.py's.
Slow (about 200 s on 2 cores under load 12, mostly the stack starting): marked `slow`."""

import os
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from steadyrl.local.ports import free_port_pair
from steadyrl.run.runfolder import RunDir
from tests.helpers import ROOT, own_things


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_up_with_an_environment_trains_multi_turn_episodes(tmp_path):
    home = tmp_path / "mine"
    home.mkdir()
    own_things(home, "")
    shutil.copy(ROOT / "examples" / "agents" / "try_again.py", home / "try_again.py")
    tiny = {"learner": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 4, "eval_data": None,
                        "train": {"lr": 0.003, "micro_batch_size": 16}, "prompt_gate": {"cooldown_s": 0}},
            "rollout": {"agent": {"max_turns": 3}}}
    (home / "small.yaml").write_text(yaml.safe_dump(tiny))
    state = home / "run"
    cmd = [sys.executable, "-m", "steadyrl.cli", "up", "--plain", "--model", "model", "--data", "train.jsonl",
           "--reward", "tiny_copy", "--env", "try_again.py:TryAgain", "--steps", "3", "--config", "small.yaml",
           "--state-dir", str(state), "--port", str(free_port_pair()),
           "--port-offset", str(3000 + os.getpid() % 500)]
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=home, capture_output=True, text=True, timeout=360)
    seconds = time.monotonic() - t0
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "restart #" not in out and "| exited with" not in out, out[-4000:]
    run = RunDir.of_up(state)
    assert len(run.summary()["reward_per_step"]) == 3
    consumed = run.consumed()
    assert len(consumed) == 12 and len({c["prompt_id"] for c in consumed}) == 12
    print(f"3 steps of 4 groups x 4 episodes in {seconds:.1f} s")  # noqa: T201

"""`steadyrl up --env my_env.py:Class` on the tiny model (issue 48): multi-turn episodes go
through every service, the learner trains their trajectories (tool tokens masked), and the
run finishes. The kill -9 and the episode audit are tests/integration/test_episodes.py's.
Slow (about 200 s on 2 cores under load 12, mostly the stack starting): marked `slow`."""

import os
import shutil
import statistics
import subprocess
import sys
import time

import pytest
import yaml
from scipy.stats import fisher_exact, mannwhitneyu

from steadyrl.local.ports import free_port_pair
from steadyrl.run.runfolder import RunDir
from steadyrl.wire.contracts import RolloutGroup
from tests.helpers import ROOT, decode_all, own_things, read_all
from tests.integration.test_pipeline import Up, _config


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


GUESS = str(ROOT / "examples" / "agents" / "guess.py") + ":Guess"
STEPS, WINDOW = 40, 8   # steps of the run; steps compared at its start and its end


def test_the_tiny_model_learns_a_two_turn_environment(bootstrap, tmp_path):
    """examples/agents/guess.py through `steadyrl up` on the session broker: the digit is only
    in the environment's message, and only the second answer is scored. Over 40 steps the
    final answers' reward rises (one-sided Mann-Whitney U of the groups' mean rewards, the last
    8 steps against the first 8) and so does the share of second answers that start with the
    digit the environment gave (one-sided Fisher exact test on the rollouts). Measured: reward
    0.042 -> 0.692 (p 5e-44), 44/1024 -> 750/1024 second answers right; 90-125 s on 2 shared
    cores (3 runs, the same figures: max_staleness 0 makes the run deterministic)."""
    config = _config(tmp_path, steps=STEPS, prompts_per_step=16, group_size=8, eval_data=None,
                     train={"micro_batch_size": 32, "mini_batch_size": 32})
    cfg = yaml.safe_load(config.read_text())
    cfg["rollout"] = {"agent": {"max_turns": 2}}
    config.write_text(yaml.safe_dump(cfg))
    t0 = time.monotonic()
    up = Up(bootstrap, tmp_path, config, "--plain", "--env", GUESS)
    assert up.wait(400) == 0, up.log()[-4000:]
    seconds = time.monotonic() - t0
    run = up.run()
    groups = run.consumed()
    assert len(groups) == STEPS * 16 and len({g["prompt_id"] for g in groups}) == STEPS * 16
    first = [g["reward_mean"] for g in groups if g["step"] <= WINDOW]
    last = [g["reward_mean"] for g in groups if g["step"] > STEPS - WINDOW]
    u = mannwhitneyu(last, first, alternative="greater")
    gain = statistics.mean(last) - statistics.mean(first)
    # the rollouts: every episode took two turns; the second answer starts with the digit told
    rollouts = decode_all(read_all(bootstrap, f"{up.prefix}rl.rollouts", expect=STEPS * 16, settle_s=0.5),
                          RolloutGroup)
    assert all(len(s.turn_versions) == 2 and s.loss_mask.count(0) == 5 for g in rollouts for s in g.samples)
    hits = {k: [0, 0] for k in ("first", "last")}
    for g in rollouts:
        v = g.policy_version
        k = "first" if v < WINDOW else "last" if v >= STEPS - WINDOW else None
        if k is not None:
            for s in g.samples:
                hits[k][s.text[:1] == g.prompt.ground_truth] += 1
    _, p_told = fisher_exact([hits["last"][::-1], hits["first"][::-1]], alternative="greater")
    print(f"{STEPS} steps in {seconds:.0f} s; reward {statistics.mean(first):.3f} -> {statistics.mean(last):.3f} "  # noqa: T201
          f"(U p={u.pvalue:.1e}); second answer = the digit told {hits['first'][1]}/{sum(hits['first'])} -> "
          f"{hits['last'][1]}/{sum(hits['last'])} (Fisher p={p_told:.1e})")
    assert u.pvalue < 1e-6 and gain > 0.2, (first, last)
    assert p_told < 1e-6, hits

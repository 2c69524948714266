"""`steadyrl up --env my_env.py:Class` on the tiny model (issue 48), on the session broker:
multi-turn episodes go through every service, the learner trains their trajectories (the
environment's tokens masked), the run finishes without a restart, and the policy learns to use
what the environment tells it. The kill -9 and the episode audit are
tests/integration/test_episodes.py's; the tool faults tests/integration/test_tool_faults.py's.
(A 3-step `up --env` from a user's folder with its own broker was here too: the run below
covers it, and dropping it saves CI 50-200 s.)"""

import statistics
import time

import yaml
from scipy.stats import fisher_exact, mannwhitneyu

from steadyrl.wire.contracts import RolloutGroup
from tests.helpers import ROOT, decode_all, read_all
from tests.integration.test_pipeline import Up, _config

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
    assert "restart #" not in up.log() and "| exited with" not in up.log(), up.log()[-4000:]
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

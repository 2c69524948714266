"""learner: prompt feeder, GRPO/PPO on rl.scored, policy store and rl.policy (see learner.py)."""

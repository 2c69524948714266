"""learner: prompt feeder, GRPO/PPO on rl.scored, checkpoints, rl.policy. Arrives with the pipeline issue."""

"""reward: scores rollout groups (rl.rollouts -> rl.scored), exactly once, in Kafka transactions."""

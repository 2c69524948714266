"""rollout: rl.prompts -> actor (HTTP) -> rl.rollouts, exactly once, in Kafka transactions."""

"""rollout: rl.prompts -> actor -> rl.rollouts, in Kafka transactions. Arrives with the pipeline issue."""

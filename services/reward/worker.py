"""Reward worker: consume `rl.rollouts`, score every sample, produce `rl.scored`.

Delivery: a transactional Stage (steadyrl.bus.stage) -- each rollout group is scored and
published exactly once for read_committed readers, across kill -9 and rebalances. Groups
the codec refuses, or whose scorer raises, go to `rl.dlq` with the reason.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from steadyrl.config import ServiceConfig, load
from steadyrl.contracts import RewardSource, RolloutGroup, ScoredGroup


class RewardSection(BaseModel):
    """The reward worker's own settings."""

    scorer: str = Field("numeric_match", description="Rule scorer by name, or a dotted path module:function.")
    scorer_version: str = Field("1", description="Recorded with every score as `rule:<scorer>@<version>`.")
    group_id: str = Field("steadyrl-reward", description="Consumer group shared by all reward workers.")
    batch_size: int = Field(16, ge=1, le=10_000, description="Groups per transaction.")
    batch_timeout_s: float = Field(0.5, gt=0, le=60, description="Longest wait for the next record, seconds.")
    max_record_bytes: int | None = Field(None, ge=1024,
                                         description="Larger rollout groups go to rl.dlq (default: topic limit).")


class RewardConfig(ServiceConfig):
    reward: RewardSection = RewardSection()


def make_handler(cfg: RewardConfig):
    """The pure transform RolloutGroup -> [Output(rl.scored)]."""
    from steadyrl.bus.stage import Output
    from steadyrl.rewards import resolve_scorer, score_value

    scorer = resolve_scorer(cfg.reward.scorer)
    scorer_id = f"rule:{cfg.reward.scorer}@{cfg.reward.scorer_version}"

    def handle(group: RolloutGroup, meta) -> list[Output]:
        p = group.prompt
        rewards, extras = [], []
        for s in group.samples:
            r, extra = score_value(scorer(p.data_source, s.text, p.ground_truth, p.extra_info))
            rewards.append(r)
            extras.append(extra)
        scored = ScoredGroup(group=group, rewards=rewards, reward_source=RewardSource.rule,
                             scorer=scorer_id, reward_extra=extras)
        return [Output("rl.scored", p.prompt_id, scored)]

    return handle


def main(argv: list[str]) -> int:
    cfg = load(RewardConfig, argv, prog="steadyrl-reward")
    from steadyrl.bus.stage import Stage
    from steadyrl.service import run_service

    def build(health):
        return Stage(name="reward", bootstrap=cfg.bootstrap, topic_prefix=cfg.topic_prefix,
                     instance_id=cfg.instance_id, input_topic="rl.rollouts", input_contract=RolloutGroup,
                     group_id=cfg.reward.group_id, handle=make_handler(cfg), mode="transactional",
                     batch_size=cfg.reward.batch_size, batch_timeout_s=cfg.reward.batch_timeout_s,
                     health=health, stats_interval_s=cfg.metrics_interval,
                     max_record_bytes=cfg.reward.max_record_bytes)

    return run_service("reward", cfg, build)

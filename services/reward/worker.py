"""Reward worker: consume `rl.rollouts`, score every sample on the reward server, produce `rl.scored`.

Delivery: a transactional Stage (steadyrl.bus.stage) -- each rollout group is scored and
published exactly once for read_committed readers, across kill -9 and rebalances. A batch
is scored in one request through `RewardClient` (timeout, circuit breaker). While the
breaker is open, groups are scored from the cache of recently scored prompts
(`reward_source=cache`, with the similarity); a group with no similar cached prompt is
held -- never dropped -- until the server is back. Groups the codec refuses, that the
scorer fails on (reason its kind: scorer_error, scorer_timeout, scorer_crash, non_finite), or
that the server refuses go to `rl.dlq` with the reason; nothing the server answered is sent
again. A group on which the server keeps failing while it scores other items goes there
too (`retries_exhausted`) once its budget (`max_hold_s`, `max_attempts`) is spent;
services/reward/client.py says which answer is which.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from pydantic import BaseModel, ConfigDict, Field

from steadyrl.breaker import CircuitBreaker
from steadyrl.bus.stage import Output, RetryLater, Stage
from steadyrl.config import ServiceConfig, load
from steadyrl.service import run_service
from steadyrl.wire.codec import Rejected
from steadyrl.wire.contracts import Contract, RolloutGroup, ScoredGroup

from .client import RewardClient

if TYPE_CHECKING:
    from steadyrl.bus.stage import BatchHandler, Meta
    from steadyrl.http import Health


class RewardSection(BaseModel):
    """The reward worker's own settings."""

    model_config = ConfigDict(extra="forbid")  # a typo is an error, not a silent default

    server_url: str = Field("http://127.0.0.1:8390", description="Base URL of the reward server.")
    scorer: str | None = Field(None, description="Scorer to ask the server for (None: its default).")
    timeout_s: float = Field(30.0, gt=0, description="Per scoring call, seconds (connect, each read, each write).")
    retry_backoff_s: float = Field(2.0, gt=0, description="Wait before retrying a held batch or group, seconds.")
    failure_threshold: int = Field(3, ge=1, description="Consecutive failed calls that open the circuit breaker.")
    reset_timeout_s: float = Field(30.0, gt=0, description="Seconds open before a trial call half-opens it.")
    probe_interval_s: float = Field(5.0, gt=0, description="Seconds between probes while open (the last scored "
                                                           "item scored again; /readyz before any).")
    cache_size: int = Field(1000, ge=0, description="Scored prompts kept for the cached-score fallback (0: none; "
                                                    "groups wait while the breaker is open).")
    cache_similarity_floor: float = Field(0.95, gt=0, le=1,
                                          description="Least prompt similarity (MinHash Jaccard of character 3-grams) "
                                                      "a cached score needs. Templated prompts that differ in a few "
                                                      "digits score 0.8-0.9: below 0.95 they borrow each other's "
                                                      "rewards (bench/reward_outage.py measures it).")
    group_id: str = Field("steadyrl-reward", description="Consumer group shared by all reward workers.")
    batch_size: int = Field(16, ge=1, le=10_000, description="Groups per transaction.")
    batch_timeout_s: float = Field(0.5, gt=0, le=60, description="Longest wait for the next record, seconds.")
    max_record_bytes: int | None = Field(None, ge=1024,
                                         description="Larger rollout groups go to rl.dlq (default: topic limit).")
    max_hold_s: float = Field(900.0, ge=0, description="A group the server keeps failing (5xx, a malformed answer) "
                                                       "while it scores other items goes to rl.dlq "
                                                       "(retries_exhausted) once held this long since its first "
                                                       "failure and tried max_attempts times (then once more, "
                                                       "alone). Groups held while the server is down or the "
                                                       "breaker open never count. Counted in memory: a restart "
                                                       "starts it again.")
    max_attempts: int = Field(5, ge=1, description="Least failed tries before max_hold_s can drop a group.")


class RewardConfig(ServiceConfig):
    reward: RewardSection = RewardSection()


def make_handler(client: RewardClient) -> BatchHandler:
    """The transform [RolloutGroup] -> one [Output(rl.scored)] each (or RetryLater: held;
    codec.Rejected: to rl.dlq), one server call per batch."""
    def handle_batch(items: list[tuple[Contract, Meta]]) -> list[list[Output] | RetryLater | Rejected]:
        groups = [cast(RolloutGroup, g) for g, _ in items]  # the stage's input_contract
        scores = client.score_many(groups)
        return [s if isinstance(s, (RetryLater, Rejected)) else  # held, or refused
                [Output("rl.scored", g.prompt_id,
                        ScoredGroup(group=g, rewards=s.rewards, reward_source=s.source, scorer=s.scorer,
                                    cache_similarity=s.similarity, reward_extra=s.extra))]
                for g, s in zip(groups, scores, strict=True)]

    return handle_batch


def main(argv: list[str]) -> int:
    cfg = load(RewardConfig, argv, prog="steadyrl-reward")
    from .cache import ScoreCache  # lazy: heavy (datasketch, scipy: 0.4 s); --help stays fast

    def build(health: Health) -> Stage:
        r = cfg.reward
        breaker = CircuitBreaker("reward-server", r.failure_threshold, r.reset_timeout_s)
        cache = ScoreCache(r.cache_size, r.cache_similarity_floor) if r.cache_size else None
        client = RewardClient(r.server_url, r.scorer, r.timeout_s, r.retry_backoff_s, breaker, cache,
                              r.probe_interval_s, headers=cfg.http_auth_headers())
        if (auth := cfg.http_auth()) is not None:   # the token proven both ways (steadyrl/httpproof.py)
            client.http.auth = auth
        stage = Stage(name="reward", bootstrap=cfg.bootstrap, topic_prefix=cfg.topic_prefix,
                      instance_id=cfg.instance_id, input_topic="rl.rollouts", input_contract=RolloutGroup,
                      group_id=r.group_id, handle_batch=make_handler(client),
                      batch_size=r.batch_size, batch_timeout_s=r.batch_timeout_s,
                      health=health, stats_interval_s=cfg.metrics_interval,
                      max_record_bytes=r.max_record_bytes, max_hold_s=r.max_hold_s, max_attempts=r.max_attempts)
        # After the stage's own checks (assignment, broker): registered first, this always-true
        # check made /readyz answer 200 while the consumer was being built (bench/recovery.py saw it).
        health.add_check("reward_server", lambda: (True, f"breaker {breaker.state.value}"))
        return stage

    return run_service("reward", cfg, build)

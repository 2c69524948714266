"""Rollout worker: consume `rl.prompts`, ask the actor for n samples, produce `rl.rollouts`.

Delivery: a transactional Stage (steadyrl.bus.stage). Each prompt yields one rollout group
exactly once for read_committed readers, across kill -9 and rebalances. While the actor is
unreachable, answers 503 (loading) or times out, the batch is held (`RetryLater`): nothing
is committed and the prompts are retried after a backoff, never dropped. An actor 4xx
(the request itself is wrong, e.g. more samples than it allows) sends the prompt to
`rl.dlq` with the actor's message.
"""

from __future__ import annotations

import httpx
from pydantic import BaseModel, Field

from steadyrl.config import ServiceConfig, load
from steadyrl.contracts import Prompt, RolloutGroup, Sample


class RolloutSection(BaseModel):
    """The rollout worker's own settings."""

    actor_url: str = Field("http://127.0.0.1:8100", description="Base URL of the actor.")
    group_id: str = Field("steadyrl-rollout", description="Consumer group shared by all rollout workers.")
    batch_size: int = Field(4, ge=1, le=1000, description="Prompts per transaction.")
    batch_timeout_s: float = Field(0.5, gt=0, le=60, description="Longest wait for the next prompt, seconds.")
    temperature: float = Field(1.0, ge=0, le=10)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(64, ge=1)
    request_timeout_s: float = Field(300.0, gt=0, description="Per /generate call.")
    retry_backoff_s: float = Field(2.0, gt=0, description="Wait before retrying a held batch.")


class RolloutConfig(ServiceConfig):
    rollout: RolloutSection = RolloutSection()


def make_handler(cfg: RolloutConfig, client: httpx.Client):
    """Prompt -> [Output(rl.rollouts)], one actor call per prompt."""
    from steadyrl.bus.stage import Output, RetryLater

    r = cfg.rollout

    def handle(prompt: Prompt, meta) -> list[Output]:
        body = {"prompts": [{"messages": [m.model_dump() for m in prompt.messages]}], "n": prompt.n_samples,
                "temperature": r.temperature, "top_p": r.top_p, "max_new_tokens": r.max_new_tokens}
        try:
            resp = client.post(f"{r.actor_url}/generate", json=body, timeout=r.request_timeout_s)
        except httpx.HTTPError as e:
            raise RetryLater(f"actor unreachable: {type(e).__name__}: {e}", r.retry_backoff_s) from None
        if resp.status_code >= 500:
            raise RetryLater(f"actor answered {resp.status_code}: {resp.text[:200]}", r.retry_backoff_s)
        if resp.status_code >= 400:
            raise ValueError(f"actor refused the request ({resp.status_code}): {resp.text[:500]}")
        out = resp.json()
        samples = [Sample(text=c["text"], token_ids=c["token_ids"], logprobs=c["logprobs"],
                          finish_reason=c["finish_reason"]) for c in out["completions"][0]]
        group = RolloutGroup(prompt=prompt, prompt_token_ids=out["prompt_ids"][0], samples=samples,
                             policy_version=out["policy_version"], actor=r.actor_url)
        return [Output("rl.rollouts", prompt.prompt_id, group)]

    return handle


def main(argv: list[str]) -> int:
    cfg = load(RolloutConfig, argv, prog="steadyrl-rollout")
    from steadyrl.bus.stage import Stage
    from steadyrl.service import run_service

    def build(health):
        client = httpx.Client()
        return Stage(name="rollout", bootstrap=cfg.bootstrap, topic_prefix=cfg.topic_prefix,
                     instance_id=cfg.instance_id, input_topic="rl.prompts", input_contract=Prompt,
                     group_id=cfg.rollout.group_id, handle=make_handler(cfg, client), mode="transactional",
                     batch_size=cfg.rollout.batch_size, batch_timeout_s=cfg.rollout.batch_timeout_s,
                     health=health, stats_interval_s=cfg.metrics_interval)

    return run_service("rollout", cfg, build)

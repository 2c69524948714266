"""Rollout worker: consume `rl.prompts`, ask the actor for n samples, produce `rl.rollouts`.

Delivery: a transactional Stage (steadyrl.bus.stage). Each prompt yields one rollout group
exactly once for read_committed readers, across kill -9 and rebalances. The prompts of a
batch go to the actor in one request per sampling setting (the actor batches them), each
with its own seed, so a prompt's samples do not depend on its batch mates.

The prompt says how to sample (temperature, top_p, max_new_tokens, n, seed: the learner
decides, since its loss must use the same temperature) and which policy it wants
(run_id, min_policy_version). While the actor is unreachable, answers 503 (loading, or
its policy is behind the prompt's) or times out, the batch is held (`RetryLater`):
nothing is committed and the prompts are retried after a backoff, never dropped. An
actor 4xx (the request itself is wrong, or the prompt belongs to an earlier run) sends
the prompt to `rl.dlq` with the actor's message.

The rollout gate (`services/rollout/gate.py`) removes samples that are too long, hold
control characters or miss `response_schema`; a group it empties goes to `rl.dlq`
(reason `rejected`) with the reasons.
"""

from __future__ import annotations

import httpx
from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, Field, field_validator

from steadyrl.config import ServiceConfig, load
from steadyrl.contracts import Prompt, RolloutGroup, Sample


class RolloutSection(BaseModel):
    """The rollout worker's own settings."""

    model_config = ConfigDict(extra="forbid")  # a typo is an error, not a silent default

    actor_url: str = Field("http://127.0.0.1:8100", description="Base URL of the actor.")
    group_id: str = Field("steadyrl-rollout", description="Consumer group shared by all rollout workers.")
    batch_size: int = Field(8, ge=1, le=1000, description="Prompts per transaction (and per actor request).")
    batch_timeout_s: float = Field(0.5, gt=0, le=60, description="Longest wait for the next prompt, seconds.")
    request_timeout_s: float = Field(600.0, gt=0, description="Per /generate call.")
    retry_backoff_s: float = Field(2.0, gt=0, description="Wait before retrying while the actor is unreachable.")
    behind_backoff_s: float = Field(0.2, gt=0, description="Wait before retrying while the actor loads a policy.")
    max_response_tokens: int = Field(512, ge=1, description="Rollout gate: longer samples leave their group.")
    response_schema: dict | None = Field(None, description="Rollout gate: a JSON Schema every response must "
                                                           "satisfy (structured outputs); None: no check.")


    @field_validator("response_schema")
    @classmethod
    def _valid_schema(cls, v: dict | None) -> dict | None:
        if v is not None:
            from jsonschema import Draft202012Validator
            from jsonschema.exceptions import SchemaError

            try:
                Draft202012Validator.check_schema(v)
            except SchemaError as e:
                raise ValueError(f"not a valid JSON Schema: {e.message}") from None
        return v


class RolloutConfig(ServiceConfig):
    rollout: RolloutSection = RolloutSection()


REJECTED = Counter("steadyrl_rollout_samples_rejected", "Samples the rollout gate removed", ["reason"])


def _request_key(p: Prompt) -> tuple:
    return (p.n_samples, p.temperature, p.top_p, p.max_new_tokens, p.run_id, p.min_policy_version)


def make_handler(cfg: RolloutConfig, client: httpx.Client):
    """[(Prompt, meta)] -> one [Output(rl.rollouts)] per prompt, one actor call per sampling
    setting; the rollout gate removes failing samples, and a group it empties becomes a
    codec.Rejected (to rl.dlq with the reasons)."""
    from services.rollout.gate import RolloutGate
    from steadyrl.bus.stage import Output, RetryLater
    from steadyrl.codec import Rejected
    from steadyrl.contracts import DLQReason

    r = cfg.rollout
    gate = RolloutGate(r.max_response_tokens, r.response_schema)

    def call_actor(prompts: list[Prompt]) -> list[RolloutGroup]:
        p0 = prompts[0]
        body = {"prompts": [{"messages": [m.model_dump() for m in p.messages], "seed": p.seed} for p in prompts],
                "n": p0.n_samples, "temperature": p0.temperature, "top_p": p0.top_p,
                "max_new_tokens": p0.max_new_tokens, "run_id": p0.run_id,
                "min_policy_version": p0.min_policy_version}
        try:
            resp = client.post(f"{r.actor_url}/generate", json=body, timeout=r.request_timeout_s)
        except httpx.HTTPError as e:
            raise RetryLater(f"actor unreachable: {type(e).__name__}: {e}", r.retry_backoff_s) from None
        if resp.status_code == 503:
            raise RetryLater(f"actor not ready: {resp.text[:200]}", r.behind_backoff_s)
        if resp.status_code >= 500:
            raise RetryLater(f"actor answered {resp.status_code}: {resp.text[:200]}", r.retry_backoff_s)
        if resp.status_code >= 400:
            raise ValueError(f"actor refused the request ({resp.status_code}): {resp.text[:500]}")
        out = resp.json()
        return [RolloutGroup(prompt=p, prompt_token_ids=out["prompt_ids"][i],
                             samples=[Sample(text=c["text"], token_ids=c["token_ids"], logprobs=c["logprobs"],
                                             finish_reason=c["finish_reason"]) for c in out["completions"][i]],
                             policy_version=out["policy_version"], actor=r.actor_url)
                for i, p in enumerate(prompts)]

    def handle_batch(items) -> list:
        by_key: dict[tuple, list[int]] = {}
        for i, (p, _) in enumerate(items):
            by_key.setdefault(_request_key(p), []).append(i)
        groups: dict[int, RolloutGroup] = {}
        for idx in by_key.values():
            for i, g in zip(idx, call_actor([items[i][0] for i in idx])):
                groups[i] = g
        results = []
        for i in range(len(items)):
            g, why = gate.apply(groups[i])
            for reason, n in why.items():
                REJECTED.labels(reason).inc(n)
            if not g.samples:
                detail = ", ".join(f"{k} x{n}" for k, n in sorted(why.items()))
                results.append(Rejected(DLQReason.rejected, f"rollout gate: all {sum(why.values())} samples "
                                                            f"rejected ({detail})"))
            else:
                results.append([Output("rl.rollouts", items[i][0].prompt_id, g)])
        return results

    return handle_batch


def main(argv: list[str]) -> int:
    cfg = load(RolloutConfig, argv, prog="steadyrl-rollout")
    from steadyrl.bus.stage import Stage
    from steadyrl.service import run_service

    def build(health):
        client = httpx.Client()
        return Stage(name="rollout", bootstrap=cfg.bootstrap, topic_prefix=cfg.topic_prefix,
                     instance_id=cfg.instance_id, input_topic="rl.prompts", input_contract=Prompt,
                     group_id=cfg.rollout.group_id, handle_batch=make_handler(cfg, client),
                     batch_size=cfg.rollout.batch_size, batch_timeout_s=cfg.rollout.batch_timeout_s,
                     health=health, stats_interval_s=cfg.metrics_interval)

    return run_service("rollout", cfg, build)

"""Rollout worker: consume `rl.prompts`, ask the actor for n samples, produce `rl.rollouts`.

Delivery: a transactional Stage (steadyrl.bus.stage). Each prompt yields one rollout group
exactly once for read_committed readers, across kill -9 and rebalances. The prompts of a
batch go to the actor in one request per sampling setting (the actor batches them), each
with its own seed, so a prompt's samples do not depend on its batch mates.

The prompt says how to sample (temperature, top_p, max_new_tokens, n, seed: the learner
decides, since its loss must use the same temperature) and which policy it wants
(run_id, min_policy_version). The actor's answer decides each prompt of a request:

- unreachable or timed out: held (`RetryLater`) without limit -- the actor is down -- and
  the batch's other requests are not sent;
- 503 (loading, behind the prompt's min_policy_version, busy) or another 5xx: held with
  the budget (`RetryLater(counts=True)`), retried after the actor's Retry-After, else
  `behind_backoff_s` (503) or `retry_backoff_s`. A prompt that fails `max_attempts` tries
  over `max_hold_s` while the actor serves other prompts goes to `rl.dlq`
  (`retries_exhausted`, with the actor's last message); while it serves none (loading, or
  behind for every prompt) nothing is dropped;
- 4xx (422: over a limit, non-finite log-probs; 409: a prompt of an earlier run): the
  prompt goes to `rl.dlq` with the actor's message (`handler_error`, or `non_finite` when
  the message names one). A request of several prompts is sent again one prompt at a
  time first, so only the prompts it refuses go.

Each group carries the engine the actor names in its answer (`engine`: torch or vllm; ""
from an actor that does not say), so the learner knows whose log-probs it trains on.

The rollout gate (`services/rollout/gate.py`) removes samples that are too long, hold
control characters or miss `response_schema`; a group it empties goes to `rl.dlq`
(reason `rejected`) with the reasons.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import httpx
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, Field, field_validator

from steadyrl.bus.stage import Output, RetryLater, Stage, refusal_reason
from steadyrl.config import ServiceConfig, load
from steadyrl.http import Health, response_detail
from steadyrl.service import run_service
from steadyrl.wire.codec import Rejected
from steadyrl.wire.contracts import Contract, DLQReason, EpisodeState, Prompt, RolloutGroup, Sample

from .episodes import AgentSection, EpisodeRunner, make_episode_handler
from .gate import RolloutGate

if TYPE_CHECKING:
    from steadyrl.bus.stage import BatchHandler, Meta


class RolloutSection(BaseModel):
    """The rollout worker's own settings."""

    model_config = ConfigDict(extra="forbid")  # a typo is an error, not a silent default

    actor_url: str = Field("http://127.0.0.1:8100", description="Base URL of the actor.")
    group_id: str = Field("steadyrl-rollout", description="Consumer group shared by all rollout workers.")
    batch_size: int = Field(8, ge=1, le=1000, description="Prompts per transaction (and per actor request).")
    batch_timeout_s: float = Field(0.5, gt=0, le=60, description="Longest wait for the next prompt, seconds.")
    request_timeout_s: float = Field(600.0, gt=0, description="Per /generate call.")
    retry_backoff_s: float = Field(2.0, gt=0, description="Wait before retrying while the actor is unreachable.")
    behind_backoff_s: float = Field(0.2, gt=0, description="Wait before retrying while the actor loads a policy "
                                                           "(a 503 without Retry-After).")
    max_hold_s: float = Field(900.0, ge=0, description="A prompt the actor keeps failing (503 behind or busy, 5xx) "
                                                       "while it serves other prompts goes to rl.dlq "
                                                       "(retries_exhausted) once held this long since its first "
                                                       "failure and tried max_attempts times (then once more, "
                                                       "alone). Longer than any wait that ends: the learner's "
                                                       "evaluation before its first step (~70 s on SmolLM2), a "
                                                       "policy load. While the actor serves no prompt nothing is "
                                                       "dropped. Counted in memory: a restart starts it again.")
    max_attempts: int = Field(5, ge=1, description="Least failed tries before max_hold_s can drop a prompt.")
    max_response_tokens: int | None = Field(None, ge=1, description="Rollout gate: longer samples leave their "
                                                                     "group; None: longer than their prompt's "
                                                                     "max_new_tokens (learner.max_new_tokens).")
    response_schema: dict[str, Any] | None = Field(None, description="Rollout gate: a JSON Schema every response must "
                                                           "satisfy (structured outputs); None: no check.")

    agent: AgentSection = Field(AgentSection(), description="Multi-turn episodes with tools or an environment "
                                                            "(services/rollout/episodes.py, docs/agents.md).")

    @field_validator("response_schema")
    @classmethod
    def _valid_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            try:
                Draft202012Validator.check_schema(v)
            except SchemaError as e:
                raise ValueError(f"not a valid JSON Schema: {e.message}") from None
        return v


class RolloutConfig(ServiceConfig):
    rollout: RolloutSection = RolloutSection()


#: With episodes, how long a batch's turn runs before the stage pauses its partitions (Stage
#: pause_after_s). Each turn's next state is read back at once unless the turn was paused: a
#: resume cost 0.3-0.9 s before the committed state came back (bench/agents.py's method, a
#: 0.7 s turn: 301 ms median between turns against 12 ms unpaused), on every turn past 0.5 s.
EPISODE_PAUSE_AFTER_S = 10.0


REJECTED = Counter("steadyrl_rollout_samples_rejected", "Samples the rollout gate removed", ["reason"])


#: The sampling settings and policy of a prompt: prompts sharing them go in one actor request.
_RequestKey = tuple[int, float, float, int, str, int]


def _request_key(p: Prompt) -> _RequestKey:
    return (p.n_samples, p.temperature, p.top_p, p.max_new_tokens, p.run_id, p.min_policy_version)


#: Longest Retry-After the worker follows (seconds); longer ones are cut to this.
MAX_RETRY_AFTER_S = 60.0


def _retry_after(resp: httpx.Response, default: float) -> float:
    """Retry-After in seconds (an HTTP date is not followed), within [0.05, MAX_RETRY_AFTER_S]."""
    try:
        return min(max(float(resp.headers["retry-after"]), 0.05), MAX_RETRY_AFTER_S)
    except (KeyError, ValueError):
        return default


def _engine(answer: dict[str, Any]) -> str:
    """The actor's generation engine ("torch", "vllm"), which the learner's TIS correction
    follows; "" (unknown) from an actor that does not say, or says something that is not a
    short string."""
    engine = answer.get("engine", "")
    return engine if isinstance(engine, str) and len(engine) <= 64 else ""


def make_handler(cfg: RolloutConfig, client: httpx.Client) -> BatchHandler:
    """[(Prompt, meta)] -> per prompt one [Output(rl.rollouts)], a codec.Rejected (to rl.dlq:
    the actor refused it, or the rollout gate emptied its group) or a RetryLater (held), with
    one actor call per sampling setting (module doc)."""
    r = cfg.rollout
    gate = RolloutGate(r.max_response_tokens, r.response_schema)

    def handle_batch(items: list[tuple[Contract, Meta]]) -> list[list[Output] | RetryLater | Rejected]:
        prompts = [cast(Prompt, p) for p, _ in items]  # the stage's input_contract
        by_key: dict[_RequestKey, list[int]] = {}
        for i, p in enumerate(prompts):
            by_key.setdefault(_request_key(p), []).append(i)
        answers: dict[int, RolloutGroup | RetryLater | Rejected] = {}
        down: RetryLater | None = None
        for idx in by_key.values():
            out = down or _call_actor(r, client, [prompts[i] for i in idx])
            if isinstance(out, Rejected) and len(idx) > 1:  # which of them does it refuse?
                for i in idx:
                    one = _call_actor(r, client, [prompts[i]])
                    answers[i] = one[0] if isinstance(one, list) else one
                continue
            if isinstance(out, RetryLater) and not out.counts:
                down = out  # unreachable: the other requests would wait for the same
            for k, i in enumerate(idx):
                answers[i] = out[k] if isinstance(out, list) else out
        return [_gated(gate, prompts[i], answers[i]) for i in range(len(items))]

    return handle_batch


def _call_actor(r: RolloutSection, client: httpx.Client,
                prompts: list[Prompt]) -> list[RolloutGroup] | RetryLater | Rejected:
    """One POST /generate of `prompts` (one sampling setting: the first prompt's): a group per
    prompt, or what every prompt of it gets instead (RetryLater: the actor is down, not ready
    or failing, or refused this worker's token; Rejected: it refused the prompts)."""
    p0 = prompts[0]
    body = {"prompts": [{"messages": [m.model_dump() for m in p.messages], "seed": p.seed} for p in prompts],
            "n": p0.n_samples, "temperature": p0.temperature, "top_p": p0.top_p,
            "max_new_tokens": p0.max_new_tokens, "run_id": p0.run_id,
            "min_policy_version": p0.min_policy_version}
    try:
        resp = client.post(f"{r.actor_url}/generate", json=body, timeout=r.request_timeout_s)
    except httpx.HTTPError as e:  # down: nothing counts
        return RetryLater(f"actor unreachable: {type(e).__name__}: {e}", r.retry_backoff_s)
    if resp.status_code == 503:  # loading, behind the prompt's min_policy_version, or busy
        return RetryLater(f"actor not ready: {response_detail(resp)}", _retry_after(resp, r.behind_backoff_s),
                          counts=True)
    if resp.status_code in (401, 403):  # this worker's token, not the prompts': retried, never dead-lettered
        return RetryLater(f"actor refused this worker's credentials ({resp.status_code}: {response_detail(resp)}); "
                          f"check http_token_file", r.retry_backoff_s, counts=True)
    if resp.status_code >= 500:
        return RetryLater(f"actor answered {resp.status_code}: {response_detail(resp)}",
                          _retry_after(resp, r.retry_backoff_s), counts=True)
    if resp.status_code >= 400:
        detail = response_detail(resp)
        return Rejected(refusal_reason(detail), f"actor refused the prompt ({resp.status_code}): {detail}")
    out = resp.json()
    return [RolloutGroup(prompt=p, prompt_token_ids=out["prompt_ids"][i],
                         samples=[Sample(text=c["text"], token_ids=c["token_ids"], logprobs=c["logprobs"],
                                         finish_reason=c["finish_reason"]) for c in out["completions"][i]],
                         policy_version=out["policy_version"], actor=r.actor_url, engine=_engine(out))
            for i, p in enumerate(prompts)]


def _gated(gate: RolloutGate, prompt: Prompt,
           answer: RolloutGroup | RetryLater | Rejected) -> list[Output] | RetryLater | Rejected:
    """A prompt's answer after the rollout gate: its group less the samples the gate rejects
    (each counted by reason) as one Output to rl.rollouts, or Rejected when none is left; a
    RetryLater or Rejected from the actor as it is."""
    if not isinstance(answer, RolloutGroup):
        return answer
    g, why = gate.apply(answer)
    for reason, n in why.items():
        REJECTED.labels(reason).inc(n)
    if not g.samples:
        detail = ", ".join(f"{k} x{n}" for k, n in sorted(why.items()))
        return Rejected(DLQReason.rejected, f"rollout gate: all {sum(why.values())} samples rejected ({detail})")
    return [Output("rl.rollouts", prompt.prompt_id, g)]


def main(argv: list[str]) -> int:
    cfg = load(RolloutConfig, argv, prog="steadyrl-rollout")
    def build(health: Health) -> Stage:
        client = httpx.Client(headers=cfg.http_auth_headers(), auth=cfg.http_auth())
        r = cfg.rollout
        agent = r.agent.on   # episodes: rl.prompts starts them, rl.episodes carries them between turns
        handler = (make_episode_handler(EpisodeRunner(r.agent, r.actor_url, client, r.request_timeout_s,
                                                      r.retry_backoff_s)) if agent else make_handler(cfg, client))
        return Stage(name="rollout", bootstrap=cfg.bootstrap, topic_prefix=cfg.topic_prefix,
                     instance_id=cfg.instance_id, input_topic="rl.prompts", input_contract=Prompt,
                     more_inputs={"rl.episodes": EpisodeState} if agent else None,
                     group_id=cfg.rollout.group_id, handle_batch=handler,
                     batch_size=cfg.rollout.batch_size, batch_timeout_s=cfg.rollout.batch_timeout_s,
                     health=health, stats_interval_s=cfg.metrics_interval, max_hold_s=cfg.rollout.max_hold_s,
                     max_attempts=cfg.rollout.max_attempts,
                     pause_after_s=EPISODE_PAUSE_AFTER_S if agent else 0.5)

    return run_service("rollout", cfg, build)

"""Reward server: scores (prompt, response) pairs over HTTP with rule and model scorers.

    POST /score {"scorer": "numeric_match",            # optional: the server's default
                 "items": [{"data_source": "...", "prompt": "...", "response": "...",
                            "ground_truth": "4", "extra_info": {}}, ...]}
      -> {"scorer": "rule:numeric_match@1", "reward_source": "rule",
          "scores": [{"reward": 1.0, "extra": {}}, ...]}

Scorers are named by their spec (`reward_server.scorers`; `steadyrl.model.scorers` lists
them: rules, `rm:<dir>` reward models, `embedding:all-minilm-l6-v2`); model scorers answer
`reward_source: "model"` and score a request in batches of `batch_size` items.

Rule scorers are the user's code: they run item by item in `processes` worker processes
(steadyrl.model.scorepool), each item within `item_timeout_s` (then its process is killed and
replaced) and each process within `memory_limit_mb`; every call is answered within
`call_deadline_s` of its body (below the reward worker's 30 s timeout). When a scorer cannot
score one item, that item's entry is `{"reward": null, "error": "...", "kind": "..."}` and the
others are scored; the caller decides (the reward worker sends that group to `rl.dlq`, the
kind its reason):

    scorer_error     it raised (sys.exit too), or returned what is not a reward: a str
                     ("0.7"), a bool, None, a dict without "score", extras JSON cannot hold;
                     MemoryError past memory_limit_mb; an item a model scorer cannot take
    scorer_timeout   it ran past item_timeout_s, or past the call's deadline (started or not)
    scorer_crash     it killed its process (os._exit, a segfault)
    non_finite       it returned NaN or infinity (in the reward or an extra)

A reward is a real number or a dict with a real "score" (steadyrl.model.rewards.score_value: numpy
numbers are taken; numpy scalars and arrays in the extras become numbers and lists).

Answers 404 for a scorer it does not serve, 422 for a malformed body, 503 while a model
scorer is loading, 500 when a model fails on a batch, and 504 when a model scorer has not
answered by call_deadline_s + 1 s (its slot is freed then). /readyz is 503 until every model
is loaded, while every `max_concurrent` slot is taken, and while items wait over 5 s for a
scoring process. Limits (`reward_server:` section): a body above `max_body_bytes` gets 413,
one slower than `body_timeout_s` 408, a call past `max_concurrent` in progress 503 with
Retry-After (steadyrl/http.py `add_work_route`; the probes never wait behind /score). Reward
workers call it through `steadyrl.services.reward.client.RewardClient`. Run:
`python -m steadyrl.services.reward.server`. Metrics:
`steadyrl_reward_server_score_seconds{scorer}`, `_items_total{scorer}` (scored),
`_errors_total{kind}` (kind: unknown_scorer, too_many_items, not_ready, model_error, and per
item scorer_error, scorer_timeout, scorer_crash, non_finite).
"""

from __future__ import annotations

import logging
import math
import numbers
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import HTTPException
from prometheus_client import Counter, Histogram
from pydantic import BaseModel, ConfigDict, Field

from steadyrl.config import ConfigError, ServiceConfig, load
from steadyrl.http import Health, WorkRoute, add_work_route, finite_json
from steadyrl.model.scorepool import ScoringLimits, ScoringPool
from steadyrl.model.scorers import ScorerError, build_scorer, spec_kind
from steadyrl.service import main_guard, run_service

if TYPE_CHECKING:
    from fastapi import FastAPI

    from steadyrl.service import Loop

log = logging.getLogger("steadyrl.reward_server")

SCORE_SECONDS = Histogram("steadyrl_reward_server_score_seconds", "Time of one /score call", ["scorer"],
                          buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30))
SCORED = Counter("steadyrl_reward_server_items", "Items scored", ["scorer"])
ERRORS = Counter("steadyrl_reward_server_errors", "Failed /score calls and failed items", ["kind"])
for _k in ("scorer_error", "scorer_timeout", "scorer_crash", "non_finite"):
    ERRORS.labels(_k)   # every item kind exists from the start

#: Seconds past call_deadline_s after which the HTTP layer answers 504 itself (a model scorer
#: that hangs): the rule scorers' pool has answered by then.
ANSWER_MARGIN_S = 1.0


class RewardServerSection(ScoringLimits):
    """The reward server's own settings (the scoring processes' limits: ScoringLimits)."""

    model_config = ConfigDict(extra="forbid")  # a typo is an error, not a silent default

    scorers: list[str] = Field(
        ["numeric_match", "numeric_match_formatted", "format", "length_penalty", "tiny_copy"], min_length=1,
        description="Scorers served, each named by its spec (requests name it the same way): a rule "
                    "(`numeric_match`, `tiny_copy`, ... or `module:function`); `rm:<local dir>`, a "
                    "sequence-classification reward model whose reward is the logit of label 0 over the "
                    "prompt and response; or `embedding:all-minilm-l6-v2`, whose reward is the cosine "
                    "similarity of the response and the ground_truth.")
    default_scorer: str = Field("numeric_match", description="Used when a request names none.")
    scorer_version: str = Field("1", description="Rule scorers report `rule:<spec>@<version>`.")
    max_items: int = Field(4096, ge=1, description="Largest batch one request may send.")
    batch_size: int = Field(32, ge=1, description="Model scorers: items per forward pass.")
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024,
                                description="Largest POST /score body, bytes; larger gets 413 (16 MiB: max_items "
                                            "items of a few KB each).")
    max_concurrent: int = Field(16, ge=1, description="POST /score calls in progress at once; past it 503 with "
                                                      "Retry-After.")
    body_timeout_s: float = Field(30.0, gt=0, description="Seconds a request body may take to arrive; slower gets 408.")


class RewardServerConfig(ServiceConfig):
    reward_server: RewardServerSection = RewardServerSection()


class ScoreItem(BaseModel):
    """One (prompt, response) to score; `prompt` may be absent (older clients, rule scorers)."""

    data_source: str = ""
    prompt: str = Field("", description="The prompt's text (its last user message); model scorers read it.")
    response: str
    ground_truth: str | None = None
    extra_info: dict[str, Any] = Field(default_factory=dict)


class ScoreRequest(BaseModel):
    """A /score body: a scorer name (None: the default) and 1..max_items items."""

    scorer: str | None = None
    items: list[ScoreItem] = Field(min_length=1)


class RewardServer:
    """The scorers of a RewardServerSection, by spec, and the /score logic over them.

    Model weights are loaded by `load()`, not here, so /readyz can answer meanwhile.

    Raises:
        ValueError: a scorer spec cannot be built, or default_scorer is not a served name.
    """

    def __init__(self, section: RewardServerSection):
        self.section = section
        n = section.pool_processes()
        self.pool = (ScoringPool(n, section.item_timeout_s, section.memory_limit_mb)
                     if n and any(spec_kind(spec) == "rule" for spec in section.scorers) else None)
        try:
            self.scorers = {spec: build_scorer(spec, section.scorer_version, section.batch_size, self.pool)
                            for spec in section.scorers}
            if section.default_scorer not in self.scorers:
                raise ValueError(f"default_scorer {section.default_scorer!r} is not among scorers "
                                 f"{sorted(self.scorers)}")
        except BaseException:
            self.close()
            raise
        self.route: WorkRoute | None = None   # add_routes sets it: its slots are part of /readyz

    def close(self) -> None:
        """Stop the scoring processes."""
        if self.pool is not None:
            self.pool.close()

    def load(self, beat: Callable[[], None] = lambda: None) -> None:
        """Load every model scorer's weights, calling `beat()` between them."""
        for name, scorer in self.scorers.items():
            beat()
            if not scorer.ready:
                t0 = time.perf_counter()
                scorer.load()
                log.info("scorer loaded", extra={"scorer": name, "id": scorer.id,
                                                  "seconds": round(time.perf_counter() - t0, 2)})

    def ready(self) -> tuple[bool, str]:
        """(all scorers loaded and room for a call, detail): the /readyz check. Not ready while a
        model loads, while every max_concurrent slot is taken, or while items wait for a scoring
        process (steadyrl.model.scorepool.ScoringPool.ready)."""
        loading = sorted(n for n, s in self.scorers.items() if not s.ready)
        if loading:
            return False, f"loading {loading}"
        parts, ok = [f"serving {sorted(self.scorers)}"], True
        for check in (self.route.ready if self.route else None, self.pool.ready if self.pool else None):
            if check is not None:
                good, detail = check()
                ok, parts = ok and good, [*parts, detail]
        return ok, "; ".join(parts)

    def score(self, req: ScoreRequest) -> dict[str, Any]:
        """Score every item. Raises HTTPException 404/422/503/500 (see module doc)."""
        name = req.scorer or self.section.default_scorer
        scorer = self.scorers.get(name)
        if scorer is None:
            ERRORS.labels("unknown_scorer").inc()
            raise HTTPException(404, f"scorer {name!r} is not served here; served: {sorted(self.scorers)}")
        if len(req.items) > self.section.max_items:
            ERRORS.labels("too_many_items").inc()
            raise HTTPException(422, f"{len(req.items)} items > max_items {self.section.max_items}")
        if not scorer.ready:
            ERRORS.labels("not_ready").inc()
            raise HTTPException(503, f"scorer {name!r} is still loading")
        t0_mono = time.monotonic()
        t0 = time.perf_counter()
        try:
            out = scorer.score(req.items, deadline=t0_mono + self.section.call_deadline_s)
        except ScorerError as e:  # the model failed: the caller retries (5xx)
            ERRORS.labels("model_error").inc()
            log.error("model scorer failed", extra={"scorer": name, "error": str(e)})
            raise HTTPException(500, str(e)) from None
        SCORE_SECONDS.labels(name).observe(time.perf_counter() - t0)
        failed: dict[str, int] = {}
        for i, r in enumerate(out):
            if r["reward"] is not None and (bad := _not_finite(r)) is not None:   # a model scorer's NaN
                r.clear()
                r.update({"reward": None, "error": f"scorer {scorer.id} {bad[1]}", "kind": bad[0]})
            if r["reward"] is None:
                kind = r.setdefault("kind", "scorer_error")
                ERRORS.labels(kind).inc()
                if kind not in failed:   # one line per kind and call: a scorer failing on everything floods no log
                    log.warning("scorer failed on an item", extra={"scorer": name, "item": i, "kind": kind,
                                                                    "error": r["error"]})
                failed[kind] = failed.get(kind, 0) + 1
        if failed:
            log.warning("scorer failed on items of a call", extra={"scorer": name, "items": len(out), **failed})
        SCORED.labels(name).inc(len(out) - sum(failed.values()))
        return {"scorer": scorer.id, "reward_source": scorer.source.value, "scores": out}


def _not_finite(result: dict[str, Any]) -> tuple[str, str] | None:
    """(kind, why) one scored item cannot be sent (reward not a number: scorer_error; NaN or
    infinity in the reward or the extras: non_finite; extras not JSON: scorer_error), or None;
    a numeric reward of another type (numpy) becomes a float in place. The rule scorers' pool
    checks the same in its processes (steadyrl.model.rewards.score_value): this is for model scorers."""
    reward = result["reward"]
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        return "scorer_error", f"returned {reward!r}, not a number"
    if not math.isfinite(reward):
        return "non_finite", f"returned {float(reward)!r}, not a finite number"
    result["reward"] = float(reward)
    try:
        finite_json(result.get("extra", {}))
    except ValueError:
        return "non_finite", "returned extras holding NaN or infinity"
    except TypeError as e:
        return "scorer_error", f"returned extras that are not JSON ({e})"
    return None


def add_routes(app: FastAPI, server: RewardServer, token: str | None = None) -> None:
    """`POST /score` on `app`, answered by `server`, with the section's body, time and
    concurrency limits."""
    s = server.section
    server.route = add_work_route(app, "/score", ScoreRequest, server.score, max_concurrent=s.max_concurrent,
                                  max_body_bytes=s.max_body_bytes, body_timeout_s=s.body_timeout_s, token=token,
                                  answer_within_s=s.call_deadline_s + ANSWER_MARGIN_S)


def main(argv: list[str]) -> int:
    cfg = load(RewardServerConfig, argv, prog="steadyrl-reward-server")
    try:
        server = RewardServer(cfg.reward_server)
    except ValueError as e:
        field = "default_scorer" if str(e).startswith("default_scorer") else "scorers"
        raise ConfigError(f"invalid RewardServerConfig:\n  reward_server.{field}: {e}") from None

    def build(health: Health) -> Loop:
        health.add_check("scorers", server.ready)

        class Idle:
            def run(self, stop: threading.Event) -> None:
                server.load(beat=health.beat)  # /readyz says "loading [...]" until this returns
                while not stop.wait(1.0):
                    health.beat()

        health.beat()
        return Idle()

    token = cfg.http_token()
    try:
        return run_service("reward-server", cfg, build, extra_routes=lambda app: add_routes(app, server, token))
    finally:
        server.close()


if __name__ == "__main__":
    main_guard(main)

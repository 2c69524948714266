"""Reward server: scores (prompt, response) pairs over HTTP with the rule scorers.

    POST /score {"scorer": "numeric_match",            # optional: the server's default
                 "items": [{"data_source": "...", "response": "...", "ground_truth": "4",
                            "extra_info": {}}, ...]}
      -> {"scorer": "rule:numeric_match@1", "reward_source": "rule",
          "scores": [{"reward": 1.0, "extra": {}}, ...]}

Answers 404 for a scorer it does not serve and 422 for a malformed body. When the scorer
raises on an item, that item's entry is `{"reward": null, "error": "..."}` and the others
are scored: the caller decides (the reward worker sends that group to `rl.dlq`). Reward workers call it through
`services.reward.client.RewardClient`. Run: `python -m services.reward.server`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from fastapi import HTTPException
from prometheus_client import Counter, Histogram
from pydantic import BaseModel, ConfigDict, Field

from steadyrl.config import ServiceConfig, load

log = logging.getLogger("steadyrl.reward_server")

SCORE_SECONDS = Histogram("steadyrl_reward_server_score_seconds", "Time of one /score call", ["scorer"],
                          buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30))
SCORED = Counter("steadyrl_reward_server_items", "Items scored", ["scorer"])
ERRORS = Counter("steadyrl_reward_server_errors", "Failed /score calls", ["kind"])


class RewardServerSection(BaseModel):
    """The reward server's own settings."""

    model_config = ConfigDict(extra="forbid")  # a typo is an error, not a silent default

    scorers: list[str] = Field(["numeric_match", "numeric_match_formatted", "format", "length_penalty", "tiny_copy"],
                               min_length=1, description="Scorers served: registered names or module:function.")
    default_scorer: str = Field("numeric_match", description="Used when a request names none.")
    scorer_version: str = Field("1", description="Reported as `rule:<scorer>@<version>`.")
    max_items: int = Field(4096, ge=1, description="Largest batch one request may send.")


class RewardServerConfig(ServiceConfig):
    reward_server: RewardServerSection = RewardServerSection()


class ScoreItem(BaseModel):
    data_source: str = ""
    response: str
    ground_truth: str | None = None
    extra_info: dict[str, Any] = Field(default_factory=dict)


class ScoreRequest(BaseModel):
    scorer: str | None = None
    items: list[ScoreItem] = Field(min_length=1)


def build_scorers(section: RewardServerSection) -> dict:
    """name -> scorer function. Raises ValueError for an unknown scorer (at start)."""
    from steadyrl.rewards import resolve_scorer

    scorers = {name: resolve_scorer(name) for name in section.scorers}
    if section.default_scorer not in scorers:
        raise ValueError(f"default_scorer {section.default_scorer!r} is not among scorers {section.scorers}")
    return scorers


def score(scorers: dict, section: RewardServerSection, req: ScoreRequest) -> dict:
    """Score every item. Raises HTTPException 404/422/500 (see module doc)."""
    from steadyrl.rewards import score_value

    name = req.scorer or section.default_scorer
    fn = scorers.get(name)
    if fn is None:
        ERRORS.labels("unknown_scorer").inc()
        raise HTTPException(404, f"scorer {name!r} is not served here; served: {sorted(scorers)}")
    if len(req.items) > section.max_items:
        ERRORS.labels("too_many_items").inc()
        raise HTTPException(422, f"{len(req.items)} items > max_items {section.max_items}")
    t0 = time.perf_counter()
    out = []
    for i, it in enumerate(req.items):
        try:
            reward, extra = score_value(fn(it.data_source, it.response, it.ground_truth, it.extra_info))
        except Exception as e:  # a scorer bug on one input: report it for that item only
            ERRORS.labels("scorer_error").inc()
            log.warning("scorer failed", extra={"scorer": name, "item": i, "error": f"{type(e).__name__}: {e}"})
            out.append({"reward": None, "error": f"scorer {name!r} failed: {type(e).__name__}: {e}"})
            continue
        out.append({"reward": reward, "extra": extra})
    SCORE_SECONDS.labels(name).observe(time.perf_counter() - t0)
    SCORED.labels(name).inc(len(out))
    return {"scorer": f"rule:{name}@{section.scorer_version}", "reward_source": "rule", "scores": out}


def main(argv: list[str]) -> int:
    cfg = load(RewardServerConfig, argv, prog="steadyrl-reward-server")
    from steadyrl.service import run_service

    try:
        scorers = build_scorers(cfg.reward_server)
    except ValueError as e:
        from steadyrl.config import ConfigError

        field = "default_scorer" if str(e).startswith("default_scorer") else "scorers"
        raise ConfigError(f"invalid RewardServerConfig:\n  reward_server.{field}: {e}") from None

    def routes(app):
        @app.post("/score")
        def score_route(req: ScoreRequest) -> dict:
            return score(scorers, cfg.reward_server, req)

    def build(health):
        health.add_check("scorers", lambda: (True, f"serving {sorted(scorers)}"))

        class Idle:
            def run(self, stop: threading.Event) -> None:
                while not stop.wait(1.0):
                    health.beat()

        health.beat()
        return Idle()

    return run_service("reward-server", cfg, build, extra_routes=routes)


if __name__ == "__main__":
    from steadyrl.service import main_guard

    main_guard(main)

"""The reward workers' one way to the reward server.

`RewardClient.score_many(groups)` returns each group's rewards, or raises `RetryLater` when the
server cannot answer now (unreachable, timeout, 408/429, 5xx, or an answer that is not the
expected JSON): the worker then holds its batch,
nothing is lost. A 4xx (e.g. the scorer is not served) or a scorer error on one of the
group's samples raises ValueError, which sends the group to `rl.dlq`. The resilience issue adds the circuit
breaker and the cached-score fallback here, behind the same method.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx

from steadyrl.bus.stage import RetryLater
from steadyrl.contracts import RewardSource, RolloutGroup


@dataclass
class Scores:
    """Rewards of one group: (n,) floats, the scorer id, where they came from, per-sample extras."""

    rewards: list[float]
    scorer: str
    source: RewardSource
    extra: list[dict[str, Any]] = field(default_factory=list)


class RewardClient:
    """HTTP client of the reward server.

    Args:
        url: base URL of the reward server.
        scorer: scorer name to ask for (None: the server's default).
        timeout_s: per call, seconds.
        retry_backoff_s: how long a held batch waits before it is retried.
    """

    def __init__(self, url: str, scorer: str | None = None, timeout_s: float = 30.0,
                 retry_backoff_s: float = 2.0):
        self.url, self.scorer = url.rstrip("/"), scorer
        self.timeout_s, self.retry_backoff_s = timeout_s, retry_backoff_s
        self.http = httpx.Client()

    def score_many(self, groups: list[RolloutGroup]) -> list[Scores]:
        """Score every sample of every group in one request. Raises RetryLater or ValueError."""
        items = [{"data_source": g.prompt.data_source, "response": s.text, "ground_truth": g.prompt.ground_truth,
                  "extra_info": g.prompt.extra_info} for g in groups for s in g.samples]
        body = {"scorer": self.scorer, "items": items}
        try:
            resp = self.http.post(f"{self.url}/score", json=body, timeout=self.timeout_s)
        except httpx.HTTPError as e:
            raise RetryLater(f"reward server unreachable: {type(e).__name__}: {e}", self.retry_backoff_s) from None
        if resp.status_code >= 500 or resp.status_code in (408, 429):
            raise RetryLater(f"reward server answered {resp.status_code}: {resp.text[:200]}", self.retry_backoff_s)
        if resp.status_code >= 400:
            raise ValueError(f"reward server refused the request ({resp.status_code}): {resp.text[:500]}")
        try:
            out = resp.json()
            scores, scorer = out["scores"], out["scorer"]
            source = RewardSource(out.get("reward_source", "rule"))
        except (ValueError, KeyError, TypeError) as e:  # the server's bug, not the group's
            raise RetryLater(f"reward server answered 200 without scores: {type(e).__name__}: {e}; "
                             f"body {resp.text[:200]!r}", self.retry_backoff_s) from None
        if len(scores) != len(items):
            raise RetryLater(f"reward server returned {len(scores)} scores for {len(items)} items", self.retry_backoff_s)
        result, k = [], 0
        for g in groups:
            n = len(g.samples)
            chunk = scores[k:k + n]
            k += n
            errors = [c["error"] for c in chunk if c.get("reward") is None]
            if errors:  # the scorer cannot score this group: not retryable
                raise ValueError(f"prompt {g.prompt_id}: {errors[0]}")
            result.append(Scores([float(c["reward"]) for c in chunk], scorer, source,
                                 [c.get("extra", {}) for c in chunk]))
        return result

    def close(self) -> None:
        self.http.close()

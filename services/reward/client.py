"""The reward workers' one way to the reward server: timeout, circuit breaker, cached scores.

`RewardClient.score_many(groups)` returns, for each group, its `Scores`, a `codec.Rejected`
(the worker sends the group to `rl.dlq`) or a `RetryLater` (the worker holds it); it raises
`RetryLater` when the whole batch must wait. What the server's answer means:

    200, every item scored       Scores
    200, an item unscored        that group Rejected: `{"reward": null, "error", "kind"}`, the
                                 reason the first such item's kind: scorer_error (raised, or
                                 returned what is not a reward), scorer_timeout, scorer_crash,
                                 non_finite (NaN, infinity); the error "prompt P: k of n items
                                 unscored: <the first error>" (n: the items it ran). The other
                                 groups are scored, and nothing the server answered is sent again
    200, items left at the       that group held (`RetryLater(own=True)`: sent again alone), when
      server's deadline          none of its items failed: kind `deadline` is the server's time
                                 running out (a slow reward, a busy pool), not the scorer failing
    4xx (not 408/429)            the server is up (a breaker success); the request or a group is
                                 wrong. One group: Rejected with the server's message (a 422
                                 naming a non-finite score: non_finite); several: each group is
                                 sent again alone, so only the groups it refuses go
    500, other 5xx, malformed    the server answered and failed this batch. If it scores the
                                 last item it scored (the known-good check, one item, as the
                                 probe), the failure is the batch's own: not a breaker failure,
                                 and `RetryLater(own=True)`: the stage tries each group alone,
                                 and one that keeps failing goes to rl.dlq (retries_exhausted)
                                 once its budget is spent. Else a breaker failure, held
    408, 429, 502-504, timeout,  the server is down or overloaded: a breaker failure, held
    unreachable                  without limit (`RetryLater`, counts=False)

Around each call to `POST /score`:

    timeout      `timeout_s` (default 30 s) for connect, each read and each write; the
                 server answers within its call_deadline_s (25 s), a user's scorer that
                 hangs included (those items are its scorer_timeout), so a timeout here is
                 the server down, not the scorer
    breaker      steadyrl.breaker.CircuitBreaker: 3 consecutive failures (unreachable,
                 timeout, 408/429/5xx, malformed answer) open it; while open no call goes
                 out, and a background probe re-scores the last scored item every
                 `probe_interval_s` (POST /score, one item, short timeout: a server whose
                 /readyz answers while its model hangs does not pass); a probe that is
                 answered half-opens it (as does `reset_timeout_s` passing); the trial
                 call's success closes it
    fallback     while open, each group is scored from the most similar of the last 1000
                 prompts the server scored (steadyrl.services.reward.cache), marked
                 `reward_source=cache` with the similarity; a group below the similarity
                 floor, or whose ground truth differs, is held until the server is back

A failure that does not (yet) open the breaker holds the whole batch for `retry_backoff_s`.
Held groups while the breaker is open never count against their budget: nothing is
dropped during an outage.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
from prometheus_client import Counter, Gauge, Histogram

from steadyrl.breaker import CircuitBreaker, State
from steadyrl.bus.stage import RetryLater, refusal_reason
from steadyrl.http import response_detail
from steadyrl.model.scorepool import DEADLINE
from steadyrl.wire.codec import Rejected
from steadyrl.wire.contracts import DLQReason, RewardSource, RolloutGroup

if TYPE_CHECKING:
    from .cache import ScoreCache

log = logging.getLogger("steadyrl.reward")

BREAKER_STATE = Gauge("steadyrl_reward_breaker_state", "1 for the reward server breaker's current state", ["state"])
BREAKER_CHANGES = Counter("steadyrl_reward_breaker_transitions", "Breaker state changes", ["to"])
CALLS = Counter("steadyrl_reward_calls", "Calls to the reward server", ["outcome"])
CALL_SECONDS = Histogram("steadyrl_reward_call_seconds", "Duration of one /score call (any outcome)",
                         buckets=(0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60))
FALLBACK = Counter("steadyrl_reward_fallback_groups", "Groups met while the breaker was open",
                   ["outcome"])  # cache | held
CACHE_SIMILARITY = Histogram("steadyrl_reward_cache_similarity", "Prompt similarity of cache-scored groups",
                             buckets=(0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.99, 1.0))
CACHE_SIZE = Gauge("steadyrl_reward_cache_prompts", "Scored prompts held for the cached-score fallback")
for _s in State:  # every series exists from the start: dashboards show 0, not "no data"
    BREAKER_CHANGES.labels(_s.value)
for _o in ("cache", "held"):
    FALLBACK.labels(_o)
for _o in ("ok", "timeout", "unreachable", "server_error", "refused", "malformed"):
    CALLS.labels(_o)


#: Answers that say the server is down or overloaded, not that this batch is wrong.
UNAVAILABLE = (408, 429, 502, 503, 504)


class Refused(ValueError):
    """The server refused the request (a 4xx other than 408/429): `status`, its message, and
    the items it names (`{"items": [{"index", "error"}]}` of a 422: index -> error)."""

    def __init__(self, status: int, detail: str, items: dict[int, str] | None = None):
        super().__init__(f"reward server refused the request ({status}): {detail}")
        self.status, self.detail, self.items = status, detail, items or {}


def _named_items(resp: httpx.Response) -> dict[int, str]:
    """The items a refusal names by index (the reward server's 422 for non-finite scores)."""
    try:
        return {int(it["index"]): str(it.get("error", "")) for it in resp.json().get("items", [])}
    except (ValueError, KeyError, TypeError, AttributeError):
        return {}


def scorer_error_detail(prompt_id: str, failed: int, items: int, first: str) -> str:
    """The DLQ error (reason: the first failed item's kind, `item_reason`) of a group whose scorer
    failed on `failed` of its `items` samples, `first` the first one's error (the server's, e.g.
    steadyrl.model.rewards.raised):
    `prompt <id>: <failed> of <items> items unscored: <first>` (the learner reads the counts back:
    services/learner/refusals.py)."""
    return f"prompt {prompt_id}: {failed} of {items} items unscored: {first}"


#: The item kinds the reward server names (`kind`), each its own rl.dlq reason.
ITEM_KINDS = {k.value: k for k in (DLQReason.scorer_error, DLQReason.scorer_timeout, DLQReason.scorer_crash,
                                   DLQReason.non_finite)}


def item_reason(item: dict[str, Any]) -> DLQReason:
    """The rl.dlq reason of an unscored item of the server's answer: its `kind`
    (scorer_error, scorer_timeout, scorer_crash, non_finite); scorer_error when it has none (a
    server before kinds) or one this client does not know."""
    return ITEM_KINDS.get(str(item.get("kind", "")), DLQReason.scorer_error)


def _answer_key(g: RolloutGroup) -> tuple[str, str | None]:
    """What a cached prompt must share with a new one to lend it rewards."""
    return (g.prompt.data_source, g.prompt.ground_truth)


@dataclass
class Scores:
    """Rewards of one group: (n,) floats, the scorer id, where they came from, per-sample extras,
    and for cache-scored groups the prompt similarity (0..1)."""

    rewards: list[float]
    scorer: str
    source: RewardSource
    extra: list[dict[str, Any]] = field(default_factory=list)
    similarity: float | None = None


class RewardClient:
    """Guarded HTTP client of the reward server.

    Args:
        url: base URL of the reward server.
        scorer: scorer name to ask for (None: the server's default).
        timeout_s: per call, seconds (connect, each read, each write).
        retry_backoff_s: how long a held batch or group waits before it is retried.
        breaker: the circuit breaker (default: 3 failures, 30 s reset timeout).
        cache: the cached-score fallback (steadyrl.services.reward.cache.ScoreCache); None: no
            fallback (groups are held while the breaker is open).
        probe_interval_s: seconds between probes while open (0: no probe thread); see probe_once.
        headers: sent with every call (the stack's bearer token: ServiceConfig.http_auth_headers).
            A 401 or 403 is the worker's credentials, not the group's fault: retried, never
            dead-lettered.
    """

    def __init__(self, url: str, scorer: str | None = None, timeout_s: float = 30.0,
                 retry_backoff_s: float = 2.0, breaker: CircuitBreaker | None = None,
                 cache: ScoreCache | None = None, probe_interval_s: float = 5.0,
                 headers: dict[str, str] | None = None):
        self.url, self.scorer = url.rstrip("/"), scorer
        self.timeout_s, self.retry_backoff_s = timeout_s, retry_backoff_s
        self.http = httpx.Client(headers=headers)  # the bearer token, when the stack has one
        self.breaker = breaker or CircuitBreaker("reward-server", 3, 30.0)
        prev = self.breaker.on_change

        def on_change(old: State, new: State, why: str) -> None:
            self._on_change(new)
            if prev:
                prev(old, new, why)

        self.breaker.on_change = on_change
        self._show_state(self.breaker.state)
        self.cache = cache
        self.probe_interval_s = probe_interval_s
        self._probe_item: dict[str, Any] | None = None  # the last item the server scored
        self._stop = threading.Event()
        if probe_interval_s > 0:
            threading.Thread(target=self._probe_loop, name="reward-probe", daemon=True).start()

    @staticmethod
    def _show_state(state: State) -> None:
        for s in State:
            BREAKER_STATE.labels(s.value).set(1 if s is state else 0)

    def _on_change(self, new: State) -> None:
        self._show_state(new)
        BREAKER_CHANGES.labels(new.value).inc()

    # ---- health probe ---------------------------------------------------------------------
    def probe_once(self) -> bool:
        """Score the last scored item again (or GET /readyz before any was scored), with a
        timeout of min(timeout_s, 5 s); an answer while open half-opens the breaker.
        Returns whether the server answered."""
        if self._probe_item is None:
            try:
                ok = self.http.get(f"{self.url}/readyz", timeout=min(self.timeout_s, 5.0)).status_code == 200
            except httpx.HTTPError:
                ok = False
        else:
            ok = self._scores_known_good()
        if ok:
            self.breaker.probe_succeeded()
        return ok

    def _scores_known_good(self) -> bool:
        """Does the server score the last item it scored (one item, timeout min(timeout_s, 5 s))?
        False before any item was scored. Leaves the breaker alone."""
        if self._probe_item is None:
            return False
        try:
            resp = self.http.post(f"{self.url}/score", json={"scorer": self.scorer, "items": [self._probe_item]},
                                  timeout=min(self.timeout_s, 5.0))
            return resp.status_code == 200 and len(resp.json().get("scores", [])) == 1
        except (httpx.HTTPError, ValueError, AttributeError):
            return False

    def _probe_loop(self) -> None:
        while not self._stop.wait(self.probe_interval_s):
            if self.breaker.state is State.open:
                self.probe_once()

    def close(self) -> None:
        self._stop.set()
        self.http.close()

    # ---- scoring --------------------------------------------------------------------------
    def score_many(self, groups: list[RolloutGroup]) -> list[Scores | Rejected | RetryLater]:
        """Score every sample of every group (one request). Per group: Scores, Rejected (to
        rl.dlq) or RetryLater (held). Raises RetryLater: hold the batch (module doc)."""
        if self.breaker.allow():
            try:
                result = self._call(groups)
            except Refused as e:
                self.breaker.record_success()  # the server is up; the request or a group is wrong
                return self._refused(groups, e)
            except RetryLater as e:
                if e.counts and self._scores_known_good():
                    self.breaker.record_success()  # the server works; this batch fails
                    raise RetryLater(f"{e}; the server scores other items", e.backoff_s, own=True) from None
                e = RetryLater(str(e), e.backoff_s)  # down (or overloaded) for all we know
                self.breaker.record_failure(str(e))
                if self.breaker.state is not State.open:
                    raise e from None
                log.warning("reward server failing; scoring from the cache", extra={"why": str(e)})
            except BaseException as e:  # never leave a trial call unrecorded (half-open forever)
                self.breaker.record_failure(f"{type(e).__name__}: {e}")
                raise
            else:
                self.breaker.record_success()
                if self.cache is not None:
                    for g, s in zip(groups, result, strict=True):
                        if isinstance(s, Scores):
                            self.cache.add(g.prompt_id, g.prompt_text(), [x.text for x in g.samples], s.rewards,
                                           s.scorer, _answer_key(g))
                    CACHE_SIZE.set(len(self.cache))
                return list(result)
        return [self._from_cache(g) for g in groups]

    def _refused(self, groups: list[RolloutGroup], e: Refused) -> list[Scores | Rejected | RetryLater]:
        """Rejected for the groups a refusal is about; the others scored again. The groups of the
        items it names, if it names any; else (several groups) each group is sent alone."""
        if len(groups) == 1:
            return [Rejected(refusal_reason(e.detail), f"prompt {groups[0].prompt_id}: {e}")]
        first, k = [], 0  # index of each group's first item
        for g in groups:
            first.append(k)
            k += len(g.samples)
        named = {i: [why for j, why in e.items.items() if first[i] <= j < first[i] + len(g.samples)]
                 for i, g in enumerate(groups)}
        if not any(named.values()):
            return [r for g in groups for r in self._retry([g])]  # which groups does it refuse?
        rest = [g for i, g in enumerate(groups) if not named[i]]
        again = iter(self._retry(rest) if rest else [])
        return [Rejected(refusal_reason(f"{e.detail} {why[0]}"), f"prompt {g.prompt_id}: {why[0]} ({e})")
                if why else next(again) for g, why in zip(groups, named.values(), strict=True)]

    def _retry(self, groups: list[RolloutGroup]) -> list[Scores | Rejected | RetryLater]:
        """score_many, with a RetryLater it raises as every group's result."""
        try:
            return self.score_many(groups)
        except RetryLater as e:
            return [e] * len(groups)

    def _from_cache(self, g: RolloutGroup) -> Scores | RetryLater:
        hit = (self.cache.lookup(g.prompt_text(), [s.text for s in g.samples], _answer_key(g))
               if self.cache is not None else None)
        if hit is None:
            FALLBACK.labels("held").inc()
            return RetryLater(f"reward server breaker {self.breaker.state.value} and no cached prompt with this "
                              f"answer within similarity {self.cache.floor if self.cache else '-'}",
                              self.retry_backoff_s)
        FALLBACK.labels("cache").inc()
        CACHE_SIMILARITY.observe(hit.similarity)
        extra = [{"cache_of": hit.source_prompt_id, "response_similarity": r} for r in hit.response_similarity]
        return Scores(hit.rewards, hit.scorer, RewardSource.cache, extra, hit.similarity)

    def _call(self, groups: list[RolloutGroup]) -> list[Scores | Rejected | RetryLater]:
        """One POST /score: per group Scores, or Rejected for a group the scorer could not
        score. Raises RetryLater (the server's fault; counts unless it is down or overloaded)
        or Refused (the request's)."""
        items = [{"data_source": g.prompt.data_source, "prompt": g.prompt_text(), "response": s.text,
                  "ground_truth": g.prompt.ground_truth, "extra_info": g.prompt.extra_info}
                 for g in groups for s in g.samples]
        body = {"scorer": self.scorer, "items": items}
        t0 = time.perf_counter()
        try:
            resp = self.http.post(f"{self.url}/score", json=body, timeout=self.timeout_s)
        except httpx.TimeoutException as e:
            CALLS.labels("timeout").inc()
            raise RetryLater(f"reward server timed out after {self.timeout_s:g} s: {type(e).__name__}",
                             self.retry_backoff_s) from None
        except httpx.HTTPError as e:
            CALLS.labels("unreachable").inc()
            raise RetryLater(f"reward server unreachable: {type(e).__name__}: {e}", self.retry_backoff_s) from None
        finally:
            CALL_SECONDS.observe(time.perf_counter() - t0)
        if resp.status_code in (401, 403):  # our token, not the group: held, and the breaker counts it
            CALLS.labels("server_error").inc()
            raise RetryLater(f"reward server refused this worker's credentials ({resp.status_code}: "
                             f"{response_detail(resp)}); check http_token_file", self.retry_backoff_s)
        if resp.status_code >= 500 or resp.status_code in UNAVAILABLE:
            CALLS.labels("server_error").inc()
            raise RetryLater(f"reward server answered {resp.status_code}: {resp.text[:200]}", self.retry_backoff_s,
                             counts=resp.status_code not in UNAVAILABLE)
        if resp.status_code >= 400:
            CALLS.labels("refused").inc()
            raise Refused(resp.status_code, response_detail(resp), _named_items(resp))
        try:
            out = resp.json()
            scores, scorer = out["scores"], out["scorer"]
            source = RewardSource(out.get("reward_source", "rule"))
        except (ValueError, KeyError, TypeError) as e:  # the server's bug, not the group's
            CALLS.labels("malformed").inc()
            raise RetryLater(f"reward server answered 200 without scores: {type(e).__name__}: {e}; "
                             f"body {resp.text[:200]!r}", self.retry_backoff_s, counts=True) from None
        if len(scores) != len(items):
            CALLS.labels("malformed").inc()
            raise RetryLater(f"reward server returned {len(scores)} scores for {len(items)} items",
                             self.retry_backoff_s, counts=True)
        result: list[Scores | Rejected | RetryLater] = []
        k = 0
        try:
            for g in groups:
                n = len(g.samples)
                chunk = scores[k:k + n]
                k += n
                unscored = [c for c in chunk if c.get("reward") is None]
                failed = [c for c in unscored if c.get("kind") != DEADLINE]
                if failed:  # the scorer could not score this group (it said why): not retryable
                    why = [str(c["error"]) for c in failed]  # KeyError: no error, malformed
                    # out of the items it ran: those the deadline left are neither failed nor scored
                    ran = n - (len(unscored) - len(failed))
                    result.append(Rejected(item_reason(failed[0]), scorer_error_detail(g.prompt_id, len(failed), ran,
                                                                                        why[0])))
                    continue
                if unscored:  # the server's deadline came first: held, and sent again alone
                    result.append(RetryLater(f"reward server left {len(unscored)} of {n} items unscored at its "
                                             f"deadline: {unscored[0].get('error')}", self.retry_backoff_s, own=True))
                    continue
                rewards = [c["reward"] for c in chunk]
                if not all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in rewards):
                    raise TypeError(f"rewards must be numbers, got {rewards[:3]!r}")
                bad = [r for r in rewards if not math.isfinite(r)]  # JSON NaN/Infinity parse as floats
                if bad:  # a server before per-item kinds
                    result.append(Rejected(DLQReason.non_finite, scorer_error_detail(
                        g.prompt_id, len(bad), n, f"scorer {scorer} returned non-finite rewards {rewards[:8]!r}")))
                    continue
                result.append(Scores([float(r) for r in rewards], scorer, source,
                                     [dict(c.get("extra") or {}) for c in chunk]))
        except (AttributeError, KeyError, TypeError) as e:  # an item that is not {"reward": number, ...}
            CALLS.labels("malformed").inc()
            raise RetryLater(f"reward server answered malformed scores: {type(e).__name__}: {e}",
                             self.retry_backoff_s, counts=True) from None
        CALLS.labels("ok").inc()
        self._probe_item = items[-1]
        return result

"""The guarded reward client against a fake reward server on 127.0.0.1 that hangs, 500s or
slows down: breaker, probe, cached-score fallback, held groups."""

import contextlib

import pytest

from steadyrl.breaker import CircuitBreaker, State
from steadyrl.bus.stage import RetryLater
from steadyrl.services.reward.cache import ScoreCache
from steadyrl.services.reward.client import RewardClient
from steadyrl.wire.contracts import Prompt, RewardSource, RolloutGroup, Sample
from tests.helpers import FakeRewardServer


def group(i: int, question: str, answers: list[str], truth: str = "a") -> RolloutGroup:
    p = Prompt(prompt_id=f"e0-i{i}", epoch=0, index=i, n_samples=len(answers), data_source="tiny_copy",
               messages=[{"role": "user", "content": question}], ground_truth=truth)
    return RolloutGroup(prompt=p, samples=[Sample(text=a, token_ids=[1], logprobs=[-0.1]) for a in answers],
                        policy_version=0)


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


@pytest.fixture
def server():
    s = FakeRewardServer("tiny_copy")
    yield s
    s.stop()


def _client(server, clock, cache=True):
    breaker = CircuitBreaker("reward-server", failure_threshold=3, reset_timeout_s=30, clock=clock)
    return RewardClient(server.url, "tiny_copy", timeout_s=0.3, retry_backoff_s=0.01, breaker=breaker,
                        cache=ScoreCache(1000, 0.8) if cache else None, probe_interval_s=0)


SEEN = group(1, "copy the letter a, please, four times", ["aaaa", "abab", "bbbb"])


def test_hanging_server_opens_the_breaker_after_exactly_three_timeouts_then_cache_and_held(server):
    clock = Clock()
    c = _client(server, clock)
    healthy = c.score_many([SEEN])
    assert healthy[0].rewards == [1.0, 0.5, 0.0] and healthy[0].source is RewardSource.rule

    server.set("hang")
    again = group(2, "copy the letter a, please, four times!", ["aaaa", "zzzz"])  # near-duplicate prompt
    novel = group(3, "something else entirely: zzz qqq", ["aaaa"])
    for _ in range(2):  # failures 1 and 2: the batch is held, breaker still closed
        with pytest.raises(RetryLater, match="timed out after 0.3 s"):
            c.score_many([again, novel])
        assert c.breaker.state is State.closed
    calls = server.calls
    out = c.score_many([again, novel])  # failure 3: open, and this batch comes from the cache
    assert c.breaker.state is State.open and server.calls == calls + 1
    cached, held = out
    assert cached.source is RewardSource.cache and cached.scorer == "rule:tiny_copy@1"
    # a repeated response gets its own reward, any other the prompt's mean (1 + 0.5 + 0) / 3
    assert cached.rewards == [1.0, 0.5] and 0.8 <= cached.similarity < 1.0
    assert cached.extra == [{"cache_of": "e0-i1", "response_similarity": 1.0},
                            {"cache_of": "e0-i1", "response_similarity": 0.0}]
    assert isinstance(held, RetryLater) and "no cached prompt with this answer within similarity 0.8" in str(held)

    calls = server.calls
    c.score_many([again])  # open: no call goes out
    assert server.calls == calls

    server.set("ok")
    assert c.probe_once() and c.breaker.state is State.half_open
    back = c.score_many([novel])  # the trial call closes it
    assert back[0].source is RewardSource.rule and c.breaker.state is State.closed


def test_500s_open_it_too_and_a_failed_trial_reopens(server):
    clock = Clock()
    c = _client(server, clock, cache=False)
    server.set("error")
    for _ in range(2):
        with pytest.raises(RetryLater, match="answered 500"):
            c.score_many([SEEN])
    out = c.score_many([SEEN])
    assert c.breaker.state is State.open and isinstance(out[0], RetryLater)  # no cache: held
    assert not c.probe_once() and c.breaker.state is State.open  # /readyz 503
    clock.t += 30
    c.score_many([SEEN])  # the trial fails
    assert c.breaker.state is State.open
    server.set("ok")
    clock.t += 30
    assert c.score_many([SEEN])[0].rewards == [1.0, 0.5, 0.0] and c.breaker.state is State.closed


def test_a_slow_server_within_the_timeout_is_not_a_failure(server):
    c = _client(server, Clock())
    server.set("slow", delay_s=0.1)
    for _ in range(4):
        assert c.score_many([SEEN])[0].source is RewardSource.rule
    assert c.breaker.state is State.closed and c.breaker.failures == 0


def test_cache_keeps_the_last_n_prompts_and_needs_the_same_answer():
    cache = ScoreCache(capacity=2, floor=0.8)
    cache.add("p1", "prompt number one about cats", ["meow", "woof"], [1.0, 0.0], "rule:x@1", ("d", "meow"))
    cache.add("p2", "prompt number two about dogs", ["woof"], [1.0], "rule:x@1", ("d", "woof"))
    hit = cache.lookup("prompt number one about cats", ["woof", "meow!", "meow"], ("d", "meow"))
    assert hit.similarity == 1.0 and hit.source_prompt_id == "p1"
    assert hit.rewards == [0.0, 0.5, 1.0] and hit.response_similarity == [1.0, 0.0, 1.0]
    # the same text with another ground truth (a templated prompt whose number changed) lends nothing
    assert cache.lookup("prompt number one about cats", ["meow"], ("d", "purr")) is None
    cache.add("p3", "prompt number three about fish", ["blub"], [0.5], "rule:x@1", ("d", "blub"))  # evicts p1
    assert len(cache) == 2 and cache.lookup("prompt number one about cats", ["meow"], ("d", "meow")) is None
    assert cache.lookup("an unrelated question", ["woof"], ("d", "woof")) is None
    with pytest.raises(ValueError, match="floor in"):
        ScoreCache(10, 0.0)


@pytest.mark.parametrize("item", [{"reward": None}, "0.5", {"reward": "high"}, {"reward": [1]}])
def test_a_malformed_answer_is_a_failure_not_a_dlq_and_never_sticks_half_open(server, item):
    """Regression: a 200 whose items were not {"reward": number} raised KeyError/TypeError:
    the group went to the DLQ, and a trial call left the breaker half-open for good."""
    import json as _json

    c = _client(server, Clock(), cache=False)
    real = c.http.post

    def post(url, **kw):
        resp = real(url, **kw)
        body = resp.json()
        body["scores"] = [item] * len(body["scores"])
        import httpx
        return httpx.Response(200, content=_json.dumps(body).encode(), request=resp.request)

    c.http.post = post
    for _ in range(3):
        try:
            c.score_many([SEEN])
        except RetryLater as e:
            assert "malformed" in str(e)
    assert c.breaker.state is State.open
    c.http.post = real
    c.breaker.reset_timeout_s = 0
    assert c.score_many([SEEN])[0].rewards == [1.0, 0.5, 0.0] and c.breaker.state is State.closed


def test_the_probe_needs_a_scored_answer_not_just_readyz(server):
    """Regression: /readyz answering while the model hangs half-opened the breaker every
    probe, and each trial call then waited the full timeout."""
    c = _client(server, Clock())
    c.score_many([SEEN])
    server.set("error")
    for _ in range(3):
        with contextlib.suppress(RetryLater):
            c.score_many([SEEN])
    assert c.breaker.state is State.open
    server.readyz_ok = True  # the server says it is ready, but /score still fails
    assert not c.probe_once() and c.breaker.state is State.open
    server.set("ok")
    assert c.probe_once() and c.breaker.state is State.half_open

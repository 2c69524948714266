"""What each answer of the reward server makes of a batch (services/reward/client.py): a group
refused or unscorable goes to rl.dlq alone, a 4xx is not a breaker failure, a 5xx on one batch
while the server scores a known-good item is that batch's own (the stage's budget), a server
failing everything is down (held, no budget)."""

import json

import httpx
import pytest

from steadyrl.breaker import CircuitBreaker, State
from steadyrl.bus.stage import RetryLater
from steadyrl.services.reward.client import RewardClient
from steadyrl.wire.codec import Rejected
from steadyrl.wire.contracts import DLQReason, Prompt, RolloutGroup, Sample


def group(pid: str, answers: list[str]) -> RolloutGroup:
    p = Prompt(prompt_id=pid, epoch=0, index=0, n_samples=len(answers), data_source="tiny_copy",
               messages=[{"role": "user", "content": f"question {pid}"}], ground_truth="a")
    return RolloutGroup(prompt=p, samples=[Sample(text=a, token_ids=[1], logprobs=[-0.1]) for a in answers],
                        policy_version=0)


class Server:
    """A scripted /score: `answer(items)` -> (status, body) for each call; the default scores
    every item 1.0. Records the prompts of every call."""

    def __init__(self):
        self.calls: list[list[str]] = []
        self.answer = lambda items: (200, {"scorer": "rule:tiny_copy@1", "reward_source": "rule",
                                           "scores": [{"reward": 1.0, "extra": {}} for _ in items]})

    def __call__(self, request: httpx.Request) -> httpx.Response:
        items = json.loads(request.content)["items"]
        self.calls.append(sorted({it["prompt"].split()[-1] for it in items}))
        status, body = self.answer(items)
        return httpx.Response(status, content=json.dumps(body).encode(), request=request)


@pytest.fixture
def server():
    return Server()


def _client(server: Server) -> RewardClient:
    c = RewardClient("http://reward", "tiny_copy", timeout_s=1, retry_backoff_s=0.01,
                     breaker=CircuitBreaker("reward-server", 3, 30, clock=lambda: 0.0), probe_interval_s=0)
    c.http = httpx.Client(transport=httpx.MockTransport(server))
    return c


A, B, P = group("A", ["a", "b"]), group("B", ["a"]), group("P", ["a", "a", "a"])


def test_a_422_naming_items_refuses_their_group_and_scores_the_others_in_one_more_call(server):
    def answer(items):  # the reward server's 422 for non-finite scores names the items
        bad = [{"index": i, "error": "reward nan is not finite"} for i, it in enumerate(items)
               if it["prompt"].endswith("P")]
        if bad:
            return 422, {"detail": f"scorer 'x' returned {len(bad)} items that are not finite JSON", "items": bad}
        return 200, {"scorer": "rule:tiny_copy@1", "scores": [{"reward": 1.0} for _ in items]}

    server.answer = answer
    c = _client(server)
    a, p, b = c.score_many([A, P, B])
    assert isinstance(p, Rejected) and p.reason is DLQReason.non_finite
    assert p.detail.startswith("prompt P: reward nan is not finite (reward server refused the request (422)")
    assert a.rewards == [1.0, 1.0] and b.rewards == [1.0]
    assert server.calls == [["A", "B", "P"], ["A", "B"]]
    assert c.breaker.state is State.closed and c.breaker.failures == 0


def test_a_4xx_that_names_no_item_is_sent_again_group_by_group_and_never_opens_the_breaker(server):
    server.answer = lambda items: ((400, {"detail": "no such thing"}) if any(it["prompt"].endswith("P") for it in items)
                                   else (200, {"scorer": "s", "scores": [{"reward": 0.5} for _ in items]}))
    c = _client(server)
    for _ in range(5):
        a, p, b = c.score_many([A, P, B])
        assert isinstance(p, Rejected) and p.reason is DLQReason.handler_error
        assert p.detail == "prompt P: reward server refused the request (400): no such thing"
        assert a.rewards == [0.5, 0.5] and b.rewards == [0.5]
    assert server.calls[:4] == [["A", "B", "P"], ["A"], ["P"], ["B"]]
    assert c.breaker.state is State.closed and c.breaker.failures == 0


def test_an_unscorable_or_non_finite_item_in_a_200_refuses_only_its_group(server):
    def answer(items):
        scores = []
        for it in items:
            if it["prompt"].endswith("P"):
                scores.append({"reward": None, "error": "RuntimeError: scorer exploded"})
            elif it["prompt"].endswith("B"):
                scores.append({"reward": float("inf")})  # JSON Infinity: Python's json reads it
            else:
                scores.append({"reward": 1.0})
        return 200, {"scorer": "s", "scores": scores}

    server.answer = answer
    a, p, b = _client(server).score_many([A, P, B])
    assert a.rewards == [1.0, 1.0]
    assert isinstance(p, Rejected) and p.reason is DLQReason.scorer_error
    assert p.detail == "prompt P: 3 of 3 items unscored: RuntimeError: scorer exploded"
    assert isinstance(b, Rejected) and b.reason is DLQReason.non_finite and "non-finite rewards [inf]" in b.detail


def test_a_500_on_one_batch_while_a_known_good_item_scores_is_the_batchs_own(server):
    c = _client(server)
    c.score_many([A])  # the server scored A: its last item is the known-good one
    server.answer = lambda items: ((500, {"detail": "model failed"}) if any(it["prompt"].endswith("P") for it in items)
                                   else (200, {"scorer": "s", "scores": [{"reward": 1.0} for _ in items]}))
    for _ in range(5):  # never opens the breaker
        with pytest.raises(RetryLater, match="answered 500.*the server scores other items") as e:
            c.score_many([B, P])
        assert e.value.own and e.value.counts
    assert c.breaker.state is State.closed
    # the stage then tries each alone: B is scored, P keeps failing (own)
    assert c.score_many([B])[0].rewards == [1.0]
    with pytest.raises(RetryLater) as e:
        c.score_many([P])
    assert e.value.own


@pytest.mark.parametrize("status", [500, 503, 429])
def test_a_server_failing_everything_is_down_a_breaker_failure_and_no_budget(server, status):
    c = _client(server)
    c.score_many([A])
    server.answer = lambda items: (status, {"detail": "broken"})
    for _ in range(2):
        with pytest.raises(RetryLater, match=f"answered {status}") as e:
            c.score_many([B, P])
        assert not e.value.counts and not e.value.own
    held = c.score_many([B, P])  # the third failure opens it: held, no budget
    assert c.breaker.state is State.open
    assert all(isinstance(h, RetryLater) and not h.counts for h in held)

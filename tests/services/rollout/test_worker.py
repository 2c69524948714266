"""What each answer of the actor makes of a prompt (services/rollout/worker.py), against a
scripted actor: 503 held with the budget (Retry-After followed), 4xx to rl.dlq with the
actor's message (only the refused prompts of a request), unreachable held without limit."""

import json

import httpx

from steadyrl.bus.stage import Output, RetryLater
from steadyrl.services.rollout.worker import RolloutConfig, make_handler
from steadyrl.wire.codec import Rejected
from steadyrl.wire.contracts import DLQReason, Prompt


def prompt(i: int, min_version: int = 0) -> Prompt:
    return Prompt(prompt_id=f"p{i}", epoch=0, index=i, n_samples=2, ground_truth="1", max_new_tokens=4,
                  messages=[{"role": "user", "content": f"q{i}"}], data_source="tiny_copy",
                  min_policy_version=min_version)


def ok(body: dict) -> httpx.Response:
    n = len(body["prompts"])
    completion = {"text": "1", "token_ids": [5], "logprobs": [-0.5], "finish_reason": "stop"}
    return httpx.Response(200, json={"policy_version": 3, "prompt_ids": [[1, 2]] * n,
                                     "completions": [[completion] * body["n"]] * n})


def handler(answer):
    """The worker's batch handler over an actor whose answer to each /generate body is `answer(body)`."""
    calls: list[list[str]] = []

    def transport(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        calls.append([p["messages"][0]["content"] for p in body["prompts"]])
        return answer(body)

    cfg = RolloutConfig()
    return make_handler(cfg, httpx.Client(transport=httpx.MockTransport(transport))), calls


def test_503_behind_holds_with_the_budget_after_retry_after_while_other_requests_are_served():
    def answer(body):
        if body["min_policy_version"] == 9:
            return httpx.Response(503, json={"detail": "serving run '' version 3; waiting for version >= 9"},
                                  headers={"Retry-After": "2"})
        return ok(body)

    handle, calls = handler(answer)
    a, behind, b = handle([(prompt(0), None), (prompt(1, min_version=9), None), (prompt(2), None)])
    assert isinstance(a, list) and isinstance(a[0], Output) and a[0].value.policy_version == 3
    assert isinstance(b, list)
    assert isinstance(behind, RetryLater) and behind.counts and not behind.own and behind.backoff_s == 2.0
    assert str(behind) == "actor not ready: serving run '' version 3; waiting for version >= 9"
    assert calls == [["q0", "q2"], ["q1"]]  # one request per setting


def test_a_4xx_sends_only_the_refused_prompts_to_the_dlq_with_the_actors_message():
    def answer(body):
        contents = [p["messages"][0]["content"] for p in body["prompts"]]
        if "q1" in contents:
            return httpx.Response(422, json={"detail": "generation produced non-finite log-probs in 1 of 2 "
                                                       "completions (first: prompt 0 sample 1, nan)"})
        if "q2" in contents:
            return httpx.Response(409, json={"detail": "prompt of run 'r1', earlier than the served run 'r2'"})
        return ok(body)

    handle, calls = handler(answer)
    a, nan, old = handle([(prompt(0), None), (prompt(1), None), (prompt(2), None)])
    assert isinstance(a, list)
    assert isinstance(nan, Rejected) and nan.reason is DLQReason.non_finite
    assert nan.detail.startswith("actor refused the prompt (422): generation produced non-finite log-probs")
    assert isinstance(old, Rejected) and old.reason is DLQReason.handler_error
    assert old.detail == "actor refused the prompt (409): prompt of run 'r1', earlier than the served run 'r2'"
    assert calls == [["q0", "q1", "q2"], ["q0"], ["q1"], ["q2"]]


def test_an_unreachable_actor_holds_everything_without_budget_and_is_asked_once():
    def answer(body):
        raise httpx.ConnectError("connection refused")

    handle, calls = handler(answer)
    out = handle([(prompt(0), None), (prompt(1, min_version=1), None), (prompt(2, min_version=2), None)])
    assert all(isinstance(r, RetryLater) and not r.counts for r in out)
    assert str(out[0]).startswith("actor unreachable: ConnectError")
    assert len(calls) == 1  # the other settings' requests would wait for the same


def test_a_500_counts_and_a_bad_retry_after_is_ignored():
    handle, _ = handler(lambda body: httpx.Response(500, text="boom", headers={"Retry-After": "soon"}))
    [r] = handle([(prompt(0), None)])
    assert isinstance(r, RetryLater) and r.counts and r.backoff_s == RolloutConfig().rollout.retry_backoff_s
    assert str(r) == "actor answered 500: boom"


def test_each_group_carries_the_engine_the_actor_names():
    def answer_with(engine):
        def answer(body):
            resp = ok(body)
            return httpx.Response(200, json={**resp.json(), **({} if engine is None else {"engine": engine})})
        return answer

    for engine, want in (("vllm", "vllm"), ("torch", "torch"), (None, ""), (7, ""), ("x" * 65, "")):
        handle, _ = handler(answer_with(engine))
        a, b = handle([(prompt(0), None), (prompt(1), None)])
        assert [o[0].value.engine for o in (a, b)] == [want, want], engine

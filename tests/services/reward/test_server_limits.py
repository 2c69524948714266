"""The reward server's POST /score over real HTTP on 127.0.0.1 (the app run_service builds):
probes under a flood of slow calls, the body and concurrency limits, and 422 naming the items
when a scorer returns a reward that is not a finite number."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from steadyrl.contracts import RewardSource
from steadyrl.http import Health, HealthServer, make_app
from steadyrl.scorers import Scorer
from steadyrl.services.reward.server import RewardServer, RewardServerSection, add_routes
from tests.helpers import in_flight, probes_while_held

HERE = "tests.services.reward.test_server_limits"
GATE = threading.Event()


def odd_scorer(data_source, solution_str, ground_truth, extra_info=None):
    """A rule with every way to go wrong, chosen by the response."""
    if solution_str in ("nan", "The answer is nan"):
        return float("nan")
    if solution_str == "inf":
        return float("-inf")
    if solution_str == "nan extra":
        return {"score": 1.0, "confidence": float("nan")}
    if solution_str == "wait":
        GATE.wait(60)  # a bound, not a timing: every test that holds calls sets GATE
    return 1.0


class OtherTypes(Scorer):
    """A scorer (as a model scorer would be) returning rewards of other types than float."""

    id, source = "model:other-types@1", RewardSource.model

    def score(self, items):
        import numpy as np

        values = {"str": "high", "bool": True, "numpy": np.float32(0.5), "int": 2}
        return [{"reward": values[it.response], "extra": {}} for it in items]


def _serve(**section):
    server = RewardServer(RewardServerSection(scorers=[f"{HERE}:odd_scorer"], default_scorer=f"{HERE}:odd_scorer",
                                              **section))
    server.scorers["other"] = OtherTypes()
    health = Health()
    health.beat()
    health.add_check("scorers", server.ready)
    app = make_app("reward-server", health)
    add_routes(app, server)
    return server, HealthServer(app).start()


@pytest.fixture
def served():
    server, http = _serve(max_body_bytes=4096, max_concurrent=2)
    yield server, http.url
    GATE.set()
    http.stop()
    GATE.clear()


def _items(*responses):
    return [{"prompt": "p", "response": r, "ground_truth": "1"} for r in responses]


def test_non_finite_rewards_are_422_naming_each_item(served):
    _, url = served
    r = httpx.post(f"{url}/score", json={"items": _items("ok", "nan", "ok", "inf", "nan extra")})
    assert r.status_code == 422, r.text
    scorer = f"rule:{HERE}:odd_scorer@1"
    assert r.json() == {
        "detail": f"scorer {scorer!r} returned 3 of 5 items that are not finite JSON: item 1 (reward nan is not a "
                  "finite number), item 3 (reward -inf is not a finite number), item 4 (extra holds a non-finite "
                  "number (NaN or infinity))",
        "scorer": scorer,
        "items": [{"index": 1, "error": "reward nan is not a finite number"},
                  {"index": 3, "error": "reward -inf is not a finite number"},
                  {"index": 4, "error": "extra holds a non-finite number (NaN or infinity)"}]}
    r = httpx.post(f"{url}/score", json={"items": _items("ok", "ok")})  # and it serves on
    assert r.status_code == 200 and [s["reward"] for s in r.json()["scores"]] == [1.0, 1.0]


def test_non_numeric_rewards_are_422_and_numbers_of_other_types_become_floats(served):
    _, url = served
    r = httpx.post(f"{url}/score", json={"scorer": "other", "items": _items("numpy", "str", "bool", "int")})
    assert r.status_code == 422
    assert r.json()["items"] == [{"index": 1, "error": "reward 'high' is not a number"},
                                 {"index": 2, "error": "reward True is not a number"}]
    r = httpx.post(f"{url}/score", json={"scorer": "other", "items": _items("numpy", "int")})
    assert r.status_code == 200 and r.json()["scores"] == [{"reward": 0.5, "extra": {}}, {"reward": 2.0, "extra": {}}]


def test_the_reward_client_takes_the_422_as_a_refusal_not_a_retry(served):
    """The contract with services/reward/client.py: a 422 is the group's fault (rl.dlq), where a
    5xx would be retried. Either form the client has used passes: ValueError raised, or the
    group's rejection returned in its place."""
    from steadyrl.bus.stage import RetryLater
    from steadyrl.services.reward.client import RewardClient, Scores
    from tests.helpers import rollout_group

    _, url = served
    client = RewardClient(url, probe_interval_s=0)
    try:
        try:
            [answer] = client.score_many([rollout_group(0, answer="nan")])
        except ValueError as e:
            answer = e
    finally:
        client.close()
    assert not isinstance(answer, (Scores, RetryLater)), answer
    assert "(422)" in str(answer) and "item 0 (reward nan is not a finite number)" in str(answer), answer


def test_an_oversize_body_is_413(served):
    _, url = served
    r = httpx.post(f"{url}/score", json={"items": _items("x" * 5000)})
    assert r.status_code == 413 and r.json()["detail"] == "body above max_body_bytes 4096"
    assert httpx.post(f"{url}/score", json={"items": _items("ok")}).status_code == 200


def test_past_max_concurrent_is_503_with_retry_after(served):
    _, url = served
    with ThreadPoolExecutor(2) as pool:
        held = [pool.submit(httpx.post, f"{url}/score", json={"items": _items("wait")}, timeout=15) for _ in range(2)]
        deadline = time.monotonic() + 5
        while in_flight("/score") != 2:
            assert time.monotonic() < deadline, "calls never got their slots"
            time.sleep(0.01)
        r = httpx.post(f"{url}/score", json={"items": _items("ok")})
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and "max_concurrent 2" in r.json()["detail"]
        assert httpx.get(f"{url}/readyz").status_code == 200
        GATE.set()
        assert [c.result().status_code for c in held] == [200, 200]


def test_probes_answer_under_sixty_score_calls_in_progress():
    """60 /score calls held in the scorer (GATE) until the probes have answered: bound by calls,
    not timing (the scorer's GATE.wait(60) bounds the hold)."""
    _, http = _serve(max_concurrent=64)
    flood = httpx.Client(limits=httpx.Limits(max_connections=100), timeout=90)
    try:
        with ThreadPoolExecutor(60) as pool:
            calls = [pool.submit(flood.post, f"{http.url}/score", json={"items": _items("wait")}) for _ in range(60)]
            try:
                lat = probes_while_held(http.url, lambda: in_flight("/score") == 60
                                        and not any(c.done() for c in calls), wait_s=30)
            finally:
                GATE.set()
            assert [c.result().status_code for c in calls] == [200] * 60
    finally:
        GATE.set()
        flood.close()
        http.stop()
        GATE.clear()
    print("60 held /score calls: " + ", ".join(  # noqa: T201  the figure, with -s
        f"{p} n={len(s)} max {max(s) * 1000:.1f} ms" for p, s in lat.items()))

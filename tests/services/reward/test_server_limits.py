"""The reward server's POST /score over real HTTP on 127.0.0.1 (the app run_service builds):
probes under a flood of slow calls, the body and concurrency limits, and the item's own error
(kind non_finite or scorer_error) when a scorer returns a reward that is not a finite number.
Calls are held in a scorer of this process (`Gated`, as a model scorer runs): the rule
scorers run in worker processes (steadyrl.model.scorepool; tests/services/reward/test_scorer_faults.py)."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from steadyrl.http import Health, HealthServer, make_app
from steadyrl.model.scorers import Scorer
from steadyrl.services.reward.server import RewardServer, RewardServerSection, add_routes
from steadyrl.wire.contracts import RewardSource
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
    return 1.0


class Gated(Scorer):
    """Scores 1.0, holding a "wait" item until GATE is set (in this process, as a model scorer)."""

    id, source = "model:gated@1", RewardSource.model

    def score(self, items, deadline=None):
        for it in items:
            if it.response == "wait":
                GATE.wait(60)  # a bound, not a timing: every test that holds calls sets GATE
        return [{"reward": 1.0, "extra": {}} for _ in items]


class OtherTypes(Scorer):
    """A scorer (as a model scorer would be) returning rewards of other types than float."""

    id, source = "model:other-types@1", RewardSource.model

    def score(self, items, deadline=None):
        import numpy as np

        values = {"str": "high", "bool": True, "numpy": np.float32(0.5), "int": 2}
        return [{"reward": values[it.response], "extra": {}} for it in items]


def _serve(**section):
    server = RewardServer(RewardServerSection(scorers=[f"{HERE}:odd_scorer"], default_scorer=f"{HERE}:odd_scorer",
                                              **section))
    server.scorers["other"] = OtherTypes()
    server.scorers["gated"] = Gated()
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
    server.close()
    GATE.clear()


def _items(*responses):
    return [{"prompt": "p", "response": r, "ground_truth": "1"} for r in responses]


def test_non_finite_rewards_are_each_items_error_and_the_others_are_scored(served):
    """Issue 46: a NaN used to make the whole call 422; now that item alone is refused."""
    _, url = served
    r = httpx.post(f"{url}/score", json={"items": _items("ok", "nan", "ok", "inf", "nan extra")})
    assert r.status_code == 200, r.text
    spec = f"{HERE}:odd_scorer"
    assert r.json()["scores"] == [
        {"reward": 1.0, "extra": {}},
        {"reward": None, "error": f"scorer {spec} returned nan, not a finite number", "kind": "non_finite"},
        {"reward": 1.0, "extra": {}},
        {"reward": None, "error": f"scorer {spec} returned -inf, not a finite number", "kind": "non_finite"},
        {"reward": None, "error": f"scorer {spec} returned extras holding NaN or infinity: {{'confidence': nan}}",
         "kind": "non_finite"}]


def test_non_numeric_rewards_are_refused_per_item_and_numbers_of_other_types_become_floats(served):
    _, url = served
    r = httpx.post(f"{url}/score", json={"scorer": "other", "items": _items("numpy", "str", "bool", "int")})
    assert r.status_code == 200
    assert r.json()["scores"] == [
        {"reward": 0.5, "extra": {}},
        {"reward": None, "error": "scorer model:other-types@1 returned 'high', not a number", "kind": "scorer_error"},
        {"reward": None, "error": "scorer model:other-types@1 returned True, not a number", "kind": "scorer_error"},
        {"reward": 2.0, "extra": {}}]


def test_the_reward_client_sends_a_non_finite_group_to_the_dlq_not_a_retry(served):
    """The contract with services/reward/client.py: an item's kind is its group's rl.dlq reason."""
    from steadyrl.services.reward.client import RewardClient
    from steadyrl.wire.codec import Rejected
    from steadyrl.wire.contracts import DLQReason
    from tests.helpers import rollout_group

    _, url = served
    client = RewardClient(url, probe_interval_s=0)
    try:
        [answer] = client.score_many([rollout_group(0, answer="nan")])
    finally:
        client.close()
    assert isinstance(answer, Rejected) and answer.reason is DLQReason.non_finite, answer
    assert answer.detail == (f"prompt e0-i0: 1 of 1 items unscored: scorer {HERE}:odd_scorer returned nan, not a "
                             "finite number")


def test_an_oversize_body_is_413(served):
    _, url = served
    r = httpx.post(f"{url}/score", json={"items": _items("x" * 5000)})
    assert r.status_code == 413 and r.json()["detail"] == "body above max_body_bytes 4096"
    assert httpx.post(f"{url}/score", json={"items": _items("ok")}).status_code == 200


def test_past_max_concurrent_is_503_with_retry_after(served):
    _, url = served
    with ThreadPoolExecutor(2) as pool:
        held = [pool.submit(httpx.post, f"{url}/score", json={"scorer": "gated", "items": _items("wait")}, timeout=15)
                for _ in range(2)]
        deadline = time.monotonic() + 5
        while in_flight("/score") != 2:
            assert time.monotonic() < deadline, "calls never got their slots"
            time.sleep(0.01)
        r = httpx.post(f"{url}/score", json={"items": _items("ok")})
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and "max_concurrent 2" in r.json()["detail"]
        ready = httpx.get(f"{url}/readyz")   # no slot free: not ready (issue 46), and says why
        assert ready.status_code == 503 and "/score: 2 of 2 calls in progress" in ready.json()["checks"]["scorers"][
            "detail"], ready.text
        GATE.set()
        assert [c.result().status_code for c in held] == [200, 200]
    assert httpx.get(f"{url}/readyz").status_code == 200   # the slots are back


def test_probes_answer_under_sixty_score_calls_in_progress():
    """60 /score calls held in the scorer (GATE) until the probes have answered: bound by calls,
    not timing (the scorer's GATE.wait(60) bounds the hold)."""
    server, http = _serve(max_concurrent=64)
    flood = httpx.Client(limits=httpx.Limits(max_connections=100), timeout=90)
    try:
        with ThreadPoolExecutor(60) as pool:
            calls = [pool.submit(flood.post, f"{http.url}/score", json={"scorer": "gated", "items": _items("wait")})
                     for _ in range(60)]
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
        server.close()
        GATE.clear()
    print("60 held /score calls: " + ", ".join(  # noqa: T201  the figure, with -s
        f"{p} n={len(s)} max {max(s) * 1000:.1f} ms" for p, s in lat.items()))

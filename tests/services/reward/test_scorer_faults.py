"""A user's reward that hangs, exits, crashes, allocates without bound or returns what is not a
reward, on a reward server over real HTTP on 127.0.0.1 (issue 46). Each fault costs its item
only, with its kind; the good items of the same request are scored; the server answers within
its call deadline and keeps answering; no slot leaks."""

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from steadyrl.http import Health, HealthServer, make_app
from steadyrl.services.reward.client import RewardClient, Scores
from steadyrl.services.reward.server import RewardServer, RewardServerSection, add_routes
from steadyrl.wire.codec import Rejected
from steadyrl.wire.contracts import DLQReason
from tests.helpers import rollout_group

REWARD = '''
import os, sys, time
import numpy as np

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    s = solution_str.removeprefix("The answer is ")
    if s == "hang":
        while True:
            time.sleep(1)
    if s == "exit":
        os._exit(3)
    if s == "sysexit":
        sys.exit("bye")
    if s == "alloc":
        hoard = []
        while True:
            hoard.append(bytearray(16 * 2**20))
    if s == "slow":
        time.sleep(0.5)
        return 1.0
    if s == "nan":
        return float("nan")
    if s == "numpy":
        return {"score": np.float64(0.25), "hits": np.int64(3), "ok": np.bool_(True), "v": np.arange(2)}
    if s == "str":
        return "0.7"
    if s == "bool":
        return True
    if s == "set":
        return {"score": 1.0, "seen": {1, 2}}
    return 1.0
'''

#: response -> the kind of its error (None: scored)
EXPECT = {"ok": None, "hang": "scorer_timeout", "exit": "scorer_crash", "sysexit": "scorer_error",
          "alloc": "scorer_error", "nan": "non_finite", "numpy": None, "str": "scorer_error",
          "bool": "scorer_error", "set": "scorer_error"}


@pytest.fixture
def served(tmp_path, monkeypatch):
    (tmp_path / "faulty.py").write_text(REWARD)
    monkeypatch.chdir(tmp_path)   # the spec is relative, as `up --reward faulty.py:compute_score` gives it
    spec = "faulty.py:compute_score"
    server = RewardServer(RewardServerSection(scorers=[spec], default_scorer=spec, processes=2, item_timeout_s=1.0,
                                              call_deadline_s=6.0, memory_limit_mb=512, max_concurrent=2))
    health = Health()
    health.beat()
    health.add_check("scorers", server.ready)
    app = make_app("reward-server", health)
    add_routes(app, server)
    http = HealthServer(app).start()
    yield server, http.url
    http.stop()
    server.close()


def _items(*responses):
    # a ground truth each: each its own group, as a reward worker's batch has several
    return [{"prompt": "p", "response": r, "ground_truth": str(i)} for i, r in enumerate(responses)]


def test_every_fault_is_its_items_error_and_the_good_items_are_scored(served):
    server, url = served
    responses = list(EXPECT)
    t0 = time.monotonic()
    r = httpx.post(f"{url}/score", json={"items": _items(*responses)}, timeout=30)
    took = time.monotonic() - t0
    assert r.status_code == 200, r.text
    scores = r.json()["scores"]
    for resp, got in zip(responses, scores, strict=True):
        kind = EXPECT[resp]
        if kind is None:
            assert got["reward"] is not None and "error" not in got, (resp, got)
        else:
            assert got["reward"] is None and got["kind"] == kind, (resp, got)
            assert "faulty.py:compute_score" in got["error"], (resp, got)   # names the scorer
    by = dict(zip(responses, scores, strict=True))
    assert by["ok"] == {"reward": 1.0, "extra": {}}
    assert by["numpy"] == {"reward": 0.25, "extra": {"hits": 3, "ok": True, "v": [0, 1]}}
    assert "exited with code 3" in by["exit"]["error"]
    assert "MemoryError" in by["alloc"]["error"] and "memory_limit_mb 512" in by["alloc"]["error"]
    assert "'0.7' (str), not a number" in by["str"]["error"] and "True (bool)" in by["bool"]["error"]
    assert took < 6.0 + 1.0, took   # within call_deadline_s
    assert server.pool is not None and server.pool.restarts == {"scorer_timeout": 1, "scorer_crash": 1}
    # and it serves on, with the processes replaced
    r = httpx.post(f"{url}/score", json={"items": _items("ok", "numpy")})
    assert r.status_code == 200 and [s["reward"] for s in r.json()["scores"]] == [1.0, 0.25]


def test_a_call_is_answered_by_its_deadline_and_hanging_calls_never_hold_a_slot(served):
    """More hanging calls than max_concurrent (2), two at a time: each is answered (scorer_timeout)
    by call_deadline_s and gives its slot back; /score and /readyz answer after them."""
    _, url = served
    t0 = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        # 3 calls, 2 at a time, of 2 hanging items each, on 2 processes at 1 s an item
        calls = [pool.submit(httpx.post, f"{url}/score", timeout=30,
                             json={"items": _items("ok", "ok", "hang", "hang")}) for _ in range(3)]
        answers = [c.result() for c in calls]
    took = time.monotonic() - t0
    for a in answers:
        assert a.status_code == 200, a.text
        kinds = [s.get("kind") for s in a.json()["scores"]]
        assert kinds == [None, None, "scorer_timeout", "scorer_timeout"], kinds
    assert took < 2 * 6.0, took
    assert httpx.get(f"{url}/readyz").status_code == 200
    r = httpx.post(f"{url}/score", json={"items": _items("ok")})
    assert r.status_code == 200 and r.json()["scores"] == [{"reward": 1.0, "extra": {}}]


def test_the_reward_client_sends_each_failed_group_to_the_dlq_with_its_kind(served):
    _, url = served
    client = RewardClient(url, probe_interval_s=0)
    try:
        out = client.score_many([rollout_group(0, answer="ok", truth="0"), rollout_group(1, answer="exit", truth="1"),
                                 rollout_group(2, answer="hang", truth="2"), rollout_group(3, answer="nan", truth="3"),
                                 rollout_group(4, answer="str", truth="4")])
    finally:
        client.close()
    assert isinstance(out[0], Scores) and out[0].rewards == [1.0]
    reasons = [o.reason if isinstance(o, Rejected) else o for o in out[1:]]
    assert reasons == [DLQReason.scorer_crash, DLQReason.scorer_timeout, DLQReason.non_finite,
                       DLQReason.scorer_error], out
    assert all(o.detail.startswith(f"prompt e0-i{i + 1}: 1 of 1 items unscored: scorer faulty.py:compute_score")
               for i, o in enumerate(out[1:])), out


def test_groups_a_slow_reward_leaves_at_the_deadline_are_held_not_refused(served):
    """Regression (review of issue 46): a correct but slow reward had the call's deadline cut
    every group short, and each went to rl.dlq as scorer_timeout: the run neither trained nor
    stopped. Now whole groups come first and the rest are held (RetryLater), sent again alone."""
    from steadyrl.bus.stage import RetryLater

    _, url = served
    client = RewardClient(url, probe_interval_s=0)
    try:   # 2 processes, 0.5 s an item, a 6 s deadline: about 24 of the 28 are scored
        out = client.score_many([rollout_group(i, answer="slow", truth=str(i)) for i in range(28)])
    finally:
        client.close()
    scored = [o for o in out if isinstance(o, Scores)]
    held = [o for o in out if isinstance(o, RetryLater)]
    assert len(scored) + len(held) == 28 and 20 <= len(scored) < 28, out
    assert all(o.own for o in held) and out[:len(scored)] == scored   # the first groups done whole

"""The reward server and the alert bridge with http_token_file: real processes on 127.0.0.1.
(The actor and a rollout worker: tests/integration/test_rollout.py.)"""

import subprocess
import sys

import httpx
import pytest

from steadyrl.breaker import CircuitBreaker
from steadyrl.bus.stage import RetryLater
from steadyrl.services.reward.client import RewardClient
from tests.helpers import ServiceProc
from tests.services.reward.test_client import SEEN


@pytest.fixture
def token(tmp_path):
    path = tmp_path / "token"
    path.write_text("t0ken-for-tests\n")
    return path


def test_the_reward_server_scores_only_for_the_token_and_a_refusal_is_retried_not_dead_lettered(tmp_path, token):
    svc = ServiceProc("reward.server", ["--http-token-file", str(token)], tmp_path / "server.log")
    try:
        svc.wait_ready()
        assert httpx.get(f"{svc.url}/metrics").status_code == 200   # Prometheus scrapes without one
        breaker = CircuitBreaker("reward-server", failure_threshold=3, reset_timeout_s=30)
        anonymous = RewardClient(svc.url, "tiny_copy", retry_backoff_s=0.01, breaker=breaker, probe_interval_s=0)
        with pytest.raises(RetryLater, match="credentials"):   # the batch is held: not the groups' fault
            anonymous.score_many([SEEN])
        assert breaker.failures == 1   # and counted: a misconfigured worker opens its breaker
        good = RewardClient(svc.url, "tiny_copy", probe_interval_s=0,
                            headers={"Authorization": "Bearer t0ken-for-tests"})
        assert good.score_many([SEEN])[0].rewards == [1.0, 0.5, 0.0]
    finally:
        assert svc.stop() == 0


def test_the_alert_bridge_takes_its_own_token_only_and_refuses_the_work_token_at_start(tmp_path, token):
    """The alert routes have a token of their own (alertbridge.token_file, `alert-token`): the
    bridge never holds the work token that opens /generate and /score, and a deployment that
    still hands it http_token_file stops at start naming what changed (issue 34)."""
    alert = tmp_path / "alert-token"
    alert.write_text("alert-t0ken-for-tests\n")
    robot = ["--alertbridge.dingtalk-url", "http://127.0.0.1:9/robot/send?access_token=x"]
    svc = ServiceProc("alertbridge", ["--alertbridge.token-file", str(alert), *robot], tmp_path / "bridge.log")
    try:
        svc.wait_ready()
        r = httpx.post(f"{svc.url}/alert/dingtalk", json={"version": "4"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert "alertbridge.token_file" in r.json()["detail"]
        r = httpx.post(f"{svc.url}/alert/dingtalk", json={"version": "4"},
                       headers={"Authorization": "Bearer t0ken-for-tests"})   # the work token opens nothing here
        assert r.status_code == 401
        r = httpx.post(f"{svc.url}/alert/dingtalk", json={"version": "4"},
                       headers={"Authorization": "Bearer alert-t0ken-for-tests"})
        assert r.status_code == 422, r.text   # past the token: the body is checked (not a full webhook)
    finally:
        assert svc.stop() == 0
    old = subprocess.run([sys.executable, "-m", "steadyrl.services.alertbridge",
                          "--http-token-file", str(token), *robot],
                         capture_output=True, text=True, timeout=120)
    assert old.returncode == 2 and "listening" not in old.stdout, old.stdout
    assert "http_token_file" in old.stderr and "no longer takes the stack's work token" in old.stderr, old.stderr
    assert "alertbridge.token_file" in old.stderr and "t0ken-for-tests" not in old.stderr


def test_the_reward_server_refuses_the_alert_token(tmp_path, token):
    alert = tmp_path / "alert-token"
    alert.write_text("alert-t0ken-for-tests\n")
    svc = ServiceProc("reward.server", ["--http-token-file", str(token)], tmp_path / "server.log")
    try:
        svc.wait_ready()
        r = httpx.post(f"{svc.url}/score", json={}, headers={"Authorization": "Bearer alert-t0ken-for-tests"})
        assert r.status_code == 401 and "http_token_file" in r.json()["detail"]
    finally:
        assert svc.stop() == 0

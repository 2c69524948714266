"""The reward server and the alert bridge with http_token_file: real processes on 127.0.0.1.
(The actor and a rollout worker: tests/integration/test_rollout.py.)"""

import httpx
import pytest

from services.reward.client import RewardClient
from steadyrl.breaker import CircuitBreaker
from steadyrl.bus.stage import RetryLater
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


def test_the_alert_bridge_refuses_webhooks_without_the_token(tmp_path, token):
    svc = ServiceProc("alertbridge", ["--http-token-file", str(token),
                                      "--alertbridge.dingtalk-url", "http://127.0.0.1:9/robot/send?access_token=x"],
                      tmp_path / "bridge.log")
    try:
        svc.wait_ready()
        r = httpx.post(f"{svc.url}/alert/dingtalk", json={"version": "4"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        r = httpx.post(f"{svc.url}/alert/dingtalk", json={"version": "4"},
                       headers={"Authorization": "Bearer t0ken-for-tests"})
        assert r.status_code == 422, r.text   # past the token: the body is checked (not a full webhook)
    finally:
        assert svc.stop() == 0

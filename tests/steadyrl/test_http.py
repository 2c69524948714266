import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter

from steadyrl.http import Health, HealthServer, make_app


@pytest.fixture
def served():
    health = Health(liveness_timeout_s=0.5)
    reg = CollectorRegistry()
    Counter("steadyrl_test_events", "events", registry=reg).inc(3)
    server = HealthServer(make_app("test", health, reg)).start()
    yield health, server
    server.stop()


def test_readyz_is_503_until_every_check_passes(served):
    health, server = served
    r = httpx.get(f"{server.url}/readyz")
    assert r.status_code == 503 and r.json() == {"ready": False, "checks": {}}
    state = {"ok": False}
    health.add_check("model", lambda: (state["ok"], "loaded" if state["ok"] else "loading"))
    health.add_check("broker", lambda: (True, "1 broker up"))
    r = httpx.get(f"{server.url}/readyz")
    assert r.status_code == 503
    assert r.json()["checks"]["model"] == {"ok": False, "detail": "loading"}
    state["ok"] = True
    r = httpx.get(f"{server.url}/readyz")
    assert r.status_code == 200 and r.json()["ready"] is True


def test_a_raising_check_is_a_failed_check(served):
    health, server = served

    def broken():
        raise RuntimeError("nope")

    health.add_check("broken", broken)
    r = httpx.get(f"{server.url}/readyz")
    assert r.status_code == 503
    assert "RuntimeError: nope" in r.json()["checks"]["broken"]["detail"]


def test_livez_follows_the_heartbeat(served):
    import time

    health, server = served
    health.beat()
    assert httpx.get(f"{server.url}/livez").status_code == 200
    time.sleep(0.7)
    assert httpx.get(f"{server.url}/livez").status_code == 503
    health.beat()
    assert httpx.get(f"{server.url}/livez").status_code == 200


def test_metrics_on_the_exact_path_without_redirect(served):
    _, server = served
    r = httpx.get(f"{server.url}/metrics", follow_redirects=False)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "steadyrl_test_events_total 3.0" in r.text


def test_binds_loopback_by_default(served):
    _, server = served
    assert server.host == "127.0.0.1"


def test_connections_are_accepted_with_tcp_nodelay():
    """Regression: keep-alive requests took ~44 ms each (response body held by Nagle until
    the client's delayed ACK); accepted sockets inherit TCP_NODELAY from the listener."""
    import socket

    from steadyrl.http import Health, HealthServer, make_app

    server = HealthServer(make_app("t", Health()), "127.0.0.1", 0)
    try:
        assert server._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    finally:
        server._sock.close()

import time

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter
from pydantic import BaseModel, Field

from steadyrl.http import Health, HealthServer, HTTPError, add_work_route, make_app
from tests.helpers import in_flight, probes_while_held


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


# ------------------------------------------------ heavy routes: limits, and probes that never starve

class Body(BaseModel):
    n: int = Field(1, ge=1)
    sleep_s: float = 0.0
    answer: str = "ok"


def _handler(req: Body):
    import time

    time.sleep(req.sleep_s)
    if req.answer == "nan":
        return {"value": float("nan")}
    if req.answer == "refuse":
        raise HTTPError(422, "refused", {"items": [{"index": 0}]})
    if req.answer == "bug":
        raise RuntimeError("handler bug")
    return {"n": req.n}


def _work_server(handler=_handler, **limits):
    health = Health()
    health.add_check("ok", lambda: (True, "fine"))
    app = make_app("test", health, CollectorRegistry())
    add_work_route(app, "/work", Body, handler, **{"max_concurrent": 4, "max_body_bytes": 4096,
                                                   "body_timeout_s": 5.0, **limits})
    return health, HealthServer(app).start()


def test_sixty_slow_calls_in_flight_do_not_starve_the_probes():
    """Regression: every sync route shared anyio's 40 threads, so 40 slow /work calls held them
    all and /livez waited behind them (an orchestrator restarted a healthy actor). The 60 calls
    are held inside the handler until the probes have answered: bound by calls, not timing (a
    1.0 s latency bound failed once in CI at 1.1 s on a busy machine)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    gate, entered, lock = threading.Event(), [0], threading.Lock()

    def held_handler(req: Body):
        with lock:
            entered[0] += 1
        gate.wait(60)
        return {"n": req.n}

    _, server = _work_server(handler=held_handler, max_concurrent=64)
    flood = httpx.Client(limits=httpx.Limits(max_connections=100), timeout=90)  # one client: see the actor's test
    try:
        with ThreadPoolExecutor(60) as pool:
            calls = [pool.submit(flood.post, f"{server.url}/work", json={"n": i + 1}) for i in range(60)]
            try:
                lat = probes_while_held(server.url, lambda: entered[0] == 60 and not any(c.done() for c in calls))
            finally:
                gate.set()
            assert [c.result().json() for c in calls] == [{"n": i + 1} for i in range(60)]
        print("probes under 60 held calls: " + ", ".join(  # noqa: T201  the figure, with -s
            f"{p} n={len(s)} max {max(s) * 1000:.1f} ms" for p, s in lat.items()))
    finally:
        gate.set()
        flood.close()
        server.stop()


def test_past_max_concurrent_is_503_with_retry_after():
    import threading

    gate = threading.Event()
    _, server = _work_server(handler=lambda req: gate.wait(10) and {"n": req.n}, max_concurrent=2)
    try:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as pool:
            held = [pool.submit(httpx.post, f"{server.url}/work", json={"n": i + 1}, timeout=15) for i in range(2)]
            deadline = __import__("time").monotonic() + 5
            while in_flight("/work") < 2:
                assert __import__("time").monotonic() < deadline, "calls never got their slots"
            r = httpx.post(f"{server.url}/work", json={"n": 3}, timeout=5)
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert "max_concurrent 2" in r.json()["detail"]
            assert httpx.get(f"{server.url}/livez").status_code == 200
            gate.set()
            assert [c.result().json() for c in held] == [{"n": 1}, {"n": 2}]
        assert httpx.post(f"{server.url}/work", json={"n": 4}, timeout=5).json() == {"n": 4}  # slots came back
    finally:
        server.stop()


def test_a_body_over_max_body_bytes_is_413_declared_or_streamed():
    _, server = _work_server(max_body_bytes=1024)
    try:
        big = b'{"n": 1, "answer": "' + b"x" * 2000 + b'"}'
        r = httpx.post(f"{server.url}/work", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["detail"] == "body above max_body_bytes 1024"
        assert r.headers["connection"] == "close"

        def chunks():  # no Content-Length: counted as it arrives
            yield big[:1000]
            yield big[1000:]

        r = httpx.post(f"{server.url}/work", content=chunks())
        assert r.status_code == 413, r.text
        assert httpx.post(f"{server.url}/work", json={"n": 2}).json() == {"n": 2}
        assert in_flight("/work") == 0
    finally:
        server.stop()


def _raw(port: int, data: bytes, wait_s: float) -> bytes:
    """Send `data` on a fresh connection, then read until the server closes it (or wait_s)."""
    import socket
    import time

    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(0.2)
    s.sendall(data)
    got, deadline = b"", time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            continue
        if not chunk:
            break
        got += chunk
    else:
        got += b"<still open>"
    s.close()
    return got


def test_a_body_slower_than_body_timeout_is_408_and_closed():
    _, server = _work_server(body_timeout_s=0.5)
    try:
        head = b"POST /work HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n"
        got = _raw(server.port, head + b'{"n": 1', wait_s=3)
        assert got.startswith(b"HTTP/1.1 408 ") and b"body_timeout_s 0.5 s" in got and not got.endswith(b"open>")
        assert in_flight("/work") == 0
    finally:
        server.stop()


def test_a_request_head_must_arrive_within_head_timeout(monkeypatch):
    from steadyrl import http

    monkeypatch.setattr(http, "HEAD_TIMEOUT_S", 0.3)
    _, server = _work_server()
    try:
        assert _raw(server.port, b"GET /livez HTTP/1.1\r\nhost: x\r\n", wait_s=3) == b""  # closed, no answer
        assert _raw(server.port, b"", wait_s=3) == b""  # nothing sent at all
        # a request whose answer takes longer than the head timeout is answered
        r = httpx.post(f"{server.url}/work", json={"n": 5, "sleep_s": 0.8}, timeout=5)
        assert r.json() == {"n": 5}
        with httpx.Client() as client:  # and a kept-alive connection serves a second request
            assert client.get(f"{server.url}/livez").status_code == 200
            assert client.post(f"{server.url}/work", json={"n": 6, "sleep_s": 0.5}).json() == {"n": 6}
    finally:
        server.stop()


def test_an_unfinished_request_head_over_max_head_bytes_is_400_and_closed():
    """h11 buffers at most MAX_HEAD_BYTES of a head it has not seen the end of (a head that
    arrives whole in one read is parsed whatever its size)."""
    _, server = _work_server()
    try:
        got = _raw(server.port, b"GET /livez HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 10_000, wait_s=3)
        assert got.startswith(b"HTTP/1.1 400 ") and not got.endswith(b"open>"), got[:200]
        got = _raw(server.port, b"GET /livez HTTP/1.1\r\nhost: x\r\nx-ok: " + b"a" * 4000, wait_s=0.5)
        assert got == b"<still open>"  # under the limit: still waiting for the rest
    finally:
        server.stop()


def test_work_route_answers():
    _, server = _work_server()
    try:
        url = f"{server.url}/work"
        r = httpx.post(url, json={"n": 0})
        assert r.status_code == 422
        assert r.json()["detail"] == [{"type": "greater_than_equal", "loc": ["body", "n"],
                                       "msg": "Input should be greater than or equal to 1"}]
        r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 422 and r.json()["detail"][0]["type"] == "json_invalid"
        r = httpx.post(url, json={"answer": "nan"})
        assert r.status_code == 422 and "cannot be sent as finite JSON" in r.json()["detail"], r.text
        r = httpx.post(url, json={"answer": "refuse"})
        assert r.status_code == 422 and r.json() == {"detail": "refused", "items": [{"index": 0}]}
        r = httpx.post(url, json={"answer": "bug"})
        assert r.status_code == 500 and r.json()["detail"] == "/work failed: RuntimeError: handler bug"
        assert httpx.get(url).status_code == 405
        assert in_flight("/work") == 0
    finally:
        server.stop()


def test_readyz_answers_503_when_a_check_hangs_and_livez_is_unaffected(monkeypatch):
    import threading
    import time

    from steadyrl import http

    monkeypatch.setattr(http, "PROBE_TIMEOUT_S", 0.3)
    health, server = _work_server()
    release = threading.Event()
    health.add_check("stuck", lambda: (release.wait(5), "stuck"))
    try:
        t0 = time.perf_counter()
        r = httpx.get(f"{server.url}/readyz")
        assert r.status_code == 503 and "did not answer within 0.3 s" in r.json()["detail"]
        assert time.perf_counter() - t0 < 2
        assert httpx.get(f"{server.url}/livez").status_code == 200
    finally:
        release.set()
        server.stop()


def test_with_a_token_work_routes_need_it_and_probes_do_not():
    from steadyrl.http import REFUSED

    _, server = _work_server(token="s3cret-token")
    try:
        url = f"{server.url}/work"
        before = REFUSED.labels("/work", "unauthorized")._value.get()
        r = httpx.post(url, json={"n": 1})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert "no bearer token" in r.json()["detail"]
        r = httpx.post(url, json={"n": 1}, headers={"Authorization": "Bearer s3cret-tokeN"})
        assert r.status_code == 401 and "wrong bearer token" in r.json()["detail"]
        r = httpx.post(url, json={"n": 1}, headers={"Authorization": "Basic s3cret-token"})
        assert r.status_code == 401
        r = httpx.post(url, json={"n": 1}, headers={"Authorization": "Bearer s3cret-token"})
        assert r.status_code == 200, r.text
        assert REFUSED.labels("/work", "unauthorized")._value.get() == before + 3
        for probe in ("/livez", "/readyz", "/metrics"):   # Prometheus and the orchestrator need no token
            assert httpx.get(f"{server.url}{probe}").status_code == 200, probe
    finally:
        server.stop()


def test_a_call_past_answer_within_s_is_answered_504_and_frees_its_slot_at_once():
    """Issue 46: a slot is freed when its call is answered, not when its thread ends. Two calls
    whose handler never returns (max_concurrent 2) are answered 504 at the deadline; the route is
    ready again and a third call is served, while the first two's threads still run."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    gate = threading.Event()

    def stuck(req: Body):
        if req.answer == "stuck":
            gate.wait(60)
        return {"n": req.n}

    health = Health()
    app = make_app("test", health, CollectorRegistry())
    route = add_work_route(app, "/work", Body, stuck, max_concurrent=2, max_body_bytes=4096, body_timeout_s=5.0,
                           answer_within_s=0.5)
    server = HealthServer(app).start()
    try:
        with ThreadPoolExecutor(2) as pool:
            held = [pool.submit(httpx.post, f"{server.url}/work", json={"answer": "stuck"}, timeout=10)
                    for _ in range(2)]
            answers = [h.result() for h in held]
        assert [a.status_code for a in answers] == [504, 504], [a.text for a in answers]
        assert "did not answer within 0.5 s" in answers[0].json()["detail"]
        ok, detail = route.ready()
        assert ok and "0 of 2 calls in progress, 2 of 4 threads busy" in detail, detail
        r = httpx.post(f"{server.url}/work", json={"n": 1}, timeout=10)
        assert r.status_code == 200 and r.json() == {"n": 1}
    finally:
        gate.set()
        server.stop()


def test_an_expected_long_call_keeps_livez_until_its_time_and_a_beat_ends_it():
    """Regression (review of issue 46): up now restarts a service whose /livez fails, and a
    training step or an evaluation batch longer than liveness_timeout_s never beats (a slow CPU,
    a large model): the learner says how long it may take (Health.expect)."""
    health = Health(liveness_timeout_s=0.05)
    health.beat()
    health.expect(0.5)
    time.sleep(0.1)
    assert health.live()[0]          # past liveness_timeout_s, within the expected call
    health.beat()                    # the call is done: back to liveness_timeout_s
    time.sleep(0.1)
    assert not health.live()[0]
    health.expect(0.05)
    time.sleep(0.1)
    assert not health.live()[0]      # past both

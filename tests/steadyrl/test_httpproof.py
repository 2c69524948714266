"""Issue 46: a work route's token proven both ways (steadyrl/httpproof.py), on real HTTP servers on
127.0.0.1. A client that proves its token gets the route and takes the answer only with the
server's proof; a process holding the server's port (a restart's window) receives no token and
its answer is refused; a request's mac opens that request only; the bearer token still works."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from prometheus_client import CollectorRegistry
from pydantic import BaseModel

from steadyrl.http import Health, HealthServer, add_work_route, make_app
from steadyrl.httpproof import PROOF_HEADER, SCHEME, ProvenToken, Unproven, install, request_mac, response_mac

TOKEN = "score-t0ken-of-this-run"


class Body(BaseModel):
    n: int


@pytest.fixture
def server():
    health = Health()
    health.add_check("ok", lambda: (True, "fine"))
    app = make_app("test", health, CollectorRegistry())
    add_work_route(app, "/score", Body, lambda req: {"n": req.n, "rewards": [1.0] * req.n}, max_concurrent=4,
                   max_body_bytes=4096, body_timeout_s=5.0, token=TOKEN)
    install(app, TOKEN)
    srv = HealthServer(app).start()
    yield srv
    srv.stop()


def test_a_client_proving_the_token_is_served_and_the_answer_proves_it_too(server):
    with httpx.Client(auth=ProvenToken(TOKEN)) as c:
        r = c.post(f"{server.url}/score", json={"n": 3})
        assert r.status_code == 200 and r.json() == {"n": 3, "rewards": [1.0, 1.0, 1.0]}
        assert r.request.headers["authorization"].startswith(f"{SCHEME} ") and TOKEN not in str(r.request.headers)
        r = c.post(f"{server.url}/score", json={"n": "x"})      # a refusal is proven too (422)
        assert r.status_code == 422
        assert c.get(f"{server.url}/readyz").status_code == 200   # and the open routes
    # the bearer token, as before: served (no proof asked)
    r = httpx.post(f"{server.url}/score", json={"n": 1}, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200 and PROOF_HEADER.lower() not in r.headers


def test_a_wrong_token_or_a_mac_for_another_body_is_401(server):
    with httpx.Client(auth=ProvenToken("another-token")) as c:
        r = c.post(f"{server.url}/score", json={"n": 1})
    assert r.status_code == 401 and SCHEME in r.json()["detail"]
    # a mac seen once (by whoever held the port) opens that request only: not another body
    nonce, body = "n0nce", json.dumps({"n": 1}).encode()
    mac = request_mac(TOKEN, "POST", "/score", nonce, body)
    seen = {"Authorization": f"{SCHEME} {nonce}:{mac}", "Content-Type": "application/json"}
    assert httpx.post(f"{server.url}/score", content=body, headers=seen).status_code == 200
    assert httpx.post(f"{server.url}/score", content=b'{"n": 500}', headers=seen).status_code == 401
    assert httpx.post(f"{server.url}/score", content=body,
                      headers={"Authorization": f"{SCHEME} garbage"}).status_code == 401


class _Squatter(BaseHTTPRequestHandler):
    """Another process on the server's port: answers every call with rewards of its choosing."""

    seen: list[dict] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        self.seen.append({"headers": dict(self.headers), "body": self.rfile.read(int(self.headers["Content-Length"]))})
        body = json.dumps({"n": 1, "rewards": [1.0]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header(PROOF_HEADER, "0" * 64)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_process_on_the_servers_port_gets_no_token_and_its_answer_is_refused():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Squatter)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        with httpx.Client(auth=ProvenToken(TOKEN)) as c, pytest.raises(Unproven, match="no valid proof"):
            c.post(f"http://127.0.0.1:{srv.server_port}/score", json={"n": 1})
        assert isinstance(Unproven("x"), httpx.TransportError)   # a worker takes it as its server down
    finally:
        srv.shutdown()
    [got] = _Squatter.seen
    assert TOKEN not in json.dumps(got["headers"]) and TOKEN.encode() not in got["body"]


def test_the_proof_binds_the_nonce_the_status_and_the_body():
    p = response_mac(TOKEN, "a", 200, b"{}")
    assert p != response_mac(TOKEN, "b", 200, b"{}") != response_mac(TOKEN, "a", 500, b"{}")
    assert p != response_mac(TOKEN, "a", 200, b"{ }") and p != response_mac("other", "a", 200, b"{}")

"""Every service's HTTP face: `GET /livez`, `GET /readyz`, `GET /metrics`.

- `/livez`: 200 while the service's main loop has ticked within `liveness_timeout_s`;
  never depends on the broker (a broker outage must not cause restart storms).
- `/readyz`: one JSON entry per named check `{"ok": bool, "detail": str}`; 200 only when
  every check passes, 503 otherwise (and before the first check is registered).
- `/metrics`: Prometheus text from the process registry, on that exact path (no redirect).

`HealthServer` runs uvicorn in a daemon thread so the service's own loop owns the main
thread and its signals.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Callable

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

# The classic text format every Prometheus 2.x scrapes (what prometheus-client itself
# answers when the scraper does not ask for another).
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

log = logging.getLogger(__name__)

#: A readiness check: returns (ok, detail). Must be cheap: it runs on every /readyz.
Check = Callable[[], tuple[bool, str]]


class Health:
    """Liveness heartbeat and named readiness checks, shared by a service and its HTTP app.

    Args:
        liveness_timeout_s: /livez fails if `beat()` was not called for this long.
    """

    def __init__(self, liveness_timeout_s: float = 60.0):
        self.liveness_timeout_s = liveness_timeout_s
        self._last_beat = time.monotonic()
        self._checks: dict[str, Check] = {}
        self._lock = threading.Lock()

    def beat(self) -> None:
        """Record that the main loop is alive (call once per loop iteration)."""
        self._last_beat = time.monotonic()

    def add_check(self, name: str, check: Check) -> None:
        with self._lock:
            self._checks[name] = check

    def live(self) -> tuple[bool, float]:
        age = time.monotonic() - self._last_beat
        return age <= self.liveness_timeout_s, age

    def ready(self) -> tuple[bool, dict[str, dict]]:
        with self._lock:
            checks = dict(self._checks)
        results: dict[str, dict] = {}
        for name, check in checks.items():
            try:
                ok, detail = check()
            except Exception as e:  # a broken check is a failed check, not a 500
                ok, detail = False, f"check raised {type(e).__name__}: {e}"
            results[name] = {"ok": bool(ok), "detail": detail}
        return bool(results) and all(r["ok"] for r in results.values()), results


def make_app(service: str, health: Health, registry: CollectorRegistry = REGISTRY) -> FastAPI:
    """The FastAPI app with the three probe routes; services may add their own routes."""
    app = FastAPI(title=f"steadyrl {service}", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/livez")
    def livez() -> JSONResponse:
        ok, age = health.live()
        return JSONResponse({"live": ok, "last_beat_age_s": round(age, 3)}, status_code=200 if ok else 503)

    @app.get("/readyz")
    def readyz() -> JSONResponse:
        ok, checks = health.ready()
        return JSONResponse({"ready": ok, "checks": checks}, status_code=200 if ok else 503)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_PLAIN_0_0_4)

    return app


class HealthServer:
    """uvicorn serving `app` on host:port in a daemon thread.

    Args:
        port: 0 picks a free port; read `.port` after `start()`.
    Raises:
        RuntimeError from start() if the server does not come up within 10 s.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.host = host
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted connections inherit TCP_NODELAY: without it a keep-alive client waits for
        # its delayed ACK (~40 ms) before the response body follows the headers.
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.bind((host, port))
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # the service owns signals
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "HealthServer":
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"HTTP server on {self.url} did not start")
            time.sleep(0.01)
        log.info("http server listening", extra={"url": self.url})
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self._sock.close()

"""Every service's HTTP face: `GET /livez`, `GET /readyz`, `GET /metrics`, and the heavy routes.

- `/livez`: 200 while the service's main loop has ticked within `liveness_timeout_s`, else
  503 (`steadyrl up` and Kubernetes restart it after a few); 200 too once it is stopping
  (`Health.stopping`: told to stop, or its loop ended); never depends on the broker (a
  broker outage must not cause restart storms). The body: `live`, `last_beat_age_s`,
  `stopping` when set, and `doing` where the service says what its loop is at
  (`Health.doing`: the learner's phase).
- `/readyz`: one JSON entry per named check `{"ok": bool, "detail": str}`; 200 only when
  every check passes, 503 otherwise (and before the first check is registered, and when
  the checks do not answer within `PROBE_TIMEOUT_S`).
- `/metrics`: Prometheus text from the process registry, on that exact path (no redirect).

No request load can starve the probes. They are `async` routes: `/livez` is answered on
the event loop itself, `/readyz` and `/metrics` (which call the checks and the collectors,
NVML included) on a probe pool of their own. Neither touches anyio's default thread
limiter (40 tokens, shared by every sync `def` route: 40 slow `/generate` calls used to
hold all of them, and /livez queued behind them). The heavy routes (`add_work_route`: the
actor's `POST /generate`, the reward server's `POST /score`) read their body on the event
loop with a size limit and a deadline, then parse, validate, run and serialise it on a
bounded pool of their own (`max_concurrent` threads); a call past `max_concurrent` gets
503 with `Retry-After` at once, without queueing.

    413  body above max_body_bytes (Content-Length or counted)   connection closed
    408  body not received within body_timeout_s                   connection closed
    401  a token is configured and the call lacks `Authorization: Bearer <it>` (before all else)
    503  max_concurrent calls already in progress; Retry-After     (the body is not read)
    422  body is not valid JSON for the route's model (FastAPI's `detail` list), or the
         answer cannot be sent as finite JSON (NaN, Infinity: `detail` says so)
    504  the handler did not return within the route's `answer_within_s` (when it has one):
         the call is answered and its slot freed; the handler's thread runs on

`HealthServer` runs uvicorn in a daemon thread so the service's own loop owns the main
thread and its signals, with its h11 protocol and these limits against slow clients:
keep-alive `KEEP_ALIVE_S`, a request head within `HEAD_TIMEOUT_S` and at most
`MAX_HEAD_BYTES` (h11's max incomplete event size).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import h11
import uvicorn
from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, generate_latest

# The classic text format every Prometheus 2.x scrapes (what prometheus-client itself
# answers when the scraper does not ask for another).
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

if TYPE_CHECKING:
    import httpx

log = logging.getLogger(__name__)

#: A readiness check: returns (ok, detail). Must be cheap: it runs on every /readyz.
Check = Callable[[], tuple[bool, str]]

#: Seconds an idle keep-alive connection stays open. Above httpx's 5 s keepalive_expiry (the
#: rollout and reward clients' pools), so the client drops an idle connection before the
#: server does and never reuses one the server is closing (uvicorn's default is that same 5 s).
KEEP_ALIVE_S = 10
#: Seconds a request line and its headers may take to arrive, from the connection (or the
#: previous response on it): uvicorn has no such limit, and a client trickling its headers
#: (slowloris) would hold its connection forever. Our clients send the head in one write.
HEAD_TIMEOUT_S = 10.0
#: Largest request head (h11's max incomplete event size; uvicorn's default is 16 KiB).
#: Our clients' heads are under 1 KiB; 8 KiB is the usual header limit of proxies.
MAX_HEAD_BYTES = 8 * 1024
#: /readyz and /metrics answer 503 when the checks or collectors take longer than this.
PROBE_TIMEOUT_S = 5.0
#: The Retry-After of a 503 past max_concurrent, seconds.
RETRY_AFTER_S = 1

REFUSED = Counter("steadyrl_http_requests_refused", "Heavy-route calls refused by the HTTP layer",
                  ["route", "reason"])  # busy, too_large, body_timeout, invalid, not_json, answer_timeout
IN_FLIGHT = Gauge("steadyrl_http_requests_in_flight", "Heavy-route calls holding one of max_concurrent slots",
                  ["route"])
REFUSED_REASONS = ("busy", "too_large", "body_timeout", "invalid", "not_json", "unauthorized", "answer_timeout")
HEAD_TIMEOUTS = Counter("steadyrl_http_head_timeouts", "Connections closed: request head not received in time")


class Health:
    """Liveness heartbeat and named readiness checks, shared by a service and its HTTP app.

    Args:
        liveness_timeout_s: /livez fails if `beat()` was not called for this long.
    """

    def __init__(self, liveness_timeout_s: float = 60.0) -> None:
        self.liveness_timeout_s = liveness_timeout_s
        self._last_beat = time.monotonic()
        self._checks: dict[str, Check] = {}
        self._lock = threading.Lock()
        #: What the main loop is at, for /livez's `doing` (cheap, read on the event loop); None: not said.
        self.doing: Callable[[], str] | None = None
        #: Set once the service is on its way out (told to stop, or its loop ended): /livez then
        #: answers 200 with `stopping` (closing its clients may take a while without a beat;
        #: whoever stopped it kills it after its own grace period).
        self.stopping = False
        self._grace_until = 0.0

    def beat(self) -> None:
        """Record that the main loop is alive (call once per loop iteration); ends an `expect`."""
        self._last_beat = time.monotonic()
        self._grace_until = 0.0

    def expect(self, seconds: float) -> None:
        """The main loop enters a known long call (a training step, a batch of the evaluation)
        that may take up to `seconds` without a beat: /livez holds until then, or until
        liveness_timeout_s after the last beat if that is later. The next beat() ends it."""
        self._grace_until = time.monotonic() + seconds

    def add_check(self, name: str, check: Check) -> None:
        with self._lock:
            self._checks[name] = check

    def live(self) -> tuple[bool, float]:
        """(live, seconds since the last beat): live while beating within liveness_timeout_s, within
        an `expect`ed long call, or stopping."""
        now = time.monotonic()
        age = now - self._last_beat
        return age <= self.liveness_timeout_s or now <= self._grace_until or self.stopping, age

    def ready(self) -> tuple[bool, dict[str, dict[str, Any]]]:
        with self._lock:
            checks = dict(self._checks)
        results: dict[str, dict[str, Any]] = {}
        for name, check in checks.items():
            try:
                ok, detail = check()
            except Exception as e:  # noqa: BLE001 - a broken check is a failed check, not a 500
                ok, detail = False, f"check raised {type(e).__name__}: {e}"
            results[name] = {"ok": bool(ok), "detail": detail}
        return bool(results) and all(r["ok"] for r in results.values()), results


class DaemonPool:
    """At most `size` daemon threads, started as calls need them, running calls submitted from
    an event loop. Daemon, unlike concurrent.futures' workers, which the interpreter joins at
    exit: a generation in progress, or a check that hangs, must not hold up a stopping service.
    """

    def __init__(self, size: int, name: str) -> None:
        self.size, self.name = size, name
        self._jobs: queue.SimpleQueue[tuple[asyncio.AbstractEventLoop, asyncio.Future[Any], Callable[[], Any]]] = \
            queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = self._idle = self._pending = 0

    def busy(self) -> int:
        """Threads running a call now (a call past its answer's deadline included)."""
        with self._lock:
            return self._threads - self._idle

    def submit(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        """fn() on a pool thread; its result (or exception) on the returned future of the
        running loop. Calls past `size` at once wait for a thread."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._pending += 1
            start = self._pending > self._idle and self._threads < self.size
            if start:
                self._threads += 1
        if start:
            threading.Thread(target=self._work, name=f"{self.name}-{self._threads}", daemon=True).start()
        self._jobs.put((loop, future, fn))
        return future

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            loop, future, fn = self._jobs.get()
            with self._lock:
                self._idle -= 1
                self._pending -= 1
            try:
                result, error = fn(), None
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                result, error = None, e
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
                loop.call_soon_threadsafe(_settle, future, result, error)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if not future.done():  # a caller that timed out has cancelled it
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)


def make_app(service: str, health: Health, registry: CollectorRegistry = REGISTRY) -> FastAPI:
    """The FastAPI app with the three probe routes; services may add their own routes
    (heavy ones with `add_work_route`)."""
    app = FastAPI(title=f"steadyrl {service}", docs_url=None, redoc_url=None, openapi_url=None)
    # Two threads: a check or a collector that hangs holds one; /livez never needs either.
    probes = DaemonPool(2, "http-probe")

    async def on_probe_pool(fn: Callable[[], Any]) -> Any:
        """fn() on the probe pool; TimeoutError after PROBE_TIMEOUT_S (the thread finishes alone)."""
        return await asyncio.wait_for(probes.submit(fn), PROBE_TIMEOUT_S)

    @app.get("/livez")
    async def livez() -> JSONResponse:  # on the event loop: two reads of the clock
        ok, age = health.live()
        body: dict[str, Any] = {"live": ok, "last_beat_age_s": round(age, 3)}
        if health.stopping:
            body["stopping"] = True
        if health.doing is not None:
            try:
                body["doing"] = health.doing()
            except Exception as e:  # noqa: BLE001 - a description that fails must not fail the probe
                body["doing"] = f"(not known: {type(e).__name__})"
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        try:
            ok, checks = await on_probe_pool(health.ready)
        except TimeoutError:
            return JSONResponse({"ready": False, "checks": {},
                                 "detail": f"readiness checks did not answer within {PROBE_TIMEOUT_S:g} s"}, 503)
        return JSONResponse({"ready": ok, "checks": checks}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            text = await on_probe_pool(lambda: generate_latest(registry))
        except TimeoutError:
            return Response(f"metrics collection took over {PROBE_TIMEOUT_S:g} s\n", 503, media_type="text/plain")
        return Response(text, media_type=CONTENT_TYPE_PLAIN_0_0_4)

    return app


class HTTPError(HTTPException):
    """An HTTPException whose JSON answer carries fields beside `detail` (`extra`)."""

    def __init__(self, status_code: int, detail: str, extra: dict[str, Any] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(status_code, detail, headers)
        self.extra = extra or {}


def _json(status: int, body: dict[str, Any],
          headers: Mapping[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
    return status, json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode(), dict(headers or {})


def finite_json(value: Any) -> bytes:
    """`value` as compact UTF-8 JSON. Raises ValueError for NaN or ±Infinity anywhere (and for
    text that cannot be UTF-8), TypeError for a value JSON has no form for."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def _validation_detail(e: ValidationError, limit: int = 20) -> list[dict[str, Any]]:
    """FastAPI's 422 `detail` (loc under "body", msg, type), without the inputs (a body of
    megabytes would come back), at most `limit` errors and a last entry counting the rest."""
    errors = e.errors(include_url=False, include_input=False, include_context=False)
    out = [{"type": err["type"], "loc": ["body", *err["loc"]], "msg": err["msg"]} for err in errors[:limit]]
    if len(errors) > limit:
        out.append({"type": "more", "loc": ["body"], "msg": f"... and {len(errors) - limit} more errors"})
    return out


def unauthorized(request: Request, token: str | None, setting: str = "http_token_file") -> JSONResponse | None:
    """The 401 answer for a request without `Authorization: Bearer <token>`, or None when it has
    it (or `token` is None: no authentication). Compared in constant time (hmac.compare_digest).
    `setting` names where the token is configured (the answer says so)."""
    if token is None:
        return None
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode()):
        return None
    why = "no bearer token" if scheme.lower() != "bearer" else "wrong bearer token"
    return JSONResponse({"detail": f"{request.url.path}: {why} (Authorization: Bearer <the token of "
                                   f"{setting}>)"}, 401, headers={"WWW-Authenticate": "Bearer"})


class WorkRoute:
    """What `add_work_route` made: its slots and threads, for a readiness check."""

    def __init__(self, path: str, max_concurrent: int, pool: DaemonPool) -> None:
        self.path, self.max_concurrent, self.pool = path, max_concurrent, pool
        self.slots = threading.BoundedSemaphore(max_concurrent)
        self.taken = 0
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if not self.slots.acquire(blocking=False):
                return False
            self.taken += 1
            return True

    def give_back(self) -> None:
        with self._lock:
            self.taken -= 1
            self.slots.release()

    def ready(self) -> tuple[bool, str]:
        """(a call would be taken now, detail): False when every slot is taken, or every
        thread is still running a call (answered past its deadline or not)."""
        busy = self.pool.busy()
        ok = self.taken < self.max_concurrent and busy < self.pool.size
        return ok, (f"{self.path}: {self.taken} of {self.max_concurrent} calls in progress, "
                    f"{busy} of {self.pool.size} threads busy")


def add_work_route(app: FastAPI, path: str, model: type[BaseModel], handler: Callable[[Any], Any], *,
                   max_concurrent: int, max_body_bytes: int, body_timeout_s: float,
                   retry_after_s: int = RETRY_AFTER_S, token: str | None = None,
                   answer_within_s: float | None = None) -> WorkRoute:
    """`POST path` on `app`: the body, at most `max_body_bytes`, arrives within `body_timeout_s`;
    then, on a pool of threads, it is validated as `model`, `handler(request)` runs and its
    answer (a JSON-able value) is serialised. A call that finds `max_concurrent` calls in
    progress gets 503 with Retry-After. `handler` raises HTTPException (or HTTPError) to refuse;
    any other exception is a 500 with its type and message. With `token`, a call without
    `Authorization: Bearer <token>` gets 401 before anything else. With `answer_within_s`, a
    call whose handler has not returned that long after its body arrived is answered 504 and
    its slot freed at once (the slot is freed when the call is answered, not when its thread
    ends; the pool has 2 x max_concurrent threads, so such calls do not starve the next ones).
    Returns the route's WorkRoute (its `ready` for /readyz). See the module doc."""
    pool = DaemonPool(max_concurrent * (2 if answer_within_s is not None else 1), f"http{path.replace('/', '-')}")
    route = WorkRoute(path, max_concurrent, pool)
    in_flight = IN_FLIGHT.labels(path)
    refused = {r: REFUSED.labels(path, r) for r in REFUSED_REASONS}  # every series from the start

    def work(body: bytes, release: Callable[[], None]) -> tuple[int, bytes, dict[str, str]]:
        """On the pool: the whole call after the body, so nothing heavy runs on the event loop."""
        try:
            return _answer(path, model, handler, body, refused)
        finally:
            release()  # here, not in the endpoint: a cancelled endpoint must not free a running slot

    async def endpoint(request: Request) -> Response:
        refusal = unauthorized(request, token)
        if refusal is not None:
            refused["unauthorized"].inc()
            return refusal
        if not route.take():
            refused["busy"].inc()
            return JSONResponse({"detail": f"{path} busy: {max_concurrent} calls in progress (max_concurrent "
                                           f"{max_concurrent}); retry after {retry_after_s} s"}, 503,
                                headers={"Retry-After": str(retry_after_s)})
        in_flight.inc()
        release = _once(in_flight.dec, route.give_back)
        future: asyncio.Future[Any] | None = None
        try:
            body = await _read_body(request, max_body_bytes, body_timeout_s, refused)
            if isinstance(body, Response):
                return body
            future = pool.submit(lambda: work(body, release))
        finally:
            if future is None:  # refused, or the client went away while sending
                release()
        try:
            status, content, headers = await asyncio.wait_for(asyncio.shield(future), answer_within_s)
        except TimeoutError:   # the handler runs on; the call is answered and its slot freed now
            release()
            refused["answer_timeout"].inc()
            log.error("call not answered in time; its thread runs on", extra={"route": path,
                                                                               "answer_within_s": answer_within_s})
            return JSONResponse({"detail": f"{path} did not answer within {answer_within_s:g} s"}, 504)
        return Response(content, status, headers=headers, media_type="application/json")

    endpoint.__name__ = f"post{path.replace('/', '_')}"
    app.add_api_route(path, endpoint, methods=["POST"])
    return route


def _once(*fns: Callable[[], None]) -> Callable[[], None]:
    """`fns` made to run once, in order: the first call runs them, any later one (from any
    thread) does nothing. A call's release of its slot, whoever releases it first."""
    done = threading.Event()
    guard = threading.Lock()

    def once() -> None:
        with guard:
            if done.is_set():
                return
            done.set()
        for fn in fns:
            fn()

    return once


async def _read_body(request: Request, max_body_bytes: int, body_timeout_s: float,
                     refused: Mapping[str, Counter]) -> bytes | Response:
    """A work call's body, or the answer that refuses it: 413 above `max_body_bytes` (declared or
    sent), 408 when it has not arrived within `body_timeout_s`, 400 when the client went away.
    Counts each refusal in `refused`."""
    too_large = JSONResponse({"detail": f"body above max_body_bytes {max_body_bytes}"}, 413,
                             headers={"Connection": "close"})
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_body_bytes:
        refused["too_large"].inc()
        return too_large
    chunks, size = [], 0
    try:
        async with asyncio.timeout(body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_body_bytes:
                    refused["too_large"].inc()
                    return too_large
                chunks.append(chunk)
    except TimeoutError:
        refused["body_timeout"].inc()
        return JSONResponse({"detail": f"body not received within body_timeout_s {body_timeout_s:g} s "
                                       f"({size} bytes arrived)"}, 408, headers={"Connection": "close"})
    except ClientDisconnect:  # nobody to answer
        return Response(status_code=400)
    return b"".join(chunks)


def _answer(path: str, model: type[BaseModel], handler: Callable[[Any], Any], body: bytes,
            refused: Mapping[str, Counter]) -> tuple[int, bytes, dict[str, str]]:
    """A work call's answer to `body` as (status, JSON bytes, headers): 422 when it is not a valid
    `model` or the handler's answer is not finite JSON, the handler's HTTPException as it is, 500
    with the type and message of any other exception it raises, else 200 and the answer."""
    try:
        req = model.model_validate_json(body)
    except ValidationError as e:
        refused["invalid"].inc()
        return _json(422, {"detail": _validation_detail(e)})
    try:
        answer = handler(req)
    except StarletteHTTPException as e:  # fastapi's HTTPException and HTTPError are ones
        return _json(e.status_code, {"detail": e.detail, **getattr(e, "extra", {})}, e.headers)
    except Exception as e:  # a bug: say what it was, keep serving
        log.exception("request handler failed", extra={"route": path})
        return _json(500, {"detail": f"{path} failed: {type(e).__name__}: {e}"})
    try:
        return 200, finite_json(answer), {}
    except (ValueError, TypeError) as e:  # the same request would fail again: not a 5xx
        refused["not_json"].inc()
        log.error("answer cannot be sent as JSON", extra={"route": path, "error": f"{type(e).__name__}: {e}"})
        return _json(422, {"detail": f"{path}: the answer to this request cannot be sent as finite JSON "
                                     f"({type(e).__name__}: {e})"})


def _protocol_class() -> type[H11Protocol]:
    """uvicorn's h11 protocol, plus HEAD_TIMEOUT_S for every request head."""
    class Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        # uvicorn's own H11Protocol narrows it the same way (and ignores [override] there too)
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def _arm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = None
            if not self.transport.is_closing():
                self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timeout)

        def _head_timeout(self) -> None:
            """Close a connection still waiting for (the rest of) a request head; one whose
            request is being read or answered is left alone."""
            self._head_timer = None
            waiting = self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)
            if waiting and not self.transport.is_closing():
                HEAD_TIMEOUTS.inc()
                self.transport.close()

    return Protocol


class HealthServer:
    """uvicorn serving `app` on host:port in a daemon thread.

    Args:
        port: 0 picks a free port; read `.port` after `start()`.
    Raises:
        RuntimeError from start() if the server does not come up within 10 s.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted connections inherit TCP_NODELAY: without it a keep-alive client waits for
        # its delayed ACK (~40 ms) before the response body follows the headers.
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.bind((host, port))
        self.port = self._sock.getsockname()[1]
        # No limit_concurrency: past it uvicorn answers 503 to every route, the probes too;
        # the heavy routes bound themselves (add_work_route). h11 always (not httptools where
        # it is installed, as "auto" would): the head timeout and MAX_HEAD_BYTES rely on it.
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                http=_protocol_class(), timeout_keep_alive=KEEP_ALIVE_S,
                                h11_max_incomplete_event_size=MAX_HEAD_BYTES)
        self._server = uvicorn.Server(config)
        # The service owns signals: uvicorn (>= 0.29) installs no handler off the main thread.
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> HealthServer:
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


def response_detail(resp: httpx.Response) -> str:
    """A peer's message from its HTTP answer (an httpx.Response): FastAPI's {"detail": ...}, else
    the body; 500 characters at most."""
    try:
        d = resp.json()["detail"]
        text = d if isinstance(d, str) else json.dumps(d)
    except (ValueError, KeyError, TypeError):
        text = resp.text
    return text[:500]

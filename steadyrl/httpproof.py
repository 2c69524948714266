"""Proof of a work route's token both ways, so a client and a server each know whom they talk to.

A bearer token goes to whoever listens on the port: while a server restarts, another local
process can take its port, receive the token (and open the route with it) and answer in the
server's place -- rewards of its choosing, trained. With the `Steadyrl-HMAC` scheme the client
sends, instead of the token,

    Authorization: Steadyrl-HMAC <nonce>:<mac>
    mac = hex HMAC-SHA256(token, "steadyrl-request\\n{METHOD}\\n{path}\\n{nonce}\\n{hex sha256(body)}")

which opens that one request and nothing else, and the server answers with

    X-Steadyrl-Proof: hex HMAC-SHA256(token, "steadyrl-response\\n{nonce}\\n{status}\\n{hex sha256(body)}")

which only a holder of the token can write. `ProvenToken` (an httpx.Auth) is the client: an
answer without a valid proof raises `Unproven`, an httpx.TransportError, so a worker takes it as
its server being down (the batch held and retried, never dead-lettered); a 401 is left to the
caller (nothing in it to trust or act on). `install(app, token)` is the server: a request in the
scheme has its body read (at most MAX_BODY_BYTES, within BODY_TIMEOUT_S), its mac checked (401
naming the scheme when wrong), and goes on to the route as if it carried the bearer token, so a
route's own check (steadyrl.http.unauthorized) stays the one check; its answer, whatever the
status, carries the proof. A request with the bearer token is served as before: a deployment
whose clients send it works unchanged, and a client sends the scheme only where told
(ServiceConfig.http_token_proof; `steadyrl up` tells its workers).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import secrets
from collections.abc import Awaitable, Callable, Generator, MutableMapping
from typing import Any

import httpx

SCHEME = "Steadyrl-HMAC"
PROOF_HEADER = "X-Steadyrl-Proof"
#: Largest body a request in the scheme may have (the route's own max_body_bytes still applies).
MAX_BODY_BYTES = 64 * 1024 * 1024
#: Seconds a request in the scheme has to send its body.
BODY_TIMEOUT_S = 60.0
#: Longest nonce taken (a client's is 22 characters).
MAX_NONCE = 128

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def request_mac(token: str, method: str, path: str, nonce: str, body: bytes) -> str:
    """The mac of a request in the scheme (module doc)."""
    msg = f"steadyrl-request\n{method.upper()}\n{path}\n{nonce}\n{hashlib.sha256(body).hexdigest()}"
    return hmac.new(token.encode(), msg.encode(), hashlib.sha256).hexdigest()


def response_mac(token: str, nonce: str, status: int, body: bytes) -> str:
    """The proof an answer to the request with `nonce` carries (module doc)."""
    msg = f"steadyrl-response\n{nonce}\n{status}\n{hashlib.sha256(body).hexdigest()}"
    return hmac.new(token.encode(), msg.encode(), hashlib.sha256).hexdigest()


class Unproven(httpx.TransportError):
    """An answer without a valid proof of the token: not from the server the token was made for."""


class ProvenToken(httpx.Auth):
    """The client side of the scheme for `token` (module doc): every request carries a fresh
    nonce and its mac, never the token; an answer other than 401 without a valid proof raises
    Unproven."""

    requires_request_body = True
    requires_response_body = True

    def __init__(self, token: str):
        self.token = token

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        nonce = secrets.token_urlsafe(16)
        mac = request_mac(self.token, request.method, request.url.path, nonce, request.content)
        request.headers["Authorization"] = f"{SCHEME} {nonce}:{mac}"
        response = yield request
        if response.status_code == 401:
            return
        proof = response.headers.get(PROOF_HEADER, "")
        if not hmac.compare_digest(proof.encode(), response_mac(self.token, nonce, response.status_code,
                                                                 response.content).encode()):
            raise Unproven(f"{request.url}: the answer ({response.status_code}) carries no valid proof of the token "
                           f"({PROOF_HEADER}): not the server the token was made for (another process on its port?)",
                           request=request)


def _header(scope: Scope, name: bytes) -> str:
    for k, v in scope.get("headers", []):
        if k.lower() == name:
            return bytes(v).decode("latin-1")
    return ""


async def _answer(send: Send, status: int, detail: str, close: bool = False) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", SCHEME.encode()))
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class ProofMiddleware:
    """The server side of the scheme (module doc) around the ASGI app `app`."""

    def __init__(self, app: ASGIApp, token: str):
        self.app, self.token = app, token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scheme, _, given = _header(scope, b"authorization").partition(" ")
        if scope["type"] != "http" or scheme.lower() != SCHEME.lower():
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        nonce, _, mac = given.strip().partition(":")
        if not nonce or len(nonce) > MAX_NONCE:
            await _answer(send, 401, f"{path}: {SCHEME} wants <nonce>:<mac>, a nonce of 1..{MAX_NONCE} characters")
            return
        body = await _read_body(scope, receive, send)
        if body is None:
            return
        if not hmac.compare_digest(mac.encode(), request_mac(self.token, scope["method"], path, nonce, body).encode()):
            await _answer(send, 401, f"{path}: wrong {SCHEME} mac (the token of http_token_file, proven, not sent)")
            return
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"authorization"]
        inner = {**scope, "headers": [*headers, (b"authorization", f"Bearer {self.token}".encode())]}
        await self.app(inner, _replaying(body, receive), _proving(send, self.token, nonce))


async def _read_body(scope: Scope, receive: Receive, send: Send) -> bytes | None:
    """The request's whole body (the mac covers it), or None once it answered 413 (above
    MAX_BODY_BYTES, declared or sent) or 408 (not within BODY_TIMEOUT_S), or the client left."""
    declared = _header(scope, b"content-length")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        await _answer(send, 413, f"body above {MAX_BODY_BYTES} bytes", close=True)
        return None
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    await _answer(send, 413, f"body above {MAX_BODY_BYTES} bytes", close=True)
                    return None
                chunks.append(chunk)
                if not message.get("more_body"):
                    break
    except TimeoutError:
        await _answer(send, 408, f"body not received within {BODY_TIMEOUT_S:g} s", close=True)
        return None
    return b"".join(chunks)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """The app's `receive`: the body already read, as one message, then `receive`'s own."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _proving(send: Send, token: str, nonce: str) -> Send:
    """The app's `send`: its response held until its body is whole, then sent with PROOF_HEADER,
    the mac of `token` over `nonce`, the status and the body."""
    start: Message | None = None
    parts: list[bytes] = []

    async def proven(message: Message) -> None:
        nonlocal start
        if message["type"] == "http.response.start":
            start = message
            return
        if message["type"] != "http.response.body" or start is None:
            await send(message)
            return
        parts.append(message.get("body", b""))
        if message.get("more_body"):
            return
        content = b"".join(parts)
        proof = response_mac(token, nonce, int(start["status"]), content)
        await send({**start, "headers": [*start.get("headers", []), (PROOF_HEADER.lower().encode(),
                                                                     proof.encode())]})
        await send({"type": "http.response.body", "body": content})

    return proven


def install(app: Any, token: str | None) -> None:
    """Serve the scheme on `app` (a FastAPI/Starlette app) for `token`; nothing when None."""
    if token is not None:
        app.add_middleware(ProofMiddleware, token=token)

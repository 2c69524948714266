"""The robots: one configured DingTalk or WeCom webhook each, DingTalk signing (加签), and
keeping their credentials out of every log line and message (steadyrl.services.alertbridge.bridge,
DingTalk signing and Secrets)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import re
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .config import Webhook
from .render import Rendered, Renderer, cut_utf8, md_text

ROBOTS = ("dingtalk", "wecom")
#: errcode each robot answers when it throttles a webhook; retried with backoff.
RATE_LIMIT_CODES = {"dingtalk": 130101, "wecom": 45009}


# ---------------------------------------------------------------------------- secrets

#: Query parameters that carry credentials in robot URLs (DingTalk access_token, WeCom key, the signature).
_SECRET_PARAMS = re.compile(r"\b(access_token|key|sign|token|secret)=[^&#\s\"'<>]*")
_USERINFO = re.compile(r"(//)[^/@\s]+@")


def mask_url(url: str) -> str:
    """`url` with credentials replaced by *** (query access_token/key/sign/..., user:password@)."""
    return _USERINFO.sub(r"\1***@", _SECRET_PARAMS.sub(r"\1=***", url))


class _Redactor(logging.Filter):
    """Replaces registered secret values and credential query parameters in log records.

    Installed on the bridge's logger (steadyrl.alertbridge), on httpx's (it logs every
    request URL at INFO) and on uvicorn.error (tracebacks of a route that failed).
    """

    def __init__(self) -> None:
        super().__init__("alertbridge-redactor")
        self._secrets: set[str] = set()
        self._lock = threading.Lock()

    def add(self, *values: str | None) -> None:
        with self._lock:
            self._secrets |= {v for v in values if v and len(v) >= 4}

    def redact(self, text: str) -> str:
        for s in sorted(self._secrets, key=len, reverse=True):
            if s in text:
                text = text.replace(s, "***")
        return mask_url(text)

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        clean = self.redact(msg)
        if clean != msg or record.args:
            record.msg, record.args = clean, None
        for k, v in list(vars(record).items()):
            if isinstance(v, str) and k not in ("msg", "name", "levelname", "pathname", "filename", "module",
                                                "funcName", "threadName", "processName", "taskName"):
                setattr(record, k, self.redact(v))
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self.redact(record.exc_text)
        return True



REDACTOR = _Redactor()
for _name in ("steadyrl.alertbridge", "httpx", "uvicorn.error"):  # uvicorn.error: tracebacks of a failed route
    if REDACTOR not in logging.getLogger(_name).filters:
        logging.getLogger(_name).addFilter(REDACTOR)


def redact(text: str) -> str:
    """`text` without any secret the bridge knows (values and credential query parameters)."""
    return REDACTOR.redact(text)


# ---------------------------------------------------------------------------- signing

def dingtalk_sign(secret: str, timestamp_ms: int) -> str:
    """DingTalk 加签: base64(HMAC-SHA256(key=secret, msg=f"{timestamp_ms}\\n{secret}")), not yet URL-encoded."""
    digest = hmac.new(secret.encode("utf-8"), f"{timestamp_ms}\n{secret}".encode(), hashlib.sha256).digest()
    return base64.b64encode(digest).decode("ascii")


def signed_url(url: str, secret: str, timestamp_ms: int | None = None) -> str:
    """`url` with `&timestamp=<ms>&sign=<urlencoded signature>` appended, as DingTalk's docs build it."""
    ts = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
    sign = urllib.parse.quote_plus(dingtalk_sign(secret, ts))
    return f"{url}{'&' if '?' in url else '?'}timestamp={ts}&sign={sign}"


# ---------------------------------------------------------------------------- the robots

@dataclass
class Robot:
    """One configured robot. `url` holds the credential: never log it, log `masked_url`."""

    name: str
    url: str
    max_bytes: int
    secret: str | None = None  # DingTalk 加签

    def __repr__(self) -> str:  # never the URL or the secret
        return f"Robot({self.name}, {self.masked_url}, signed={self.secret is not None})"

    @property
    def masked_url(self) -> str:
        return mask_url(self.url)

    @property
    def rate_limit_code(self) -> int:
        return RATE_LIMIT_CODES[self.name]

    def request_url(self) -> str:
        """The URL of one attempt (DingTalk: signed now, when a secret is set)."""
        return signed_url(self.url, self.secret) if self.secret else self.url

    def payload(self, renderer: Renderer, hook: Webhook) -> tuple[dict[str, Any], Rendered]:
        if self.name == "dingtalk":
            r = renderer.fit("dingtalk.md.j2", hook, self.max_bytes)
            r.title = cut_utf8(renderer.text("dingtalk.title.j2", hook, hook.alerts), 256)
            return {"msgtype": "markdown", "markdown": {"title": r.title, "text": r.text}}, r
        r = renderer.fit("wecom.md.j2", hook, self.max_bytes)
        return {"msgtype": "markdown", "markdown": {"content": r.text}}, r


class Quota:
    """A robot's published rate: at most `per_minute` messages in any 60 s (a sliding window
    of the send times). `clock`: seconds, monotonic. Not thread-safe (the bridge locks)."""

    WINDOW_S = 60.0

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic):
        self.per_minute, self.clock = per_minute, clock
        self.sent: deque[float] = deque()

    def available(self) -> int:
        """Messages that may be sent now."""
        now = self.clock()
        while self.sent and now - self.sent[0] >= self.WINDOW_S:
            self.sent.popleft()
        return self.per_minute - len(self.sent)

    def take(self) -> None:
        self.sent.append(self.clock())


class Held:
    """Notifications held back by the quota, summarised: (severity, alertname, status) -> count
    of alerts, and whether any was critical. Not thread-safe (the bridge locks)."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str, str], int] = {}
        self.notifications = 0
        self.critical = False

    def add(self, hook: Webhook, critical: bool) -> None:
        self.notifications += 1
        self.critical |= critical
        for a in hook.alerts:
            key = (a.labels.get("severity", ""), a.labels.get("alertname", "alert"), a.status)
            self.counts[key] = self.counts.get(key, 0) + 1

    def summary(self, robot: Robot, per_minute: int, critical_severities: list[str]) -> dict[str, Any]:
        """One markdown message of what was held (critical first), as `robot`'s payload."""
        alerts = sum(self.counts.values())
        head = (f"### ⚠️ {self.notifications} notifications held ({alerts} alerts): over the robot's quota of "
                f"{per_minute} per minute")
        order = sorted(self.counts.items(), key=lambda kv: (kv[0][0] not in critical_severities, -kv[1], kv[0]))
        lines = [f"- {'**' + md_text(sev) + '** ' if sev else ''}{md_text(name)} · {status} × {n}"
                 for (sev, name, status), n in order]
        text = cut_utf8("\n\n".join([head, "\n".join(lines)]), robot.max_bytes)
        if robot.name == "dingtalk":
            return {"msgtype": "markdown", "markdown": {"title": f"{alerts} alerts held (quota)", "text": text}}
        return {"msgtype": "markdown", "markdown": {"content": text}}


class SendError(Exception):
    """A failed attempt: metric `outcome`, the bridge's HTTP `status`, a message free of
    secrets, and whether tenacity may `retry` it."""

    def __init__(self, outcome: str, status: int, message: str, retry: bool = False):
        super().__init__(message)
        self.outcome, self.status, self.message, self.retry = outcome, status, message, retry


def _check_url(field: str, url: str) -> None:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{field}: not an http(s) URL: {mask_url(url)!r}")


"""Alert bridge: Alertmanager webhooks in, DingTalk and WeCom group-robot markdown out.

Alertmanager's generic webhook receiver posts a group of alerts as JSON; Chinese chat tools
take group-robot messages in their own formats. This service sits between the two:

    Alertmanager ──POST /alert/dingtalk──▶ alertbridge ──POST (signed)──▶ DingTalk robot
                 ──POST /alert/wecom─────▶             ──POST──────────▶ WeCom robot

Run: `python -m services.alertbridge` (binds 127.0.0.1:8500; `--metrics-host 0.0.0.0` in a
container). Besides the two routes it serves `/livez`, `/readyz` (check `robots`: 503 when
no robot is configured) and `/metrics`, like every steadyrl service (steadyrl.service).

Routes
    `POST /alert/dingtalk`, `POST /alert/wecom`: body = Alertmanager webhook JSON, version
    "4" (`Webhook`). Answers
      200  {"robot", "outcome": "sent", "alerts", "shown", "omitted", "truncated", "bytes", "attempts"}
      400  body is not JSON                       413  body above `max_webhook_bytes`
      404  that robot is not configured           422  not a version-4 webhook (fields named)
      500  a template failed to render
      502  the robot answered `errcode` != 0 (its errmsg is in `detail`), a non-200 status,
           a non-JSON answer, or could not be reached
      504  the robot did not answer within `timeout_s`
    Alertmanager retries a notification answered 5xx and drops one answered 4xx.

Rendering
    Jinja2 templates in `services/alertbridge/templates/` (`dingtalk.md.j2`,
    `dingtalk.title.j2`, `wecom.md.j2`; `alertbridge.templates_dir` may hold replacements of
    the same names). They show the group's status (FIRING:n / RESOLVED), alertname and
    severity, then each alert: status, alertname, severity, the `summary` and `description`
    annotations, `job` and `instance`, startsAt (endsAt when resolved, both UTC) and the
    generatorURL as a link (only http/https URLs).

Limits
    DingTalk `markdown.text` ≤ `dingtalk_max_bytes` (20000 UTF-8 bytes) and WeCom
    `markdown.content` ≤ `wecom_max_bytes` (4096 bytes, WeCom's documented limit). A message
    that fits is sent untouched. Otherwise the bridge keeps the most leading alerts that fit
    with a note "… N more alerts not shown" (N also counts the alerts Alertmanager itself
    left out, `truncatedAlerts`); if even the first alert alone does not fit, its text is
    cut on a UTF-8 character boundary (never inside a character) and ends with a
    "… truncated at L bytes" note. `steadyrl_alertbridge_truncated_total{robot}` counts
    these messages.

DingTalk signing ("加签")
    When `dingtalk_secret` is set, every attempt is signed as DingTalk's custom robot
    security settings document it (open.dingtalk.com, 自定义机器人安全设置, 加签):
    `string_to_sign = f"{timestamp}\\n{secret}"` with `timestamp` in milliseconds,
    `sign = urlencode(base64(HMAC-SHA256(key=secret, msg=string_to_sign)))`, and
    `&timestamp=<ts>&sign=<sign>` appended to the webhook URL (DingTalk refuses a
    timestamp more than an hour off). WeCom robots have no signing: the `key` in the URL
    is the credential.

Delivery
    httpx, `timeout_s` for connect, each read and each write. tenacity retries up to
    `retry_attempts` attempts in all, waiting `retry_backoff_s` doubled each time (at most
    `retry_backoff_max_s`), when the robot could not be connected to, answered 5xx, or
    answered its rate-limit code (DingTalk 130101 "send too fast", WeCom 45009 "api freq
    out of limit"). Not retried: any other `errcode` (310000: keyword, signature or IP
    check failed, ...), 4xx, and a read timeout (the robot may have posted the message;
    a retry could post it twice).

Secrets
    `dingtalk_url`, `dingtalk_secret` and `wecom_url` are pydantic SecretStr (the URLs
    carry `access_token` / `key`). They never reach a log line, an error message, an HTTP
    answer or a metric: URLs are shown masked (`access_token=***`, `key=***`, `sign=***`),
    and a logging filter on this module's logger and on httpx's (which logs request URLs)
    replaces the secret values and those query parameters in every record. Prefer the
    environment (`STEADYRL_ALERTBRIDGE__DINGTALK_URL`, ...) to flags, which `ps` shows.

Metrics
    `steadyrl_alertbridge_notifications_total{robot,outcome}` (outcome: sent, robot_error,
    http_error, timeout), `steadyrl_alertbridge_send_seconds{robot}` (one notification, all
    attempts and waits included), `steadyrl_alertbridge_truncated_total{robot}`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import re
import threading
import time
import urllib.parse
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import httpx
import jinja2
import tenacity
from fastapi import Request
from fastapi.responses import JSONResponse
from prometheus_client import Counter, Histogram
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError
from starlette.concurrency import run_in_threadpool

from steadyrl.config import ServiceConfig, load

log = logging.getLogger("steadyrl.alertbridge")

ROBOTS = ("dingtalk", "wecom")
OUTCOMES = ("sent", "robot_error", "http_error", "timeout")
#: errcode each robot answers when it throttles a webhook; retried with backoff.
RATE_LIMIT_CODES = {"dingtalk": 130101, "wecom": 45009}
TEMPLATES = Path(__file__).resolve().parent / "templates"

NOTIFICATIONS = Counter("steadyrl_alertbridge_notifications", "Alert notifications by robot and outcome",
                        ["robot", "outcome"])
SEND_SECONDS = Histogram("steadyrl_alertbridge_send_seconds",
                         "Time to deliver one notification to a robot (all attempts and waits, any outcome)",
                         ["robot"], buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
TRUNCATED = Counter("steadyrl_alertbridge_truncated", "Notifications shortened to the robot's size limit",
                    ["robot"])
for _r in ROBOTS:  # every series exists from the start: dashboards show 0, not "no data"
    TRUNCATED.labels(_r)
    SEND_SECONDS.labels(_r)
    for _o in OUTCOMES:
        NOTIFICATIONS.labels(_r, _o)


# ---------------------------------------------------------------------------- configuration

class AlertBridgeSection(BaseModel):
    """The alert bridge's own settings (`alertbridge:`)."""

    model_config = ConfigDict(extra="forbid")  # a typo is an error, not a silent default

    dingtalk_url: SecretStr | None = Field(
        None, description="DingTalk custom robot webhook, https://oapi.dingtalk.com/robot/send?access_token=... "
                          "(None: /alert/dingtalk answers 404). Secret: never logged.")
    dingtalk_secret: SecretStr | None = Field(
        None, description="The robot's 加签 secret (SEC...); when set, every request is signed. Secret: never logged.")
    wecom_url: SecretStr | None = Field(
        None, description="WeCom group robot webhook, https://qyapi.weixin.qq.com/cgi-bin/webhook/send?key=... "
                          "(None: /alert/wecom answers 404). Secret: never logged.")
    timeout_s: float = Field(5.0, gt=0, le=120, description="Per robot call: connect, each read, each write, seconds.")
    dingtalk_max_bytes: int = Field(20000, ge=256, le=20000,
                                    description="Largest markdown.text sent to DingTalk, UTF-8 bytes.")
    wecom_max_bytes: int = Field(4096, ge=256, le=4096,
                                 description="Largest markdown.content sent to WeCom, UTF-8 bytes (WeCom's limit).")
    retry_attempts: int = Field(3, ge=1, le=10, description="Attempts per notification in all (1: no retry).")
    retry_backoff_s: float = Field(1.0, ge=0, le=60, description="First wait before a retry, doubled each time.")
    retry_backoff_max_s: float = Field(10.0, ge=0, le=300, description="Longest wait between two attempts.")
    templates_dir: Path | None = Field(None, description="Folder with replacement templates (same file names).")
    max_webhook_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="Largest webhook body accepted (413 above).")


class AlertBridgeConfig(ServiceConfig):
    metrics_port: int = Field(8500, ge=0, le=65535, description="Port of the HTTP server (the webhook routes, "
                                                                "/livez, /readyz, /metrics); 0 picks a free one.")
    alertbridge: AlertBridgeSection = AlertBridgeSection()


# ---------------------------------------------------------------------------- the webhook

class WebhookAlert(BaseModel):
    """One alert of an Alertmanager webhook (unknown fields are ignored)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    status: Literal["firing", "resolved"]
    labels: dict[str, str]
    annotations: dict[str, str] = Field(default_factory=dict)
    starts_at: datetime = Field(alias="startsAt")
    ends_at: datetime | None = Field(None, alias="endsAt")
    generator_url: str = Field("", alias="generatorURL")
    fingerprint: str = ""


class Webhook(BaseModel):
    """Alertmanager's webhook body, version 4
    (prometheus.io/docs/alerting/latest/configuration/#webhook_config)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    version: Literal["4"]
    status: Literal["firing", "resolved"]
    alerts: list[WebhookAlert] = Field(min_length=1)
    receiver: str = ""
    group_key: str = Field("", alias="groupKey")
    truncated_alerts: int = Field(0, ge=0, alias="truncatedAlerts")
    group_labels: dict[str, str] = Field(default_factory=dict, alias="groupLabels")
    common_labels: dict[str, str] = Field(default_factory=dict, alias="commonLabels")
    common_annotations: dict[str, str] = Field(default_factory=dict, alias="commonAnnotations")
    external_url: str = Field("", alias="externalURL")


class WebhookRejected(Exception):
    """A webhook body the bridge refuses: `status` (400, 413, 422) and a message for the caller."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def parse_webhook(body: bytes) -> Webhook:
    """Validate a webhook body. Raises WebhookRejected 400 (not JSON) or 422 (fields named)."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WebhookRejected(400, f"body is not JSON: {e}") from None
    try:
        return Webhook.model_validate(data)
    except ValidationError as e:
        errors = [f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in e.errors()]
        more = f"; ... {len(errors) - 10} more" if len(errors) > 10 else ""
        raise WebhookRejected(422, "not an Alertmanager webhook (version 4): " + "; ".join(errors[:10]) + more) \
            from None


# ---------------------------------------------------------------------------- secrets

#: Query parameters that carry credentials in robot URLs (DingTalk access_token, WeCom key, the signature).
_SECRET_PARAMS = re.compile(r"\b(access_token|key|sign|token|secret)=[^&#\s\"'<>]*")
_USERINFO = re.compile(r"(//)[^/@\s]+@")


def mask_url(url: str) -> str:
    """`url` with credentials replaced by *** (query access_token/key/sign/..., user:password@)."""
    return _USERINFO.sub(r"\1***@", _SECRET_PARAMS.sub(r"\1=***", url))


class _Redactor(logging.Filter):
    """Replaces registered secret values and credential query parameters in log records.

    Installed on this module's logger, on httpx's (it logs every request URL at INFO) and on
    uvicorn.error (tracebacks of a route that failed).
    """

    def __init__(self):
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


# ---------------------------------------------------------------------------- signing, sizes

def dingtalk_sign(secret: str, timestamp_ms: int) -> str:
    """DingTalk 加签: base64(HMAC-SHA256(key=secret, msg=f"{timestamp_ms}\\n{secret}")), not yet URL-encoded."""
    digest = hmac.new(secret.encode("utf-8"), f"{timestamp_ms}\n{secret}".encode("utf-8"), hashlib.sha256).digest()
    return base64.b64encode(digest).decode("ascii")


def signed_url(url: str, secret: str, timestamp_ms: int | None = None) -> str:
    """`url` with `&timestamp=<ms>&sign=<urlencoded signature>` appended, as DingTalk's docs build it."""
    ts = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
    sign = urllib.parse.quote_plus(dingtalk_sign(secret, ts))
    return f"{url}{'&' if '?' in url else '?'}timestamp={ts}&sign={sign}"


def utf8_len(text: str) -> int:
    return len(text.encode("utf-8"))


def cut_utf8(text: str, max_bytes: int) -> str:
    """The longest prefix of `text` whose UTF-8 encoding has at most `max_bytes` bytes.

    Cuts between characters, never inside one: the byte prefix may end in the middle of a
    multi-byte sequence, and decoding with errors="ignore" drops exactly that incomplete
    tail (the prefix of a valid encoding holds no other invalid sequence)."""
    data = text.encode("utf-8")
    if len(data) <= max_bytes:
        return text
    return data[:max(0, max_bytes)].decode("utf-8", errors="ignore")


def _plural(n: int, word: str = "alert") -> str:
    return f"{n} more {word}{'' if n == 1 else 's'}"


def omitted_note(omitted: int, max_bytes: int) -> str:
    """Appended when whole alerts are left out (by the bridge or by Alertmanager)."""
    return f"\n\n**… {_plural(omitted)} not shown** (message limit {max_bytes} bytes)" if omitted else ""


def cut_note(omitted: int, max_bytes: int) -> str:
    """Appended when the first alert itself is cut."""
    more = f"; {_plural(omitted)} not shown" if omitted else ""
    return f"\n\n**… truncated at {max_bytes} bytes{more}**"


# ---------------------------------------------------------------------------- rendering

def _time(t: datetime | None) -> str:
    if t is None or t.year <= 1:  # Alertmanager sends 0001-01-01T00:00:00Z for "no end yet"
        return ""
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return t.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _link(url: str) -> str:
    """An http(s) URL safe inside markdown `[...](url)`, else ""."""
    if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        return ""
    return url.replace(" ", "%20").replace("(", "%28").replace(")", "%29")


def render_context(hook: Webhook, alerts: list[WebhookAlert]) -> dict[str, Any]:
    """What the templates see.

    Group: status ("firing"/"resolved"), alertname (common, else grouped, else the names
    joined), severity (common label or ""), firing, resolved and total (counts over the
    whole group), receiver, group_labels, common_labels, common_annotations, external_url.
    alerts: the alerts shown, each {status, labels, annotations, startsAt, endsAt (UTC text,
    "" while firing), generatorURL ("" unless http/https), fingerprint}.
    """
    names = sorted({a.labels.get("alertname", "") for a in hook.alerts} - {""})
    alertname = hook.common_labels.get("alertname") or hook.group_labels.get("alertname") or ", ".join(names)
    return {
        "status": hook.status, "alertname": alertname or "alert",
        "severity": hook.common_labels.get("severity", ""),
        "firing": sum(a.status == "firing" for a in hook.alerts),
        "resolved": sum(a.status == "resolved" for a in hook.alerts),
        "total": len(hook.alerts) + hook.truncated_alerts, "receiver": hook.receiver,
        "group_labels": hook.group_labels, "common_labels": hook.common_labels,
        "common_annotations": hook.common_annotations, "external_url": hook.external_url,
        "alerts": [{"status": a.status, "labels": a.labels, "annotations": a.annotations,
                    "startsAt": _time(a.starts_at), "endsAt": _time(a.ends_at) if a.status == "resolved" else "",
                    "generatorURL": _link(a.generator_url), "fingerprint": a.fingerprint} for a in alerts],
    }


@dataclass
class Rendered:
    """One robot message: its markdown, how many alerts it shows, and whether it was shortened."""

    text: str
    title: str
    shown: int
    omitted: int  # alerts not shown: left out here plus Alertmanager's truncatedAlerts
    truncated: bool  # the bridge left alerts out or cut the text to fit the limit

    @property
    def bytes(self) -> int:
        return utf8_len(self.text)


class Renderer:
    """The Jinja2 templates, and fitting a rendered message into a byte limit.

    Raises:
        jinja2.TemplateError (from __init__): a template is missing or does not compile.
    """

    NAMES = ("dingtalk.md.j2", "dingtalk.title.j2", "wecom.md.j2")

    def __init__(self, templates_dir: Path | None = None):
        loaders: list[jinja2.BaseLoader] = [jinja2.FileSystemLoader(str(TEMPLATES))]
        if templates_dir is not None:
            loaders.insert(0, jinja2.FileSystemLoader(str(templates_dir)))
        # Markdown, not HTML: no autoescape. Block tags eat their own line.
        self.env = jinja2.Environment(loader=jinja2.ChoiceLoader(loaders), autoescape=False,
                                      trim_blocks=True, lstrip_blocks=True)
        self.templates = {name: self.env.get_template(name) for name in self.NAMES}

    def text(self, name: str, hook: Webhook, alerts: list[WebhookAlert]) -> str:
        return self.templates[name].render(**render_context(hook, alerts)).strip()

    def fit(self, name: str, hook: Webhook, max_bytes: int) -> Rendered:
        """Render `name` within `max_bytes` UTF-8 bytes (module doc, Limits)."""
        n, extra = len(hook.alerts), hook.truncated_alerts

        def attempt(k: int) -> str:
            return self.text(name, hook, hook.alerts[:k]) + omitted_note(n - k + extra, max_bytes)

        full = attempt(n)
        if utf8_len(full) <= max_bytes:
            return Rendered(full, "", n, extra, False)
        best: tuple[str, int] | None = None
        lo, hi = 1, n - 1  # the most leading alerts that fit, by bisection (size grows with k)
        while lo <= hi:
            mid = (lo + hi) // 2
            text = attempt(mid)
            if utf8_len(text) <= max_bytes:
                best, lo = (text, mid), mid + 1
            else:
                hi = mid - 1
        if best is not None:
            return Rendered(best[0], "", best[1], n - best[1] + extra, True)
        note = cut_note(n - 1 + extra, max_bytes)
        body = cut_utf8(self.text(name, hook, hook.alerts[:1]), max_bytes - utf8_len(note))
        return Rendered(body.rstrip() + note, "", 1, n - 1 + extra, True)


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

    def payload(self, renderer: Renderer, hook: Webhook) -> tuple[dict, Rendered]:
        if self.name == "dingtalk":
            r = renderer.fit("dingtalk.md.j2", hook, self.max_bytes)
            r.title = cut_utf8(renderer.text("dingtalk.title.j2", hook, hook.alerts), 256)
            return {"msgtype": "markdown", "markdown": {"title": r.title, "text": r.text}}, r
        r = renderer.fit("wecom.md.j2", hook, self.max_bytes)
        return {"msgtype": "markdown", "markdown": {"content": r.text}}, r


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


class Bridge:
    """The configured robots, the templates and one shared httpx client.

    Raises:
        ValueError: a robot URL is not an http(s) URL (masked in the message), a secret is
            set without its URL, or a template does not compile.
    """

    def __init__(self, section: AlertBridgeSection):
        self.section = section
        self.robots: dict[str, Robot] = {}
        dt_url = section.dingtalk_url.get_secret_value() if section.dingtalk_url else None
        dt_secret = section.dingtalk_secret.get_secret_value() if section.dingtalk_secret else None
        wc_url = section.wecom_url.get_secret_value() if section.wecom_url else None
        for value in (dt_url, wc_url):  # the credentials in the URLs (the rest of a URL may be shown)
            if value:
                parts = urllib.parse.urlsplit(value)
                query = urllib.parse.parse_qsl(parts.query)
                REDACTOR.add(parts.password, *(v for k, v in query if k in ("access_token", "key", "token", "secret")))
        REDACTOR.add(dt_secret)
        if dt_url:
            _check_url("dingtalk_url", dt_url)
            self.robots["dingtalk"] = Robot("dingtalk", dt_url, section.dingtalk_max_bytes, dt_secret or None)
        elif dt_secret:
            raise ValueError("dingtalk_secret: set without dingtalk_url")
        if wc_url:
            _check_url("wecom_url", wc_url)
            self.robots["wecom"] = Robot("wecom", wc_url, section.wecom_max_bytes)
        try:
            self.renderer = Renderer(section.templates_dir)
        except jinja2.TemplateError as e:
            raise ValueError(f"templates_dir: {type(e).__name__}: {e}") from None
        self.client = httpx.Client(timeout=httpx.Timeout(section.timeout_s), follow_redirects=False)

    def close(self) -> None:
        self.client.close()

    def ready(self) -> tuple[bool, str]:
        """The /readyz check: at least one robot configured (names only, never URLs)."""
        if not self.robots:
            return False, "no robot configured: set alertbridge.dingtalk_url and/or alertbridge.wecom_url"
        return True, "robots: " + ", ".join(f"{r.name}{' (signed)' if r.secret else ''}"
                                            for r in self.robots.values())

    def notify(self, robot_name: str, hook: Webhook) -> tuple[int, dict]:
        """Render `hook` for the robot and deliver it. Returns (HTTP status, JSON answer)."""
        robot = self.robots.get(robot_name)
        if robot is None:
            return 404, {"detail": f"robot {robot_name!r} is not configured (set alertbridge.{robot_name}_url)"}
        try:
            payload, rendered = robot.payload(self.renderer, hook)
        except jinja2.TemplateError as e:
            log.error("template failed", extra={"robot": robot_name, "error": f"{type(e).__name__}: {e}"})
            return 500, {"detail": f"{robot_name} template failed: {type(e).__name__}: {e}"}
        if rendered.truncated:
            TRUNCATED.labels(robot_name).inc()
            log.info("message shortened to the robot's limit",
                     extra={"robot": robot_name, "alerts": len(hook.alerts), "shown": rendered.shown,
                            "omitted": rendered.omitted, "bytes": rendered.bytes, "max_bytes": robot.max_bytes})
        body = json.dumps(payload, ensure_ascii=False).encode("utf-8")
        attempts = 0
        t0 = time.perf_counter()

        def once() -> None:
            nonlocal attempts
            attempts += 1
            self._post(robot, body)

        s = self.section
        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(s.retry_attempts),
            wait=tenacity.wait_exponential(multiplier=s.retry_backoff_s, max=s.retry_backoff_max_s),
            retry=tenacity.retry_if_exception(lambda e: isinstance(e, SendError) and e.retry),
            before_sleep=lambda st: log.warning(
                "robot call failed, retrying", extra={"robot": robot_name, "url": robot.masked_url,
                                                      "attempt": st.attempt_number,
                                                      "error": st.outcome.exception().message,
                                                      "wait_s": round(st.next_action.sleep, 3)}),
            reraise=True)
        try:
            retrying(once)
        except SendError as e:
            NOTIFICATIONS.labels(robot_name, e.outcome).inc()
            log.warning("alert notification failed",
                        extra={"robot": robot_name, "url": robot.masked_url, "outcome": e.outcome,
                               "attempts": attempts, "error": e.message, "alerts": len(hook.alerts)})
            return e.status, {"detail": e.message, "robot": robot_name, "outcome": e.outcome, "attempts": attempts}
        finally:
            SEND_SECONDS.labels(robot_name).observe(time.perf_counter() - t0)
        NOTIFICATIONS.labels(robot_name, "sent").inc()
        answer = {"robot": robot_name, "outcome": "sent", "alerts": len(hook.alerts), "shown": rendered.shown,
                  "omitted": rendered.omitted, "truncated": rendered.truncated, "bytes": rendered.bytes,
                  "attempts": attempts}
        log.info("alert notification sent", extra={"url": robot.masked_url, "status": hook.status, **answer})
        return 200, answer

    def _post(self, robot: Robot, body: bytes) -> None:
        """One attempt. Raises SendError (module doc, Delivery: what is retried)."""
        name, t = robot.name, self.section.timeout_s
        try:
            r = self.client.post(robot.request_url(), content=body,
                                 headers={"content-type": "application/json; charset=utf-8"})
        except httpx.ConnectTimeout:
            raise SendError("timeout", 504, f"{name} robot: no connection within {t} s", retry=True) from None
        except httpx.TimeoutException as e:
            raise SendError("timeout", 504, f"{name} robot did not answer within {t} s ({type(e).__name__})") \
                from None
        except httpx.HTTPError as e:  # nothing was delivered only when the connection failed
            raise SendError("http_error", 502, f"{name} robot unreachable: {type(e).__name__}: {redact(str(e))}",
                            retry=isinstance(e, httpx.ConnectError)) from None
        if r.status_code != 200:
            snippet = redact(r.text[:200]) if r.text else ""
            raise SendError("http_error", 502, f"{name} robot answered HTTP {r.status_code}"
                                               f"{': ' + snippet if snippet else ''}", retry=r.status_code >= 500)
        try:
            answer = r.json()
            errcode = int(answer["errcode"])
        except (ValueError, KeyError, TypeError):
            raise SendError("http_error", 502, f"{name} robot answered 200 without a JSON errcode: "
                                               f"{redact(r.text[:200])!r}") from None
        if errcode != 0:
            errmsg = redact(str(answer.get("errmsg", "")))[:500]
            raise SendError("robot_error", 502, f"{name} robot answered errcode {errcode}: {errmsg}",
                            retry=errcode == robot.rate_limit_code)


# ---------------------------------------------------------------------------- HTTP, main

def add_routes(app, bridge: Bridge) -> None:
    """`POST /alert/dingtalk` and `POST /alert/wecom` on `app`, answered by `bridge`."""
    limit = bridge.section.max_webhook_bytes

    def route(robot: str):
        async def receive(request: Request) -> JSONResponse:
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    return JSONResponse({"detail": f"webhook body above max_webhook_bytes {limit}"}, 413)
                chunks.append(chunk)
            try:
                hook = parse_webhook(b"".join(chunks))
            except WebhookRejected as e:
                log.warning("webhook refused", extra={"robot": robot, "status": e.status, "error": str(e)})
                return JSONResponse({"detail": str(e)}, e.status)
            status, answer = await run_in_threadpool(bridge.notify, robot, hook)  # blocking httpx + retries
            return JSONResponse(answer, status)

        receive.__name__ = f"alert_{robot}"
        return receive

    for robot in ROBOTS:
        app.add_api_route(f"/alert/{robot}", route(robot), methods=["POST"])


def main(argv: list[str]) -> int:
    cfg = load(AlertBridgeConfig, argv, prog="steadyrl-alertbridge")
    from steadyrl.config import ConfigError
    from steadyrl.service import run_service

    try:
        bridge = Bridge(cfg.alertbridge)
    except ValueError as e:  # messages carry masked URLs only
        raise ConfigError(f"invalid AlertBridgeConfig:\n  alertbridge.{e}") from None

    def build(health):
        health.add_check("robots", bridge.ready)
        log.info("alert bridge robots", extra={"robots": {n: r.masked_url for n, r in bridge.robots.items()},
                                                "signed": bool(cfg.alertbridge.dingtalk_secret)})

        class Idle:
            def run(self, stop: threading.Event) -> None:
                while not stop.wait(1.0):
                    health.beat()

        health.beat()
        return Idle()

    try:
        return run_service("alertbridge", cfg, build, extra_routes=lambda app: add_routes(app, bridge))
    finally:
        bridge.close()


if __name__ == "__main__":
    from steadyrl.service import main_guard

    main_guard(main)

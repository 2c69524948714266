"""Alert bridge: Alertmanager webhooks in, DingTalk and WeCom group-robot markdown out.

Alertmanager's generic webhook receiver posts a group of alerts as JSON; Chinese chat tools
take group-robot messages in their own formats. This service sits between the two:

    Alertmanager ──POST /alert/dingtalk──▶ alertbridge ──POST (signed)──▶ DingTalk robot
                 ──POST /alert/wecom─────▶             ──POST──────────▶ WeCom robot

Run: `python -m steadyrl.services.alertbridge` (binds 127.0.0.1:8500; `--metrics-host 0.0.0.0` in a
container). Besides the two routes it serves `/livez`, `/readyz` (check `robots`: 503 when
no robot is configured) and `/metrics`, like every steadyrl service (steadyrl.service).

Routes
    `POST /alert/dingtalk`, `POST /alert/wecom`: body = Alertmanager webhook JSON, version
    "4" (`Webhook`). Answers
      200  {"robot", "outcome": "sent", "alerts", "shown", "omitted", "truncated", "bytes", "attempts"},
           or {"robot", "outcome": "held", "alerts", "critical", "held"} over the quota (Quota)
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
    generatorURL as a link (only http/https URLs). Alert-supplied text is shown as text:
    its markdown characters become their full-width forms (render.py `md_text`), so an
    alert cannot post a link, an image, a heading or HTML to the chat.

Quota
    A robot takes `dingtalk_per_minute` / `wecom_per_minute` messages a minute (20: both
    robots' documented limit; DingTalk throttles a robot for 10 minutes past it). The bridge
    counts its sends in a sliding 60 s window and never exceeds it: the last
    `critical_reserve` (5) messages of a window go only to critical notifications (an alert
    whose severity label is in `critical_severities`: critical, P0, page). A notification
    that finds no message for it is held (answered 200 `"outcome": "held"`, so Alertmanager
    does not retry it) and counted per (severity, alertname, status); every second the
    service sends what is held as one summary, critical first, as soon as the window allows.
    So a flood of alerts costs at most the quota, and critical alerts still get through.

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
    http_error, timeout, held), `steadyrl_alertbridge_send_seconds{robot}` (one notification, all
    attempts and waits included), `steadyrl_alertbridge_truncated_total{robot}`.

Modules
    config.py (settings, the webhook model), render.py (templates, fitting a byte limit),
    robots.py (Robot, signing, redaction of secrets), this one (Bridge: delivery, metrics,
    routes, main). Every name of them is importable from here.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import httpx
import jinja2
import tenacity
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import Counter, Histogram
from starlette.concurrency import run_in_threadpool

from steadyrl.config import ConfigError, load
from steadyrl.http import unauthorized
from steadyrl.service import run_service

# Re-exported: tests and the docs name these as steadyrl.services.alertbridge.bridge.X.
from .config import (  # noqa: F401
    AlertBridgeConfig,
    AlertBridgeSection,
    Webhook,
    WebhookAlert,
    WebhookRejected,
    parse_webhook,
)
from .render import (  # noqa: F401
    TEMPLATES,
    Rendered,
    Renderer,
    cut_note,
    cut_utf8,
    omitted_note,
    render_context,
    utf8_len,
)
from .robots import (  # noqa: F401
    RATE_LIMIT_CODES,
    REDACTOR,
    ROBOTS,
    Held,
    Quota,
    Robot,
    SendError,
    _check_url,
    dingtalk_sign,
    mask_url,
    redact,
    signed_url,
)

if TYPE_CHECKING:
    from steadyrl.http import Health
    from steadyrl.service import Loop

log = logging.getLogger("steadyrl.alertbridge")

OUTCOMES = ("sent", "robot_error", "http_error", "timeout", "held")

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


# ---------------------------------------------------------------------------- the bridge

class Bridge:
    """The configured robots, the templates and one shared httpx client.

    Raises:
        ValueError: a robot URL is not an http(s) URL (masked in the message), a secret is
            set without its URL, or a template does not compile.
    """

    def __init__(self, section: AlertBridgeSection, clock: Callable[[], float] = time.monotonic):
        self.section = section
        self.robots: dict[str, Robot] = {}
        self.quotas = {name: Quota(getattr(section, f"{name}_per_minute"), clock) for name in ROBOTS}
        self.held = {name: Held() for name in ROBOTS}
        self.lock = threading.Lock()   # quotas and held: notify runs on several threads
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

    def critical(self, hook: Webhook) -> bool:
        """Whether `hook` carries an alert of a critical severity (`critical_severities`)."""
        levels = set(self.section.critical_severities)
        return hook.common_labels.get("severity") in levels or any(a.labels.get("severity") in levels
                                                                    for a in hook.alerts)

    def _admit(self, robot_name: str, critical: bool) -> bool:
        """Take one of the robot's messages this minute, if this notification may have it: the
        last `critical_reserve` of them only for critical ones. Caller holds the lock."""
        free = self.quotas[robot_name].available()
        if free > self.section.critical_reserve or (critical and free > 0):
            self.quotas[robot_name].take()
            return True
        return False

    def notify(self, robot_name: str, hook: Webhook) -> tuple[int, dict[str, Any]]:
        """Render `hook` for the robot and deliver it, or hold it (module doc, Quota). Returns
        (HTTP status, JSON answer)."""
        robot = self.robots.get(robot_name)
        if robot is None:
            return 404, {"detail": f"robot {robot_name!r} is not configured (set alertbridge.{robot_name}_url)"}
        critical = self.critical(hook)
        with self.lock:
            admitted = self._admit(robot_name, critical)
            if not admitted:
                self.held[robot_name].add(hook, critical)
                held = self.held[robot_name].notifications
        if not admitted:   # 200: Alertmanager must not retry it; the summary will carry it
            NOTIFICATIONS.labels(robot_name, "held").inc()
            log.warning("alert notification held: over the robot's quota",
                        extra={"robot": robot_name, "critical": critical, "alerts": len(hook.alerts), "held": held})
            return 200, {"robot": robot_name, "outcome": "held", "alerts": len(hook.alerts), "critical": critical,
                         "held": held}
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
        status, answer = self._deliver(robot, payload, len(hook.alerts))
        if status != 200:
            return status, answer
        answer = {"robot": robot_name, "outcome": "sent", "alerts": len(hook.alerts), "shown": rendered.shown,
                  "omitted": rendered.omitted, "truncated": rendered.truncated, "bytes": rendered.bytes,
                  "attempts": answer["attempts"]}
        log.info("alert notification sent", extra={"url": robot.masked_url, "status": hook.status, **answer})
        return 200, answer

    def flush(self) -> tuple[int, dict[str, Any]] | None:
        """Send each robot's held notifications as one summary when its quota allows (critical
        ones may use the reserve). Called every second by the service loop; returns the last
        delivery's (status, answer), or None when nothing was sent."""
        result: tuple[int, dict[str, Any]] | None = None
        for name, robot in self.robots.items():
            with self.lock:
                held = self.held[name]
                if not held.notifications or not self._admit(name, held.critical):
                    continue
                self.held[name] = Held()
            payload = held.summary(robot, self.quotas[name].per_minute, self.section.critical_severities)
            result = self._deliver(robot, payload, sum(held.counts.values()))
            log.info("held notifications sent as a summary",
                     extra={"robot": name, "notifications": held.notifications, "status": result[0]})
        return result

    def _deliver(self, robot: Robot, payload: dict[str, Any], alerts: int) -> tuple[int, dict[str, Any]]:
        """POST `payload` with the retry policy (module doc, Delivery); (200, {"attempts"}) or
        the failure's (status, answer)."""
        robot_name = robot.name
        body = json.dumps(payload, ensure_ascii=False).encode("utf-8")
        attempts = 0
        t0 = time.perf_counter()

        def once() -> None:
            nonlocal attempts
            attempts += 1
            self._post(robot, body)

        def log_retry(st: tenacity.RetryCallState) -> None:
            # tenacity calls before_sleep after an attempt it retries: `retry` below retries a
            # SendError only, and the outcome and the next wait are set by then
            assert st.outcome is not None and st.next_action is not None
            error = st.outcome.exception()
            assert isinstance(error, SendError)
            log.warning("robot call failed, retrying",
                        extra={"robot": robot_name, "url": robot.masked_url, "attempt": st.attempt_number,
                               "error": error.message, "wait_s": round(st.next_action.sleep, 3)})

        s = self.section
        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(s.retry_attempts),
            wait=tenacity.wait_exponential(multiplier=s.retry_backoff_s, max=s.retry_backoff_max_s),
            retry=tenacity.retry_if_exception(lambda e: isinstance(e, SendError) and e.retry),
            before_sleep=log_retry,
            reraise=True)
        try:
            retrying(once)
        except SendError as e:
            NOTIFICATIONS.labels(robot_name, e.outcome).inc()
            log.warning("alert notification failed",
                        extra={"robot": robot_name, "url": robot.masked_url, "outcome": e.outcome,
                               "attempts": attempts, "error": e.message, "alerts": alerts})
            return e.status, {"detail": e.message, "robot": robot_name, "outcome": e.outcome, "attempts": attempts}
        finally:
            SEND_SECONDS.labels(robot_name).observe(time.perf_counter() - t0)
        NOTIFICATIONS.labels(robot_name, "sent").inc()
        return 200, {"attempts": attempts}

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

def add_routes(app: FastAPI, bridge: Bridge, token: str | None = None) -> None:
    """`POST /alert/dingtalk` and `POST /alert/wecom` on `app`, answered by `bridge`; with
    `token` (alertbridge.token_file: the alert routes' own token, never the stack's work token),
    401 without `Authorization: Bearer <token>` (Alertmanager's webhook_configs
    `http_config.authorization.credentials_file` sends it)."""
    limit = bridge.section.max_webhook_bytes

    def route(robot: str) -> Callable[[Request], Awaitable[JSONResponse]]:
        async def receive(request: Request) -> JSONResponse:
            refusal = unauthorized(request, token, "alertbridge.token_file")
            if refusal is not None:
                log.warning("webhook refused", extra={"robot": robot, "status": 401})
                return refusal
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
    try:
        bridge = Bridge(cfg.alertbridge)
    except ValueError as e:  # messages carry masked URLs only
        raise ConfigError(f"invalid AlertBridgeConfig:\n  alertbridge.{e}") from None

    def build(health: Health) -> Loop:
        health.add_check("robots", bridge.ready)
        log.info("alert bridge robots", extra={"robots": {n: r.masked_url for n, r in bridge.robots.items()},
                                                "signed": bool(cfg.alertbridge.dingtalk_secret)})

        class Idle:
            def run(self, stop: threading.Event) -> None:
                while not stop.wait(1.0):
                    health.beat()
                    bridge.flush()   # held notifications, once the quota allows

        health.beat()
        return Idle()

    try:
        token = cfg.alertbridge.token()   # the alert routes' own (http_token_file is refused: config.py)
        return run_service("alertbridge", cfg, build, extra_routes=lambda app: add_routes(app, bridge, token))
    finally:
        bridge.close()



if __name__ == "__main__":
    from steadyrl.service import main_guard

    main_guard(main)

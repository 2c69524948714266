"""The alert bridge over HTTP on 127.0.0.1: Alertmanager webhooks in, DingTalk and WeCom robot
markdown out to a fake robot that records every request and answers as a test scripts it
(errcode 0, an error code, the rate-limit code, HTTP 500, or a hang)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import threading
import time
import urllib.parse
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from steadyrl.config import ConfigError, load
from steadyrl.http import Health, HealthServer, make_app
from steadyrl.logs import JsonFormatter
from steadyrl.services.alertbridge.bridge import (
    AlertBridgeConfig,
    AlertBridgeSection,
    Bridge,
    Webhook,
    add_routes,
    cut_utf8,
    mask_url,
)

DT_TOKEN = "dt0k3n5ecret9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3"
DT_SECRET = "SECf00dfacecafebabe1234567890abcdef1234567890abcdef1234567890ab"
WC_KEY = "693a91f6-7xxx-4bc4-97a0-0ec2sifa5aaa"
SECRETS = (DT_TOKEN, DT_SECRET, WC_KEY)


class FakeRobot:
    """A group robot on 127.0.0.1. `then(*answers)` queues answers, one per request, before
    the default {"errcode": 0}: a dict (sent as JSON with 200), an int (that HTTP status),
    or "hang" (no answer until the robot stops). Records (path, raw query, body) of each."""

    def __init__(self):
        self.requests: list[dict] = []
        self.answers: deque = deque()
        self._stop = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                raw = self.rfile.read(int(self.headers["content-length"]))
                path, _, query = self.path.partition("?")
                outer.requests.append({"path": path, "query": query, "raw": raw,
                                       "body": json.loads(raw.decode("utf-8")),  # strict: bad UTF-8 fails
                                       "content_type": self.headers.get("content-type")})
                answer = outer.answers.popleft() if outer.answers else {"errcode": 0, "errmsg": "ok"}
                if answer == "hang":
                    outer._stop.wait(30)
                    return
                status, body = (answer, {"errcode": -1, "errmsg": "server error"}) if isinstance(answer, int) \
                    else (200, answer)
                data = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def then(self, *answers) -> None:
        self.answers.extend(answers)

    def stop(self) -> None:
        self._stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def robot():
    r = FakeRobot()
    yield r
    r.stop()


def _section(robot: FakeRobot, **kw) -> AlertBridgeSection:
    base = {"dingtalk_url": f"{robot.url}/robot/send?access_token={DT_TOKEN}", "dingtalk_secret": DT_SECRET,
                "wecom_url": f"{robot.url}/cgi-bin/webhook/send?key={WC_KEY}", "timeout_s": 0.5,
                "retry_attempts": 3, "retry_backoff_s": 0.01, "retry_backoff_max_s": 0.05}
    return AlertBridgeSection(**{**base, **kw})


class Served:
    """The bridge's routes on the service runtime's app (steadyrl.http), uvicorn on a free port."""

    def __init__(self, section: AlertBridgeSection):
        self.bridge = Bridge(section)
        health = Health()
        health.add_check("robots", self.bridge.ready)
        app = make_app("alertbridge", health)
        add_routes(app, self.bridge)
        self.server = HealthServer(app, "127.0.0.1", 0).start()
        self.url = self.server.url

    def post(self, robot: str, hook) -> httpx.Response:
        body = hook if isinstance(hook, (bytes, str)) else json.dumps(hook)
        return httpx.post(f"{self.url}/alert/{robot}", content=body, timeout=10,
                          headers={"content-type": "application/json"})

    def metric(self, name: str, **labels) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        return 0.0

    def stop(self) -> None:
        self.server.stop()
        self.bridge.close()


@pytest.fixture
def bridge(robot):
    s = Served(_section(robot))
    yield s
    s.stop()


def alert(i: int = 0, status: str = "firing", **annotations) -> dict:
    return {"status": status,
            "labels": {"alertname": "KLDrift", "severity": "warning", "job": "learner",
                       "instance": f"learner-{i}:8400"},
            "annotations": annotations or {"summary": f"KL drift on learner-{i}",
                                           "description": "slope 0.02/step over 10m, trend p=0.003"},
            "startsAt": "2025-03-01T10:00:00.5Z",
            "endsAt": "2025-03-01T10:30:00Z" if status == "resolved" else "0001-01-01T00:00:00Z",
            "generatorURL": f"http://prometheus:9090/graph?g0.expr=steadyrl_kl%3E0.1&i={i}",
            "fingerprint": f"f{i}"}


def webhook(*alerts: dict, status: str = "firing", **kw) -> dict:
    return {"version": "4", "groupKey": '{}:{alertname="KLDrift"}', "truncatedAlerts": 0, "status": status,
            "receiver": "robots", "groupLabels": {"alertname": "KLDrift"},
            "commonLabels": {"alertname": "KLDrift", "severity": "warning", "job": "learner"},
            "commonAnnotations": {}, "externalURL": "http://alertmanager:9093",
            "alerts": list(alerts) or [alert()], **kw}


def sent_text(req: dict) -> str:
    md = req["body"]["markdown"]
    return md.get("text", md.get("content"))


# ------------------------------------------------------------------------------ rendering, signing

def test_dingtalk_markdown_shows_the_alert_fields_and_is_signed(robot, bridge):
    hook = webhook(alert(0), alert(1, "resolved", summary="KL back to normal"))
    before_ms = int(time.time() * 1000)
    r = bridge.post("dingtalk", hook)
    assert r.status_code == 200, r.text
    assert r.json() | {"bytes": 0} == {"robot": "dingtalk", "outcome": "sent", "alerts": 2, "shown": 2, "omitted": 0,
                                       "truncated": False, "bytes": 0, "attempts": 1}
    [req] = robot.requests
    assert req["path"] == "/robot/send" and req["content_type"].startswith("application/json")
    body = req["body"]
    assert body["msgtype"] == "markdown" and body["markdown"]["title"] == "[FIRING:1] KLDrift"
    text = body["markdown"]["text"]
    for part in ("[FIRING:1] KLDrift", "**severity:** warning", "1. FIRING · KLDrift · warning",
                 "> KL drift on learner-0", "slope 0.02/step over 10m, trend p=0.003", "**job:** learner",
                 "**instance:** learner-0:8400", "**startsAt:** 2025-03-01 10:00:00 UTC",
                 "[source](http://prometheus:9090/graph?g0.expr=steadyrl_kl%3E0.1&i=0)",
                 "2. RESOLVED · KLDrift", "> KL back to normal", "**instance:** learner-1:8400",
                 "**endsAt:** 2025-03-01 10:30:00 UTC"):
        assert part in text, (part, text)
    assert text.count("endsAt") == 1  # a firing alert has no end yet

    # DingTalk 加签: sign = urlencode(base64(HMAC-SHA256(secret, f"{timestamp}\n{secret}")))
    q = urllib.parse.parse_qs(req["query"], strict_parsing=True)
    assert q["access_token"] == [DT_TOKEN]
    ts = int(q["timestamp"][0])
    assert before_ms - 1000 <= ts <= int(time.time() * 1000) + 1000
    expected = base64.b64encode(hmac.new(DT_SECRET.encode(), f"{ts}\n{DT_SECRET}".encode(), hashlib.sha256).digest())
    assert q["sign"] == [expected.decode()]
    assert f"&sign={urllib.parse.quote_plus(expected.decode())}" in req["query"]  # URL-encoded once, exactly


def test_unsigned_dingtalk_without_a_secret(robot):
    s = Served(_section(robot, dingtalk_secret=None))
    try:
        assert s.post("dingtalk", webhook()).status_code == 200
        assert urllib.parse.parse_qs(robot.requests[0]["query"]) == {"access_token": [DT_TOKEN]}
    finally:
        s.stop()


def test_wecom_markdown_content(robot, bridge):
    r = bridge.post("wecom", webhook(alert(0), alert(1, "resolved", summary="KL back to normal"), status="resolved"))
    assert r.status_code == 200, r.text
    [req] = robot.requests
    assert req["path"] == "/cgi-bin/webhook/send" and urllib.parse.parse_qs(req["query"]) == {"key": [WC_KEY]}
    assert set(req["body"]) == {"msgtype", "markdown"} and req["body"]["msgtype"] == "markdown"
    assert set(req["body"]["markdown"]) == {"content"}
    content = req["body"]["markdown"]["content"]
    for part in ('<font color="info">[RESOLVED] KLDrift</font>', "**FIRING** KLDrift", "**RESOLVED** KLDrift",
                 "> KL drift on learner-0", "> slope 0.02/step over 10m", "job: `learner`",
                 "instance: `learner-1:8400`", "startsAt: 2025-03-01 10:00:00 UTC",
                 "endsAt: 2025-03-01 10:30:00 UTC",
                 "[source](http://prometheus:9090/graph?g0.expr=steadyrl_kl%3E0.1&i=1)"):
        assert part in content, (part, content)


# ------------------------------------------------------------------------------ size limits

def _padded(n: int, pad: int, fill: str = "x") -> dict:
    """n alerts; the last one's summary padded with `pad` copies of `fill`."""
    alerts = [alert(i) for i in range(n)]
    alerts[-1]["annotations"]["summary"] += fill * pad
    return webhook(*alerts)


@pytest.mark.parametrize("robot_name, limit", [("wecom", 4096), ("dingtalk", 20000)])
def test_at_the_limit_untouched_one_byte_over_drops_an_alert_with_a_note(robot, bridge, robot_name, limit):
    template = "wecom.md.j2" if robot_name == "wecom" else "dingtalk.md.j2"
    n = 8 if robot_name == "wecom" else 30
    base = bridge.bridge.renderer.fit(template, Webhook.model_validate(_padded(n, 0)), 10**9).bytes
    assert base < limit
    exact = _padded(n, limit - base)
    parsed = Webhook.model_validate(exact)
    full = bridge.bridge.renderer.text(template, parsed, parsed.alerts)
    assert len(full.encode()) == limit
    truncated_before = bridge.metric("steadyrl_alertbridge_truncated_total", robot=robot_name)

    r = bridge.post(robot_name, exact)
    assert r.status_code == 200 and r.json()["truncated"] is False and r.json()["bytes"] == limit
    assert sent_text(robot.requests[-1]) == full  # untouched
    assert bridge.metric("steadyrl_alertbridge_truncated_total", robot=robot_name) == truncated_before

    r = bridge.post(robot_name, _padded(n, limit - base + 1))
    assert r.status_code == 200, r.text
    answer, text = r.json(), sent_text(robot.requests[-1])
    assert answer["truncated"] is True and answer["shown"] == n - 1 and answer["omitted"] == 1
    assert len(text.encode()) <= limit and text.endswith(f"**… 1 more alert not shown** (message limit {limit} bytes)")
    assert f"learner-{n - 2}:8400" in text and f"learner-{n - 1}:8400" not in text
    assert bridge.metric("steadyrl_alertbridge_truncated_total", robot=robot_name) == truncated_before + 1


def test_many_alerts_keep_the_leading_ones_and_count_the_rest(robot, bridge):
    hook = webhook(*[alert(i) for i in range(300)], truncatedAlerts=5)
    r = bridge.post("dingtalk", hook)
    assert r.status_code == 200
    a, text = r.json(), sent_text(robot.requests[-1])
    assert len(text.encode()) <= 20000 and a["bytes"] == len(text.encode())
    assert 10 < a["shown"] < 300 and a["omitted"] == 300 - a["shown"] + 5  # Alertmanager's own cut counts too
    assert text.endswith(f"**… {a['omitted']} more alerts not shown** (message limit 20000 bytes)")
    assert f"learner-{a['shown'] - 1}:8400" in text and f"learner-{a['shown']}:8400" not in text


@pytest.mark.parametrize("shift", [0, 1, 2])
def test_one_huge_alert_is_cut_on_a_character_boundary(robot, bridge, shift):
    """3- and 4-byte characters; `shift` ASCII bytes move the cut across every position of a character."""
    huge = alert(0, summary="x" * shift + "漂移告警🔥" * 800, description="说明")
    hook = webhook(huge, alert(1))
    parsed = Webhook.model_validate(hook)
    full = bridge.bridge.renderer.text("wecom.md.j2", parsed, parsed.alerts[:1])
    assert len(full.encode()) > 4096
    r = bridge.post("wecom", hook)
    assert r.status_code == 200, r.text
    text = sent_text(robot.requests[-1])  # the fake robot decoded the request body as strict UTF-8
    note = "\n\n**… truncated at 4096 bytes; 1 more alert not shown**"
    assert text.endswith(note) and len(text.encode()) <= 4096
    kept = text[: -len(note)]
    assert full.startswith(kept) and len(kept.encode()) > 4096 - len(note.encode()) - 4  # at most one char lost
    assert "\ufffd" not in text and r.json() | {"bytes": 0} == {
        "robot": "wecom", "outcome": "sent", "alerts": 2, "shown": 1, "omitted": 1, "truncated": True, "bytes": 0,
        "attempts": 1}


def test_cut_utf8_never_splits_a_character():
    s = "a漂🔥é"
    assert [cut_utf8(s, n) for n in range(11)] == ["", "a", "a", "a", "a漂", "a漂", "a漂", "a漂", "a漂🔥", "a漂🔥",
                                                   "a漂🔥é"]


# ------------------------------------------------------------------------------ robot answers

def test_errcode_is_a_502_with_the_robot_errmsg_and_not_retried(robot, bridge):
    before = bridge.metric("steadyrl_alertbridge_notifications_total", robot="dingtalk", outcome="robot_error")
    robot.then({"errcode": 310000, "errmsg": "keywords not in content, more: [...]"})
    r = bridge.post("dingtalk", webhook())
    assert r.status_code == 502
    assert r.json()["detail"] == "dingtalk robot answered errcode 310000: keywords not in content, more: [...]"
    assert r.json()["outcome"] == "robot_error" and len(robot.requests) == 1
    assert bridge.metric("steadyrl_alertbridge_notifications_total", robot="dingtalk",
                         outcome="robot_error") == before + 1


@pytest.mark.parametrize("robot_name, code", [("dingtalk", 130101), ("wecom", 45009)])
def test_rate_limit_is_retried_with_backoff(robot, bridge, robot_name, code):
    sent = bridge.metric("steadyrl_alertbridge_notifications_total", robot=robot_name, outcome="sent")
    robot.then({"errcode": code, "errmsg": "send too fast"})
    r = bridge.post(robot_name, webhook())
    assert r.status_code == 200 and r.json()["attempts"] == 2 and len(robot.requests) == 2
    assert robot.requests[0]["body"] == robot.requests[1]["body"]
    if robot_name == "dingtalk":  # each attempt is signed afresh
        assert all("sign" in urllib.parse.parse_qs(q["query"]) for q in robot.requests)
    assert bridge.metric("steadyrl_alertbridge_notifications_total", robot=robot_name, outcome="sent") == sent + 1


def test_rate_limit_that_persists_gives_up_after_the_attempts(robot, bridge):
    robot.then(*[{"errcode": 45009, "errmsg": "api freq out of limit"}] * 3)
    r = bridge.post("wecom", webhook())
    assert r.status_code == 502 and r.json()["attempts"] == 3 and len(robot.requests) == 3
    assert r.json()["detail"] == "wecom robot answered errcode 45009: api freq out of limit"


def test_5xx_is_retried_then_a_502(robot, bridge):
    robot.then(500)
    assert bridge.post("wecom", webhook()).status_code == 200 and len(robot.requests) == 2
    before = bridge.metric("steadyrl_alertbridge_notifications_total", robot="wecom", outcome="http_error")
    robot.then(503, 503, 503)
    r = bridge.post("wecom", webhook())
    assert r.status_code == 502 and r.json()["detail"].startswith("wecom robot answered HTTP 503")
    assert len(robot.requests) == 5
    assert bridge.metric("steadyrl_alertbridge_notifications_total", robot="wecom", outcome="http_error") == before + 1


def test_4xx_is_a_502_without_retry(robot, bridge):
    robot.then(404)
    r = bridge.post("wecom", webhook())
    assert r.status_code == 502 and "HTTP 404" in r.json()["detail"] and len(robot.requests) == 1


def test_a_hanging_robot_is_a_504_without_retry(robot, bridge):
    before = bridge.metric("steadyrl_alertbridge_notifications_total", robot="dingtalk", outcome="timeout")
    robot.then("hang")
    t0 = time.monotonic()
    r = bridge.post("dingtalk", webhook())
    assert r.status_code == 504 and r.json()["outcome"] == "timeout"
    assert r.json()["detail"] == "dingtalk robot did not answer within 0.5 s (ReadTimeout)"
    assert 0.4 < time.monotonic() - t0 < 3 and len(robot.requests) == 1  # may have posted: not sent twice
    assert bridge.metric("steadyrl_alertbridge_notifications_total", robot="dingtalk", outcome="timeout") == before + 1
    assert bridge.metric("steadyrl_alertbridge_send_seconds_count", robot="dingtalk") >= 1


def test_an_unreachable_robot_is_retried_then_a_502(robot):
    closed = FakeRobot()
    closed.stop()  # nothing listens on its port any more
    s = Served(_section(robot, wecom_url=f"{closed.url}/cgi-bin/webhook/send?key={WC_KEY}"))
    try:
        r = s.post("wecom", webhook())
        assert r.status_code == 502 and r.json()["attempts"] == 3
        assert r.json()["detail"].startswith("wecom robot unreachable: ConnectError")
    finally:
        s.stop()


# ------------------------------------------------------------------------------ the webhook side

@pytest.mark.parametrize("body, status, words", [
    (b"{not json", 400, "body is not JSON"),
    (json.dumps({"version": "4", "status": "firing"}), 422, "alerts: Field required"),
    (json.dumps(webhook(version="3")), 422, "version: Input should be '4'"),
    (json.dumps(webhook(alerts=[])), 422, "alerts: List should have at least 1 item"),
    (json.dumps(webhook(alert() | {"startsAt": "yesterday"})), 422, "alerts.0.startsAt"),
    (json.dumps(webhook(alert() | {"status": "pending"})), 422,
     "alerts.0.status: Input should be 'firing' or 'resolved'"),
    (json.dumps([1, 2]), 422, "not an Alertmanager webhook (version 4)"),
])
def test_malformed_webhooks_are_refused_with_a_message(robot, bridge, body, status, words):
    r = bridge.post("dingtalk", body)
    assert r.status_code == status and words in r.json()["detail"], r.text
    assert robot.requests == []


def test_unconfigured_robot_is_404_and_readyz(robot):
    s = Served(_section(robot, wecom_url=None))
    try:
        r = s.post("wecom", webhook())
        assert r.status_code == 404 and "alertbridge.wecom_url" in r.json()["detail"]
        ready = httpx.get(f"{s.url}/readyz").json()
        assert ready["ready"] is True and ready["checks"]["robots"]["detail"] == "robots: dingtalk (signed)"
    finally:
        s.stop()
    none = Served(AlertBridgeSection())
    try:
        assert httpx.get(f"{none.url}/readyz").status_code == 503
    finally:
        none.stop()


def test_webhook_above_the_size_limit_is_413(robot):
    s = Served(_section(robot, max_webhook_bytes=2048))
    try:
        r = s.post("wecom", webhook(*[alert(i) for i in range(20)]))
        assert r.status_code == 413 and "max_webhook_bytes 2048" in r.json()["detail"]
    finally:
        s.stop()


def test_templates_dir_replaces_a_template_and_a_broken_one_is_a_config_error(robot, tmp_path):
    (tmp_path / "wecom.md.j2").write_text("ALERT {{ alertname }} x{{ total }}: "
                                          "{% for a in alerts %}{{ a.labels.instance }} {% endfor %}")
    s = Served(_section(robot, templates_dir=tmp_path))
    try:
        assert s.post("wecom", webhook(alert(0), alert(1))).status_code == 200
        assert sent_text(robot.requests[-1]) == "ALERT KLDrift x2: learner-0:8400 learner-1:8400"
        assert s.post("dingtalk", webhook()).status_code == 200  # the others stay the built-in ones
        assert sent_text(robot.requests[-1]).startswith("### 🔥 [FIRING:1] KLDrift")
    finally:
        s.stop()
    (tmp_path / "wecom.md.j2").write_text("{% for a in alerts %}")
    with pytest.raises(ValueError, match="templates_dir: TemplateSyntaxError"):
        Bridge(_section(robot, templates_dir=tmp_path))


# ------------------------------------------------------------------------------ secrets

def test_secrets_never_in_logs_answers_or_metrics(robot, bridge, caplog):
    caplog.set_level(logging.DEBUG)  # httpx logs every request URL at INFO, httpcore details at DEBUG
    robot.then({"errcode": 130101, "errmsg": f"send too fast, token {DT_TOKEN}"}, {"errcode": 0})
    answers = [bridge.post("dingtalk", webhook())]
    robot.then({"errcode": 310000, "errmsg": f"sign not match for key={WC_KEY}"}, "hang")
    answers += [bridge.post("wecom", webhook()), bridge.post("dingtalk", webhook()), bridge.post("wecom", b"{")]
    assert [a.status_code for a in answers] == [200, 502, 504, 400]
    assert answers[1].json()["detail"] == "wecom robot answered errcode 310000: sign not match for key=***"

    assert any(r.name == "httpx" for r in caplog.records)  # the request lines were there, redacted
    fmt = JsonFormatter("alertbridge")
    logged = caplog.text + "\n".join(fmt.format(r) for r in caplog.records)
    assert "access_token=***" in logged and "sign=***" in logged
    exposed = logged + "".join(a.text for a in answers) + httpx.get(f"{bridge.url}/metrics").text
    exposed += repr(bridge.bridge.robots) + repr(bridge.bridge.section)
    for secret in SECRETS:
        assert secret not in exposed
    assert mask_url(f"https://u:pw@x/send?access_token={DT_TOKEN}&timestamp=1&sign=a%2B") == \
        "https://***@x/send?access_token=***&timestamp=1&sign=***"


# ------------------------------------------------------------------------------ config, process

def test_config_defaults_env_overrides_and_masked_errors(monkeypatch):
    cfg = load(AlertBridgeConfig, [])
    assert (cfg.metrics_host, cfg.metrics_port) == ("127.0.0.1", 8500)
    assert (cfg.alertbridge.dingtalk_max_bytes, cfg.alertbridge.wecom_max_bytes) == (20000, 4096)
    monkeypatch.setenv("STEADYRL_ALERTBRIDGE__WECOM_URL",
                       f"https://qyapi.weixin.qq.com/cgi-bin/webhook/send?key={WC_KEY}")
    monkeypatch.setenv("STEADYRL_ALERTBRIDGE__DINGTALK_SECRET", DT_SECRET)
    monkeypatch.setenv("STEADYRL_ALERTBRIDGE__TIMEOUT_S", "2.5")
    cfg = load(AlertBridgeConfig, ["--alertbridge.wecom-max-bytes", "2048"])
    assert cfg.alertbridge.wecom_url.get_secret_value().endswith(WC_KEY) and cfg.alertbridge.timeout_s == 2.5
    assert cfg.alertbridge.wecom_max_bytes == 2048
    assert WC_KEY not in repr(cfg) and DT_SECRET not in repr(cfg) and WC_KEY not in str(cfg.model_dump())
    with pytest.raises(ConfigError, match="wecom_max_bytes"):
        load(AlertBridgeConfig, ["--alertbridge.wecom-max-bytes", "5000"])  # WeCom's limit is 4096
    with pytest.raises(ValueError, match="dingtalk_secret: set without dingtalk_url"):
        Bridge(cfg.alertbridge)
    with pytest.raises(ValueError) as e:
        Bridge(AlertBridgeSection(wecom_url=f"qyapi.weixin.qq.com/send?key={WC_KEY}"))
    assert "wecom_url: not an http(s) URL" in str(e.value) and WC_KEY not in str(e.value)


def test_the_service_process_end_to_end(robot, monkeypatch, tmp_path):
    """`python -m steadyrl.services.alertbridge`, configured from the environment, logging at DEBUG."""
    from tests.helpers import ServiceProc

    monkeypatch.setenv("STEADYRL_ALERTBRIDGE__DINGTALK_URL", f"{robot.url}/robot/send?access_token={DT_TOKEN}")
    monkeypatch.setenv("STEADYRL_ALERTBRIDGE__DINGTALK_SECRET", DT_SECRET)
    monkeypatch.setenv("STEADYRL_ALERTBRIDGE__WECOM_URL", f"{robot.url}/cgi-bin/webhook/send?key={WC_KEY}")
    svc = ServiceProc("alertbridge", ["--metrics-port", "0", "--log-level", "DEBUG"], tmp_path / "bridge.log")
    try:
        svc.wait_ready(30)
        robot.then({"errcode": 310000, "errmsg": "sign not match"})
        r1 = httpx.post(f"{svc.url}/alert/dingtalk", json=webhook(), timeout=10)
        r2 = httpx.post(f"{svc.url}/alert/wecom", json=webhook(), timeout=10)
        assert (r1.status_code, r2.status_code) == (502, 200)
        assert svc.metric("steadyrl_alertbridge_notifications_total", {"robot": "wecom", "outcome": "sent"}) == 1
        assert svc.metric("steadyrl_alertbridge_notifications_total", {"robot": "dingtalk",
                                                                        "outcome": "robot_error"}) == 1
        assert "sign" in urllib.parse.parse_qs(robot.requests[0]["query"])
        metrics = httpx.get(f"{svc.url}/metrics").text
    finally:
        assert svc.stop() == 0
    log = (tmp_path / "bridge.log").read_text()
    assert '"msg": "alert notification sent"' in log and "access_token=***" in log
    for secret in SECRETS:
        assert secret not in log and secret not in metrics

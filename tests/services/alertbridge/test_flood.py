"""The alert bridge under a flood and against injected markdown, to the fake robot on 127.0.0.1
(tests/services/alertbridge/test_bridge.py): at most the robot's quota a minute, critical
alerts through the reserve or in the summary, alert text shown as text."""

from __future__ import annotations

import pytest

from steadyrl.config import ConfigError, load
from steadyrl.services.alertbridge.bridge import Bridge, Webhook
from tests.services.alertbridge.test_bridge import FakeRobot, _section, alert, sent_text, webhook


class Clock:
    t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def robot():
    r = FakeRobot()
    yield r
    r.stop()


def hook(i: int, severity: str = "warning", name: str = "KLDrift") -> Webhook:
    a = alert(i)
    a["labels"] |= {"severity": severity, "alertname": name}
    return Webhook.model_validate(webhook(a, commonLabels={"alertname": name, "severity": severity}))


def test_500_alerts_in_a_minute_send_at_most_the_quota_and_every_p0_arrives(robot):
    clock = Clock()
    bridge = Bridge(_section(robot, wecom_url=None), clock=clock)   # DingTalk: 20 a minute, 5 kept for critical
    sent_at: list[float] = []
    p0s = {f"BrokerDown{i}" for i in range(10)}
    try:
        for i in range(500):   # 500 in 50 s; every 50th a P0
            critical = i % 50 == 49
            status, answer = bridge.notify("dingtalk", hook(i, "P0", f"BrokerDown{i // 50}") if critical else hook(i))
            assert status == 200, answer
            if answer["outcome"] == "sent":
                sent_at.append(clock.t)
            clock.t += 0.1
        assert len(sent_at) == len(robot.requests) == 20   # the quota, no more
        texts = [sent_text(r) for r in robot.requests]
        direct = {name for name in p0s if any(name in t for t in texts)}
        assert len(direct) == 5                             # the reserve took the first five P0s
        assert bridge.flush() is None                       # the minute is spent: nothing more
        clock.t = sent_at[0] + 60                           # the first message leaves the window
        status, _ = bridge.flush()
        assert status == 200 and len(robot.requests) == 21
        summary = sent_text(robot.requests[-1])
        assert "480 notifications held" in summary
        assert all(name in summary for name in p0s - direct)   # the held P0s arrive, listed first
        assert summary.index("BrokerDown") < summary.index("KLDrift")
        times = sent_at + [clock.t]
        assert all(sum(t0 <= t < t0 + 60 for t in times) <= 20 for t0 in times)   # any 60 s: <= 20
    finally:
        bridge.close()


def test_markdown_in_alert_text_is_shown_as_text(robot):
    bridge = Bridge(_section(robot, wecom_url=None))
    a = alert(0, summary="click [here](http://evil.example) ![x](http://evil.example/i.png)",
              description="ok\n# not a heading\n- not a list\n<font color=red>red</font> **loud** _soft_ job_name")
    a["generatorURL"] = ""
    a["labels"]["instance"] = "x](http://evil.example)"
    try:
        status, answer = bridge.notify("dingtalk", Webhook.model_validate(webhook(a)))
        assert status == 200, answer
        text = sent_text(robot.requests[-1])
        assert "](" not in text and "<font" not in text and "\n# not" not in text and "\n- not" not in text
        assert "click ［here］（http://evil.example）" in text and "＊＊loud＊＊ ＿soft＿ job_name" in text
    finally:
        bridge.close()


def test_a_reserve_as_large_as_the_quota_fails_at_start():
    with pytest.raises(ConfigError, match="critical_reserve 20 >= dingtalk_per_minute 20"):
        from steadyrl.services.alertbridge.bridge import AlertBridgeConfig

        load(AlertBridgeConfig, ["--alertbridge.critical-reserve", "20"])

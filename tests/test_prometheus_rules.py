"""Prometheus and Alertmanager configuration (compose/prometheus, compose/alertmanager; docs/alerts.md).

The real tools check them: `promtool check config`, `promtool test rules` (every alert's cases
in compose/prometheus/tests/), `amtool check-config` and `amtool config routes test`, and a real
Alertmanager on loopback shows that DataflowCollapse inhibits its parts. The binaries come from
the Debian packages prometheus and prometheus-alertmanager (.ci/run installs them). Without
them a test is skipped, except in CI (env CI set), where a missing binary fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.helpers import ROOT

PROM = ROOT / "compose" / "prometheus"
CONFIG = PROM / "prometheus.yml"
RULES = sorted((PROM / "rules").glob("*.yml"))
RULE_TESTS = sorted((PROM / "tests").glob("*.yml"))
AM_CONFIG = ROOT / "compose" / "alertmanager" / "alertmanager.yml"
SEVERITIES = {"P0", "P1", "P2", "P3"}
#: The parts DataflowCollapse inhibits (compose/alertmanager/alertmanager.yml).
COLLAPSE_PARTS = {"BreakerOpen", "ConsumerLagGrowing", "RolloutRestarting", "TrainBufferDropped"}


def tool(name: str) -> str:
    """Path of a Prometheus tool; skips the test where it is missing (fails in CI)."""
    path = shutil.which(name)
    if path is None:
        why = f"{name} is not installed (apt-get install --no-install-recommends prometheus prometheus-alertmanager)"
        if os.environ.get("CI"):
            pytest.fail(f"{why}; CI must have it (.ci/run installs it)")
        pytest.skip(why)
    return path


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def shown(r: subprocess.CompletedProcess) -> str:
    return f"exit {r.returncode}\n--- stdout\n{r.stdout[-6000:]}\n--- stderr\n{r.stderr[-6000:]}"


def alerts() -> list[dict]:
    return [rule for f in RULES for g in yaml.safe_load(f.read_text())["groups"] for rule in g["rules"]
            if "alert" in rule]


def test_prometheus_config_is_valid_and_loads_every_rule_file():
    r = run(tool("promtool"), "check", "config", str(CONFIG.relative_to(ROOT)))
    assert r.returncode == 0, shown(r)
    out = r.stdout + r.stderr
    # rule_files are resolved relative to the config file: each one must have been found
    assert f"{len(RULES)} rule files found" in out, shown(r)
    for f in RULES:
        assert f.name in out, (f.name, shown(r))


def test_alert_rules_pass_their_promtool_tests():
    assert RULE_TESTS, "no promtool tests in compose/prometheus/tests"
    r = run(tool("promtool"), "test", "rules", *(str(t.relative_to(ROOT)) for t in RULE_TESTS))
    assert r.returncode == 0, shown(r)


def test_every_alert_has_a_severity_annotations_and_cases_that_fire_and_stay_quiet():
    fires, quiet = set(), set()
    for t in RULE_TESTS:
        for case in yaml.safe_load(t.read_text())["tests"]:
            for a in case.get("alert_rule_test", []):
                (fires if a.get("exp_alerts") else quiet).add(a["alertname"])
    names = {a["alert"] for a in alerts()}
    assert {"CPUBound", "KLDrift", "MemoryLeak", "RewardStdHigh", "ConsumerLagGrowing", "BreakerOpen",
            "DataflowCollapse"} | COLLAPSE_PARTS <= names
    for a in alerts():
        assert a["labels"]["severity"] in SEVERITIES, a["alert"]
        assert a["annotations"]["summary"] and a["annotations"]["description"], a["alert"]
    assert names <= fires, f"alerts never shown firing in a test: {sorted(names - fires)}"
    assert names <= quiet, f"alerts never shown quiet in a test: {sorted(names - quiet)}"
    assert [a["labels"]["severity"] for a in alerts() if a["alert"] == "DataflowCollapse"] == ["P0"]


def test_every_metric_the_rules_read_is_exported_by_the_code():
    """A renamed metric would leave a rule silently empty: each name an expression reads is
    registered somewhere under steadyrl/ or services/ (counters without `_total`), or comes
    from prometheus_client's process collector or Prometheus itself."""
    source = "\n".join(p.read_text() for d in ("steadyrl", "services") for p in (ROOT / d).rglob("*.py"))
    builtin = {"up", "process_cpu_seconds_total", "process_resident_memory_bytes", "process_start_time_seconds"}
    used = set()
    for f in RULES:
        for g in yaml.safe_load(f.read_text())["groups"]:
            for rule in g["rules"]:
                expr = re.sub(r"\b\w+:\w+:\w+\b", " ", rule["expr"])      # recording rule names
                expr = re.sub(r'"[^"]*"', '""', expr)                      # label values
                used |= set(re.findall(r"\b(?:steadyrl_\w+|process_\w+|up)\b(?=\s*[{\[)]|\s*$|\s)", expr))
    assert used
    missing = [m for m in sorted(used - builtin) if f'"{re.sub(r"_total$", "", m)}"' not in source]
    assert not missing, f"rules read metrics no service registers: {missing}"


def test_alertmanager_config_is_valid():
    r = run(tool("amtool"), "check-config", str(AM_CONFIG.relative_to(ROOT)))
    assert r.returncode == 0, shown(r)
    assert "SUCCESS" in r.stdout, shown(r)


def test_alertmanager_config_holds_no_secret():
    """Robot URLs and secrets live in the bridge's environment: every receiver posts to the
    bridge or the generic webhook, with no credentials."""
    cfg = yaml.safe_load(AM_CONFIG.read_text())
    urls = [w["url"] for r in cfg["receivers"] for w in r.get("webhook_configs", [])]
    assert {"http://alertbridge:8500/alert/dingtalk", "http://alertbridge:8500/alert/wecom"} <= set(urls)
    for r in cfg["receivers"]:
        assert set(r) <= {"name", "webhook_configs"}, r
        for w in r["webhook_configs"]:
            allowed = r"http://(alertbridge:8500/alert/(dingtalk|wecom)|alert-webhook:9000/alerts)"
            assert re.fullmatch(allowed, w["url"]), w
            assert "http_config" not in w, w
    assert not re.search(r"access_token|oapi\.dingtalk|qyapi\.weixin", AM_CONFIG.read_text())


@pytest.mark.parametrize("severity, receiver", [("P0", "chat"), ("P1", "chat"), ("P2", "chat"), ("P3", "webhook"),
                                                (None, "webhook")])
def test_alertmanager_routes_by_severity(severity, receiver):
    labels = ["alertname=Any", *([f"severity={severity}"] if severity else [])]
    r = run(tool("amtool"), "config", "routes", "test", "--config.file", str(AM_CONFIG), "--verify.receivers", receiver,
            *labels)
    assert r.returncode == 0, shown(r)


def test_dataflow_collapse_inhibits_its_parts_in_a_real_alertmanager(tmp_path):
    """Alertmanager on loopback with the compose config: while DataflowCollapse fires, its parts
    in the same cluster are suppressed; another cluster's and other alerts are not."""
    from steadyrl.broker import free_port

    binary = shutil.which("alertmanager") or tool("prometheus-alertmanager")  # Debian names it so
    port = free_port()
    log = open(tmp_path / "alertmanager.log", "wb")
    proc = subprocess.Popen([binary, f"--config.file={AM_CONFIG}", f"--storage.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=",
                             "--log.level=warn"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/api/v2"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, (tmp_path / "alertmanager.log").read_text()
            try:
                if httpx.get(f"{url}/status", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "alertmanager did not start"
            time.sleep(0.1)

        def alert(name: str, cluster: str = "steadyrl", **labels) -> dict:
            return {"labels": {"alertname": name, "cluster": cluster, **labels},
                    "annotations": {"summary": name}}

        sent = [alert("DataflowCollapse", severity="P0"),
                alert("BreakerOpen", severity="P1", job="reward", instance="r0:8300", state="open"),
                alert("ConsumerLagGrowing", severity="P2", job="learner", client="learner-0", topic="rl.scored"),
                alert("RolloutRestarting", severity="P3", job="rollout", instance="ro0:8200"),
                alert("TrainBufferDropped", severity="P2", job="learner", stage="train"),
                alert("CPUBound", severity="P3", job="actor", instance="a:8100"),          # not a part
                alert("BreakerOpen", cluster="other", severity="P1", job="reward")]        # another stack
        r = httpx.post(f"{url}/alerts", json=sent, timeout=5)
        assert r.status_code == 200, r.text

        def states() -> dict[tuple[str, str], dict]:
            got = httpx.get(f"{url}/alerts", timeout=5).json()
            return {(a["labels"]["alertname"], a["labels"]["cluster"]): a["status"] for a in got}

        deadline = time.monotonic() + 20
        while True:  # inhibition is evaluated as alerts arrive; give it a moment
            st = states()
            suppressed = {name for (name, cluster), s in st.items() if s["state"] == "suppressed"}
            if len(st) == len(sent) and suppressed == COLLAPSE_PARTS:
                break
            assert time.monotonic() < deadline, json.dumps(st, indent=1)
            time.sleep(0.2)
        for part in COLLAPSE_PARTS:
            assert st[(part, "steadyrl")]["inhibitedBy"], st[(part, "steadyrl")]
        assert st[("DataflowCollapse", "steadyrl")]["state"] == "active"
        assert st[("CPUBound", "steadyrl")]["state"] == "active"
        assert st[("BreakerOpen", "other")]["state"] == "active"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()

"""The real Prometheus scraping a running tiny pipeline with the compose rule files loaded:
the learner's metrics arrive and the rules evaluate (issue 8, item 6; docs/alerts.md).

Prometheus is Debian's `prometheus` binary (.ci/run installs it); without it the test is
skipped, except in CI (env CI set), where it fails.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import time
from pathlib import Path

import httpx
import yaml

from steadyrl.cli import SERVICE_PORTS
from steadyrl.local.ports import free_port
from tests.deploy.test_prometheus_rules import PROMETHEUS_HINT, RULES
from tests.helpers import need_tool
from tests.integration.test_pipeline import Up, _config

log = logging.getLogger(__name__)  # what the run showed, in the test log (pytest -rA)
GROUPS = {"steadyrl-hardware", "steadyrl-algorithm", "steadyrl-dataflow"}


class Prometheus:
    """`prometheus` on 127.0.0.1:<free port>, its TSDB in a temporary folder."""

    def __init__(self, tmp_path: Path, config: dict):
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / "prometheus.log"
        with open(self.log_path, "wb") as log:  # the child writes it; read back by path
            self.proc = subprocess.Popen(
                [need_tool("prometheus", PROMETHEUS_HINT), f"--config.file={tmp_path / 'prometheus.yml'}",
                 f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{self.port}",
                 "--log.level=warn"], stdout=log, stderr=subprocess.STDOUT)

    def get(self, path: str, **params) -> dict:
        """GET /api/v1/<path>; the JSON body (status "success" asserted)."""
        body = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=10).json()
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        data = self.get("query", query=expr)
        assert data["resultType"] == "vector", data
        return data["result"]

    def wait_until(self, what: str, check, timeout_s: float, up: Up | None = None):
        """Poll check() (exceptions count as not yet) until it returns something truthy."""
        deadline, last = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"prometheus exited {self.proc.returncode}:\n{self.log()}"
            if up is not None:
                assert up.proc.poll() is None, f"steadyrl up exited {up.proc.returncode}:\n{up.log()[-4000:]}"
            try:
                got = check()
            except (httpx.HTTPError, ValueError, KeyError) as e:
                got, last = None, e
            if got:
                return got
            time.sleep(0.5)
        raise AssertionError(f"{what}: not within {timeout_s:g} s (last error {last!r})\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # this PID only; it shuts its TSDB down cleanly
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def test_prometheus_scrapes_the_tiny_pipeline_and_evaluates_the_rules(bootstrap, tmp_path):
    need_tool("prometheus", PROMETHEUS_HINT)
    # more steps than the test needs: the stack must outlive the scrapes; it is stopped below
    up = Up(bootstrap, tmp_path, _config(tmp_path, steps=400, eval_data=None))
    prom = None
    try:
        # the compose config's jobs and rule files, with the static loopback targets `up` uses
        # (the alertbridge is not part of this stack)
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(f) for f in RULES],
            "scrape_configs": [{"job_name": svc, "static_configs": [{"targets": [f"127.0.0.1:{port + up.offset}"]}]}
                               for svc, port in SERVICE_PORTS.items()],
        }
        prom = Prometheus(tmp_path, config)
        prom.wait_until("prometheus ready", lambda: httpx.get(f"{prom.url}/-/ready", timeout=2).status_code == 200, 60)

        t0 = time.monotonic()
        step = prom.wait_until(
            "steadyrl_learner_step > 0 in Prometheus",
            lambda: [float(r["value"][1]) for r in prom.query('steadyrl_learner_step{job="learner"} > 0')], 300, up)
        log.info(f"learner step {step[0]:g} seen by Prometheus {time.monotonic() - t0:.1f} s after it started")

        # every service answered the scrapes under its compose job name
        def scraped():
            jobs = {r["metric"]["job"] for r in prom.query("max_over_time(up[1m]) == 1")}
            return jobs >= set(SERVICE_PORTS) and jobs

        prom.wait_until(f"every job ({', '.join(SERVICE_PORTS)}) scraped", scraped, 60, up)

        # the three groups are loaded and every rule has been evaluated without error
        def rules_ok():
            groups = {g["name"]: g for g in prom.get("rules")["groups"]}
            assert set(groups) >= GROUPS, sorted(groups)
            rules = [r for g in groups.values() for r in g["rules"]]
            errors = [(r["name"], r.get("lastError")) for r in rules if r["health"] == "err"]
            assert not errors, errors
            return all(r["health"] == "ok" for r in rules) and rules

        rules = prom.wait_until("every rule evaluated, health ok", rules_ok, 60, up)
        assert {r["name"] for r in rules if r["type"] == "alerting"} >= {
            "CPUBound", "MemoryLeak", "KLDrift", "RewardStdHigh", "ConsumerLagGrowing", "BreakerOpen",
            "DataflowCollapse", "RolloutRestarting", "TrainBufferDropped"}

        # recording rules hold values computed from the live services
        buffer = prom.wait_until("steadyrl:train_buffer_size:avg5m",
                                 lambda: prom.query('steadyrl:train_buffer_size:avg5m{job="learner"}'), 30, up)
        assert float(buffer[0]["value"][1]) >= 0, buffer
        cpu = prom.wait_until("steadyrl:process_cpu:ratio of the learner",
                              lambda: prom.query('steadyrl:process_cpu:ratio{job="learner"}'), 30, up)
        assert 0 <= float(cpu[0]["value"][1]) <= 1.5, cpu  # share of the cores (a little over 1: rate jitter)
        parts = {}
        for name in ("steadyrl:reward_failing:bool", "steadyrl:rollout_restarted:bool",
                     "steadyrl:train_buffer_dropped:bool"):
            got = prom.query(name)
            assert len(got) == 1 and got[0]["value"][1] in ("0", "1"), (name, got)
            parts[name] = got[0]["value"][1]
        log.info(f"{len(rules)} rules ok; learner cpu ratio {float(cpu[0]['value'][1]):.2f}, train buffer avg "
              f"{float(buffer[0]['value'][1]):.2f}; collapse parts {parts}")
        # and each alert's expression evaluates on these series (results may be empty: a healthy run)
        for f in RULES:
            for g in yaml.safe_load(f.read_text())["groups"]:
                for r in g["rules"]:
                    if "alert" in r:
                        prom.query(r["expr"])
    finally:
        if up.proc.poll() is None:
            up.proc.send_signal(signal.SIGTERM)  # `up` stops its children, then exits
        with contextlib.suppress(subprocess.TimeoutExpired):  # up.wait() has killed its process group
            up.wait(60)
        if prom is not None:
            prom.stop()

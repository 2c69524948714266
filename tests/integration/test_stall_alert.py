"""LearnerStalled firing in a real Prometheus while the learner is alive but starved (issue 18;
docs/alerts.md): the tiny pipeline under `steadyrl up`, Prometheus scraping it with the compose
rule files, the actor stopped (SIGSTOP) with prompts in flight. The learner's /livez stays 200,
its /readyz turns 503, and the alert fires; after SIGCONT the learner steps again and the alert
resolves.

Prometheus is Debian's `prometheus` binary (.ci/run installs it); without it the test is
skipped, except in CI (env CI set), where it fails.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time

import httpx
import pytest

from steadyrl.cli import SERVICE_PORTS
from tests.deploy.test_prometheus_rules import PROMETHEUS_HINT, RULES
from tests.helpers import need_tool
from tests.integration.test_pipeline import Up, _config
from tests.integration.test_prometheus_scrape import Prometheus

log = logging.getLogger(__name__)  # the timings, in the test log (pytest -rA, or --log-cli-level=INFO)


@pytest.fixture(autouse=True)
def _quiet_httpx():
    """Not a log line per probe, in this module's tests only (regression: set at import, it hid
    httpx's request lines from every later test of the session, failing the alert bridge's
    secrets test)."""
    httpx_log = logging.getLogger("httpx")
    before = httpx_log.level
    httpx_log.setLevel(logging.WARNING)
    yield
    httpx_log.setLevel(before)

#: The learner's stall rule (services/learner/stall.py): stalled once the time since the last step is above
#: max(STALL_FACTOR x the median of its last 20 step times, STALL_MIN_S). The tiny model steps in
#: well under a second, so STALL_MIN_S decides.
STALL_MIN_S = 5
STALL_FACTOR = 3
FIRING = 'ALERTS{alertname="LearnerStalled", alertstate="firing"}'


def test_learner_stalled_fires_while_the_learner_is_alive_but_starved(bootstrap, tmp_path):
    need_tool("prometheus", PROMETHEUS_HINT)
    # more steps than the test needs: the run must outlive the stall and the recovery
    # the stopped actor's /livez fails: up would restart it after a minute (issue 46); here it stays stopped
    up = Up(bootstrap, tmp_path, _config(tmp_path, steps=2000, eval_data=None, stall_min_s=STALL_MIN_S,
                                         stall_factor=STALL_FACTOR), "--liveness-failures", "0")
    prom, actor, stopped = None, None, False
    learner = up.url(SERVICE_PORTS["learner"])
    try:
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(f) for f in RULES],
            "scrape_configs": [{"job_name": svc, "static_configs": [{"targets": [f"127.0.0.1:{port + up.offset}"]}]}
                               for svc, port in SERVICE_PORTS.items()],
        }
        prom = Prometheus(tmp_path, config)
        prom.wait_until("prometheus ready", lambda: httpx.get(f"{prom.url}/-/ready", timeout=2).status_code == 200, 60)

        # a healthy run first: steps seen by Prometheus (a median step time to judge by), not stalled
        up.wait_step(10, timeout_s=300)
        prom.wait_until("the learner's steps in Prometheus",
                        lambda: prom.query('steadyrl_learner_step{job="learner"} >= 10'), 60, up)
        prom.wait_until("steadyrl_learner_stalled == 0 in Prometheus",
                        lambda: prom.query('steadyrl_learner_stalled{job="learner"} == 0'), 30, up)
        assert not prom.query(FIRING), "stalled before anything was stopped"
        assert httpx.get(f"{learner}/readyz", timeout=5).status_code == 200

        # starve it: the actor stops answering (SIGSTOP to that one child of our `up`, by PID);
        # the rollout worker holds its prompts, so they stay in flight
        actor = up.child_pid("actor-0")
        step_at_stop = up.progress().get("step")
        os.kill(actor, signal.SIGSTOP)
        stopped, t_stop = True, time.monotonic()
        log.info(f"actor (pid {actor}) stopped at learner step {step_at_stop}")

        seen: dict[str, float] = {}
        livez_codes: set[int] = set()
        readyz_503: list[str] = []  # the first 503 body
        last_readyz: list = []

        def firing():
            assert up.proc.poll() is None, f"steadyrl up exited {up.proc.returncode}:\n{up.log()[-4000:]}"
            live = httpx.get(f"{learner}/livez", timeout=5)
            livez_codes.add(live.status_code)
            assert live.status_code == 200, f"learner /livez {live.status_code} while starved: {live.text}"
            ready = httpx.get(f"{learner}/readyz", timeout=5)
            now = time.monotonic() - t_stop
            last_readyz[:] = [ready.status_code, ready.text]
            if ready.status_code == 503 and not ready.json()["checks"]["progress"]["ok"]:
                seen.setdefault("readyz 503", now)
                readyz_503[:] = readyz_503 or [ready.text]
            if prom.query('steadyrl_learner_stalled{job="learner"} == 1'):
                seen.setdefault("stalled gauge in Prometheus", now)
            if prom.query('ALERTS{alertname="LearnerStalled", alertstate="pending"}'):
                seen.setdefault("pending", now)
            got = prom.query(FIRING)
            if got:
                seen.setdefault("firing", now)
            return got and "readyz 503" in seen and got

        try:
            alert = prom.wait_until("LearnerStalled firing and the learner's /readyz 503", firing, 90, up)
        except AssertionError as e:
            # regression: the learner's `assignment` check called consumer.assignment() on the
            # probe thread, which blocks while the loop polls an idle consumer (librdkafka 2.16):
            # /readyz, and /metrics with it, hung exactly while the learner was starved
            raise AssertionError(f"{e}\nseen {seen}; last /readyz {last_readyz}; "
                                 f"stalled {prom.query('steadyrl_learner_stalled')}; "
                                 f"in flight {prom.query('steadyrl_learner_prompts_in_flight')}") from None
        in_flight = prom.query('steadyrl_learner_prompts_in_flight{job="learner"}')
        step_now = up.progress().get("step")
        timings = {k: round(v, 1) for k, v in seen.items()}
        log.info(f"after SIGSTOP of the actor (s): {timings}; learner step {step_at_stop} -> {step_now}; "
                 f"prompts in flight {in_flight[0]['value'][1] if in_flight else '?'}; /livez codes {livez_codes}; "
                 f"/readyz: {readyz_503[0]}")
        assert alert[0]["metric"]["job"] == "learner" and alert[0]["metric"]["severity"] == "P1", alert
        assert livez_codes == {200}
        assert in_flight and float(in_flight[0]["value"][1]) > 0, in_flight
        # the learner's own threshold (counted from its last step, which may precede the stop), then
        # the rule's `for: 30s` from the first evaluation that saw it (evaluations every second)
        assert seen["firing"] - seen["pending"] >= 29, timings
        assert seen["firing"] < STALL_MIN_S + 30 + 20, timings

        # let it go: the learner steps again, /readyz is 200 and the alert resolves
        os.kill(actor, signal.SIGCONT)
        stopped, t_cont = False, time.monotonic()
        up.wait_step((step_now or 0) + 2, timeout_s=120)
        t_step = time.monotonic() - t_cont
        prom.wait_until("LearnerStalled resolved", lambda: not prom.query(FIRING) and [1], 60, up)
        prom.wait_until("learner /readyz 200 again",
                        lambda: httpx.get(f"{learner}/readyz", timeout=5).status_code == 200, 30, up)
        log.info(f"after SIGCONT: stepping again in {t_step:.1f} s, alert resolved in "
                 f"{time.monotonic() - t_cont:.1f} s")
    finally:
        if stopped and actor is not None:
            os.kill(actor, signal.SIGCONT)  # a stopped child would not act on up's SIGTERM
        if up.proc.poll() is None:
            up.proc.send_signal(signal.SIGTERM)  # `up` stops its children, then exits
        with contextlib.suppress(subprocess.TimeoutExpired):  # up.wait() has killed its process group
            up.wait(60)
        if prom is not None:
            prom.stop()

"""`steadyrl up` (what `make run` calls): broker, topics, services ready; Ctrl-C stops all."""

import os
import signal
import subprocess
import sys
import time

import httpx
import yaml

from steadyrl.broker import LocalBroker, free_port_pair
from tests.helpers import ROOT


def test_up_then_ctrl_c_stops_everything(tmp_path):
    port, offset = free_port_pair(), 1000 + os.getpid() % 500
    state = tmp_path / "state"
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg["learner"].update(steps=100_000, eval_data=None)  # still training when Ctrl-C comes
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    log = open(tmp_path / "up.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "steadyrl.cli", "up", "--state-dir", str(state), "--port",
                             str(port), "--port-offset", str(offset), "--prefix", "up.",
                             "--config", str(tmp_path / "config.yaml")],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    broker = LocalBroker(state / "broker", port=port)
    try:
        deadline = time.monotonic() + 120
        while b"stack up" not in (tmp_path / "up.log").read_bytes():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "up.log").read_text()
            time.sleep(0.2)
        r = httpx.get(f"http://127.0.0.1:{8300 + offset}/readyz")
        assert r.status_code == 200, r.text
        assert r.json()["checks"]["assignment"]["ok"]
        r = httpx.get(f"http://127.0.0.1:{8100 + offset}/readyz")  # the actor, serving the learner's weights
        assert r.status_code == 200 and r.json()["checks"]["policy"]["ok"], r.text
        assert httpx.get(f"http://127.0.0.1:{8200 + offset}/readyz").status_code == 200  # rollout-0
        assert httpx.get(f"http://127.0.0.1:{8390 + offset}/readyz").status_code == 200  # reward server
        deadline = time.monotonic() + 60
        while (httpx.get(f"http://127.0.0.1:{8400 + offset}/progress").json().get("step") or 0) < 3:
            assert time.monotonic() < deadline, "the learner does not step"
            time.sleep(0.2)
        broker_pid = broker.pid()
        assert broker_pid is not None
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        assert proc.wait(60) == 0
        out = (tmp_path / "up.log").read_text()
        assert "stopped" in out.splitlines()[-1]
        assert broker.pid() is None
        assert not os.path.exists(f"/proc/{broker_pid}")
        try:
            httpx.get(f"http://127.0.0.1:{8300 + offset}/livez", timeout=1)
            raise AssertionError("reward service still answering after Ctrl-C")
        except httpx.ConnectError:
            pass
        assert "actor-0" in out and "policy caught up" in out and "progress [" in out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        broker.stop()
        log.close()


def test_up_gives_each_service_its_placement_and_each_reports_what_it_got(bootstrap, tmp_path):
    """At max_staleness 2 the actor and the learner run at once: each gets its share of the
    cores (steadyrl/placement.py), and its /metrics says what it got (threads, CPUs)."""
    from steadyrl import placement
    from tests.integration.test_pipeline import Up, _config

    want = placement.default_placement(placement.available_cpus(), max_staleness=2)
    up = Up(bootstrap, tmp_path, _config(tmp_path, steps=100_000, max_staleness=2, eval_data=None))
    try:
        up.wait_step(1)

        def got(base_port: int, name: str) -> float:
            text = httpx.get(f"{up.url(base_port)}/metrics", timeout=5).text
            return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))

        for svc, port in (("actor", 8100), ("learner", 8400), ("rollout", 8200)):
            assert got(port, "steadyrl_placement_threads") == want[svc].threads, svc
            cpus = placement.cpu_set(want[svc])
            assert got(port, "steadyrl_host_cpu_cores") == len(cpus or placement.available_cpus()), svc
        assert "placement actor=" in up.log()
    finally:
        up.close()

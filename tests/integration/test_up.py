"""`steadyrl up` (what `make run` calls): broker, topics, services ready; Ctrl-C stops all."""

import os
import random
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from steadyrl.local.broker import LocalBroker
from steadyrl.local.ports import free_port_pair
from tests.helpers import ROOT


def test_up_then_ctrl_c_stops_everything(tmp_path):
    """With --insecure, as before logins were the default (issue 46; the default's Ctrl-C:
    tests/integration/test_up_closed.py); then the folder its PLAINTEXT broker made is refused by
    a default `up`, naming why and --insecure."""
    port, offset = free_port_pair(), 1000 + os.getpid() % 500
    state = tmp_path / "state"
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg["learner"].update(steps=100_000, eval_data=None)  # still training when Ctrl-C comes
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    with open(tmp_path / "up.log", "wb") as log:  # the child writes it; read back by path
        proc = subprocess.Popen([sys.executable, "-m", "steadyrl.cli", "up", "--state-dir", str(state), "--port",
                                 str(port), "--port-offset", str(offset), "--prefix", "up.",
                                 "--config", str(tmp_path / "config.yaml"), "--insecure"],
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
        # up recorded its ports in <state>/up.json: status finds the learner without --port-offset
        st = subprocess.run([sys.executable, "-m", "steadyrl.cli", "status", "--state-dir", str(state)],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert st.returncode == 0 and "running (" in st.stdout.splitlines()[0], (st.stdout, st.stderr)
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
        assert "--insecure: the broker takes no logins" in out
        # the folder its PLAINTEXT broker made: a default up refuses it before starting anything
        r = subprocess.run([sys.executable, "-m", "steadyrl.cli", "up", "--state-dir", str(state), "--port", str(port),
                            "--port-offset", str(offset)], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "made without logins" in r.stderr and "--insecure" in r.stderr, r.stderr
        assert broker.pid() is None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        broker.stop()


def test_up_gives_each_service_its_placement_and_each_reports_what_it_got(bootstrap, tmp_path):
    """At max_staleness 2 the actor and the learner run at once: each gets its share of the
    cores (steadyrl/local/placement.py), and its /metrics says what it got (threads, CPUs)."""
    from steadyrl.local import placement
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


def _offset() -> int:
    """A --port-offset whose service ports are all free now."""
    from steadyrl.local import ports

    while True:
        offset = 3000 + random.randrange(20000)
        if not any(ports.taken(base + offset + i) for base in (8100, 8200, 8300, 8390, 8400) for i in range(2)):
            return offset


def _run_up(tmp_path, port: int, offset: int, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "steadyrl.cli", "up", "--state-dir", str(tmp_path / "state"),
                           "--port", str(port), "--port-offset", str(offset), "--prefix", "up.",
                           "--config", str(ROOT / "configs" / "tiny.yaml"), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def _nothing_started(tmp_path, port: int, offset: int) -> None:
    from steadyrl.local import ports

    assert not (tmp_path / "state" / "broker" / "broker.pid").exists()
    assert not (tmp_path / "state" / "broker" / "cluster.id").exists()   # not even formatted
    for base in (8100, 8200, 8300, 8390, 8400):
        assert not ports.taken(base + offset), base


def test_up_refuses_a_foreign_broker_on_its_port_and_leaves_that_stack_alone(tmp_path):
    """Another stack's broker on up's --port: up stops in its argument checks (exit 2) naming
    the port and the broker's process; it used to go on with whatever broker answered there, its
    workers joining the other stack's consumer groups. A broker that takes the port after the
    checks is refused by its cluster id (ForeignBroker)."""
    from confluent_kafka.admin import AdminClient

    from steadyrl.bus.topics import create_topics
    from steadyrl.local.broker import ForeignBroker
    from steadyrl.local.cluster import random_cluster_id

    port, offset = free_port_pair(), _offset()
    foreign = LocalBroker(tmp_path / "foreign", port=port, controller_port=port + 1)
    foreign.start()
    try:
        pid = foreign.pid()
        create_topics(foreign.bootstrap, "other.")
        before = set(AdminClient({"bootstrap.servers": foreign.bootstrap}).list_topics(timeout=10).topics)
        r = _run_up(tmp_path, port, offset)
        assert r.returncode == 2, r.stdout + r.stderr
        assert f"port {port}, for the broker (--port), is held by pid {pid} (java" in r.stderr, r.stderr
        assert "kafka.Kafka" in r.stderr and "--bootstrap" in r.stderr
        assert "starting Kafka broker" not in r.stdout
        _nothing_started(tmp_path, port, offset)
        assert foreign.pid() == pid   # untouched: running, no topic of up's
        assert set(AdminClient({"bootstrap.servers": foreign.bootstrap}).list_topics(timeout=10).topics) == before

        # the same broker met after the checks (it took the port a moment later): refused by cluster id
        mine = LocalBroker(tmp_path / "mine", port=port, controller_port=port + 1)
        mine.state_dir.mkdir(parents=True)
        (mine.state_dir / "cluster.id").write_text(random_cluster_id())
        t0 = time.monotonic()
        with pytest.raises(ForeignBroker, match=f"127.0.0.1:{port} is of cluster {foreign.cluster_id()}"):
            mine.wait_ready(30)
        assert time.monotonic() - t0 < 10   # at once, not after the timeout
    finally:
        foreign.stop()


def test_up_with_a_busy_service_port_stops_before_starting_anything(tmp_path):
    """A service's HTTP port already taken: exit 2 naming the port, the service and the holder
    (this test's process), before the broker or any service starts (it used to crash-loop the
    service: 6 restarts in 75 s, a traceback each)."""
    port, offset = free_port_pair(), _offset()
    with socket.create_server(("127.0.0.1", 8300 + offset)):   # reward-0's port
        r = _run_up(tmp_path, port, offset)
        assert r.returncode == 2, r.stdout + r.stderr
        assert f"port {8300 + offset}, for reward-0" in r.stderr, r.stderr
        assert f"is held by pid {os.getpid()} (" in r.stderr, r.stderr
        assert r.stdout == ""
        from steadyrl.local import ports

        assert not ports.taken(port)   # no broker
        assert not (tmp_path / "state" / "broker" / "broker.pid").exists()
        for base in (8100, 8200, 8390, 8400):
            assert not ports.taken(base + offset), base


@pytest.mark.slow
def test_up_restarts_its_broker_after_a_sigkill_and_the_run_finishes(tmp_path):
    """The broker `up` started, SIGKILLed mid-run: up reports it (exit, data folder and its
    volume's free bytes), starts it again on the same data (here a folder of its own,
    --broker-data) and the run reaches its last step."""
    port, offset = free_port_pair(), _offset()
    state, data = tmp_path / "state", tmp_path / "broker-data"
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg["learner"].update(steps=30, eval_data=None)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    with open(tmp_path / "up.log", "wb") as log:  # the child writes it; read back by path
        proc = subprocess.Popen([sys.executable, "-m", "steadyrl.cli", "up", "--state-dir", str(state), "--port",
                                 str(port), "--port-offset", str(offset), "--prefix", "up.", "--broker-data", str(data),
                                 "--config", str(tmp_path / "config.yaml")],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    broker = LocalBroker(state / "broker", port=port, data_dir=data)

    def out() -> str:
        return (tmp_path / "up.log").read_text(errors="replace")

    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                step = httpx.get(f"http://127.0.0.1:{8400 + offset}/progress", timeout=2).json().get("step") or 0
            except (httpx.HTTPError, ValueError):
                step = 0
            if step >= 3:
                break
            assert proc.poll() is None and time.monotonic() < deadline, out()[-4000:]
            time.sleep(0.3)
        assert (data / "meta.properties").exists() and not (state / "broker" / "data").exists()
        killed = broker.kill()
        assert killed is not None
        rc = proc.wait(300)
        text = out()
        assert rc == 0, text[-4000:]
        assert f"broker | exited (code -9, pid {killed})" in text, text[-4000:]
        assert f"data folder {data} on volume " in text and " bytes free; restart #1 in 1s" in text
        assert "broker | restarted (pid " in text and "learner-0 finished its run" in text, text[-4000:]
        from steadyrl.testing.run import run_finished

        assert run_finished(state / "learner")
        assert broker.pid() is None   # stopped at the end: the restarted one was up's too
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        broker.stop()

"""steadyrl.local.supervisor.BrokerWatch (what keeps `up`'s own broker running) against a stand-in
broker, and steadyrl.local.ports (who holds a port). tests/integration/test_up.py runs both for real."""

from __future__ import annotations

import io
import os
import socket
import time
from collections import namedtuple
from pathlib import Path

from steadyrl.local import ports
from steadyrl.local.jars import BrokerError
from steadyrl.local.supervisor import BrokerWatch, volume_of

Usage = namedtuple("Usage", "total used free")


class FakeProc:
    def __init__(self, pid: int):
        self.pid = pid

    def poll(self):
        return 1   # asked only once wait_ready failed: the JVM exited


class FakeBroker:
    """Alive until `die()`; each spawn fails while `full` (as Kafka halts on a full volume)."""

    bootstrap = "127.0.0.1:1"

    def __init__(self, data: Path):
        self.data = data
        self.alive: int | None = 100
        self.full = False
        self.spawns = 0

    def pid(self):
        return self.alive

    def exit_code(self, wait_s=0.0):
        return None if self.alive else 1

    def failure(self):
        return "its data volume is full (No space left on device)" if self.full else None

    def spawn(self):
        self.spawns += 1
        return FakeProc(100 + self.spawns)

    def wait_ready(self, timeout_s, proc):
        if self.full:
            raise BrokerError("broker exited with code 1:\nlog tail")
        self.alive = proc.pid

    def stop(self, grace_s=30.0):
        return False


def _tick_until(watch: BrokerWatch, cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        watch.tick()
        time.sleep(0.02)


def test_a_dead_broker_on_a_full_volume_is_reported_by_name_and_restarted_once_space_returns(tmp_path, monkeypatch):
    free = {"bytes": 10 << 30}
    monkeypatch.setattr("shutil.disk_usage", lambda p: Usage(20 << 30, 0, free["bytes"]))
    broker, out = FakeBroker(tmp_path), io.StringIO()
    watch = BrokerWatch(broker, out=out, check_s=0.0, low_free_bytes=1 << 20)
    watch.tick()
    assert out.getvalue() == ""   # running, space enough: silent

    free["bytes"], broker.full = 4096, True
    broker.alive = None   # Kafka halted: its only log dir failed
    watch.tick()
    text = out.getvalue()
    assert f"broker | data folder {tmp_path} on volume {volume_of(tmp_path)} is nearly full: 4096 bytes free" in text
    assert ("broker | exited (code 1, pid 100): its data volume is full (No space left on device); "
            f"data folder {tmp_path} on volume {volume_of(tmp_path)}: 4096 bytes free; restart #1 in 1s") in text
    watch.tick()
    assert broker.spawns == 0   # the backoff first
    _tick_until(watch, lambda: "restart #1 failed" in out.getvalue())
    assert "next try in 2s" in out.getvalue() and broker.alive is None
    free["bytes"], broker.full = 10 << 30, False   # space returns
    _tick_until(watch, lambda: "restarted" in out.getvalue())
    watch.close()
    assert broker.spawns == 2 and broker.alive == 102 and watch.restarts == 2
    assert "broker | restarted (pid 102, 127.0.0.1:1, restart #2)" in out.getvalue()
    assert out.getvalue().count("nearly full") == 1   # once per fall below the mark


def test_ports_names_the_process_that_listens(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
        assert ports.taken(port)
        hs = ports.holders(port)
        assert [h.pid for h in hs] == [os.getpid()]
        assert ports.describe(port).startswith(f"pid {os.getpid()} (") and "pytest" in ports.describe(port)
    assert not ports.taken(port) and ports.holders(port) == []


def test_a_connection_in_time_wait_does_not_take_a_port():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()   # the server side closes first: its end stays in TIME_WAIT
    client.close()
    server.close()
    assert not ports.taken(port)


def test_close_ends_a_restart_that_waits_for_a_slow_broker(tmp_path, monkeypatch):
    """up stopping (Ctrl-C) while its broker restarts: close() returns within a slice of the
    wait, not after the whole ready timeout, and the abandoned restart reports no failure."""
    monkeypatch.setattr("shutil.disk_usage", lambda p: Usage(20 << 30, 0, 10 << 30))

    class Slow(FakeBroker):
        def wait_ready(self, timeout_s, proc):
            time.sleep(min(timeout_s, 0.5))
            raise BrokerError("did not answer metadata")

    class Running(FakeProc):
        def poll(self):
            return None

    broker, out = Slow(tmp_path), io.StringIO()
    broker.spawn = lambda: Running(200)   # type: ignore[method-assign]
    watch = BrokerWatch(broker, out=out, check_s=0.0, ready_timeout_s=600.0)
    broker.alive = None
    _tick_until(watch, lambda: watch.restarts == 1)
    time.sleep(1.0)   # inside the wait
    t0 = time.monotonic()
    watch.close()
    assert time.monotonic() - t0 < 7.0
    assert watch._thread is not None and not watch._thread.is_alive()
    assert "failed" not in out.getvalue()

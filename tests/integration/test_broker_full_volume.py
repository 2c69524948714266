"""The broker's data on a volume of its own that fills up (issue 34): Kafka halts when its only
log folder fails; steadyrl.local.supervisor.BrokerWatch (what `up` runs) reports the volume by name
with its free bytes and starts the broker again once space returns. Needs a tmpfs of the test's
own (root); skipped elsewhere."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import time

import pytest

from steadyrl.bus.topics import create_topics
from steadyrl.local.broker import LocalBroker
from steadyrl.local.ports import free_port_pair
from steadyrl.local.supervisor import BrokerWatch
from tests.helpers import producer, unique_prefix


@pytest.fixture
def volume(tmp_path):
    """A 120 MiB tmpfs mounted at tmp_path/vol (unmounted after)."""
    vol = tmp_path / "vol"
    vol.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=120m", "tmpfs", str(vol)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a tmpfs of its own")
    try:
        yield vol
    finally:
        subprocess.run(["umount", "-l", str(vol)], check=False)


@pytest.mark.slow
def test_a_broker_that_halts_on_its_full_volume_is_reported_and_back_once_space_returns(tmp_path, volume):
    port = free_port_pair()
    broker = LocalBroker(tmp_path / "broker", port=port, controller_port=port + 1, data_dir=volume / "data")
    broker.start()
    try:
        first = broker.pid()
        prefix = unique_prefix()
        create_topics(broker.bootstrap, prefix)
        out = io.StringIO()
        watch = BrokerWatch(broker, out=out, low_free_bytes=32 << 20)
        filler = volume / "filler"
        with open(filler, "wb") as f, pytest.raises(OSError, match="No space left"):
            while True:
                f.write(b"\0" * (1 << 20))
        p = producer(broker.bootstrap)
        deadline = time.monotonic() + 120
        while "exited" not in out.getvalue():   # the broker's next write fails: Kafka halts
            assert time.monotonic() < deadline, (out.getvalue(), broker.log_tail())
            with contextlib.suppress(BufferError):
                p.produce(f"{prefix}rl.prompts", b"x" * 1000, key=b"k")
            p.poll(0.05)
            watch.tick()
        assert broker.pid() is None
        text = out.getvalue()
        assert f"broker | data folder {volume / 'data'} on volume {volume} is nearly full: " in text, text
        assert f"broker | exited (code 1, pid {first}): its data volume is full (No space left on device); " \
               f"data folder {volume / 'data'} on volume {volume}: " in text, text
        filler.unlink()   # space returns
        deadline = time.monotonic() + 180
        while "restarted" not in out.getvalue():
            assert time.monotonic() < deadline, (out.getvalue(), broker.log_tail())
            watch.tick()
            time.sleep(0.1)
        watch.close()
        assert broker.pid() not in (None, first)
        assert p.flush(60) == 0   # what was produced while it was down is written now
    finally:
        broker.stop()

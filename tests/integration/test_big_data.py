"""A dataset of 1 000 000 rows (issue 46): the learner indexes it and checks only the rows it
takes, with its heartbeat beating, so /livez answers 200 all through its start under a
liveness timeout of 5 s. Before, every row was read and checked at start without a heartbeat:
~10 min and ~2 GB for a million rows, and a liveness probe killed the learner first. Figures:
bench/big_data.py. The same learner's evaluation set has a bad row: left out and named, the
evaluation and the run go on without it (before: exit 1 in the evaluation, restarted for ever)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.helpers import ROOT, ServiceProc

ROWS = 1_000_000


def write_rows(path: Path, n: int) -> None:
    """`n` tiny copy-task rows in verl's JSONL (a digit to repeat), every 1 000th a bad one
    (role `tool`), written in blocks: ~1 s for a million."""
    lines = [json.dumps({"data_source": "tiny_copy", "prompt": [{"role": "tool" if d == 0 and k == 0 else "user",
                                                                  "content": str(d)}],
                         "reward_model": {"ground_truth": str(d)}}) + "\n" for k in range(100) for d in range(10)]
    block = "".join(lines)   # 1 000 rows
    with open(path, "w") as f:
        for _ in range(n // 1000):
            f.write(block)


class Probe(threading.Thread):
    """GET /livez and /progress every 0.1 s until stopped: every /livez status seen, and when
    /progress first said `waiting`."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.stop, self.codes, self.waiting_t = url, threading.Event(), [], None
        self.t0 = time.monotonic()

    def run(self) -> None:
        with httpx.Client(timeout=2) as c:
            while not self.stop.wait(0.1):
                try:
                    self.codes.append(c.get(f"{self.url}/livez").status_code)
                    if self.waiting_t is None and c.get(f"{self.url}/progress").json().get("phase") == "waiting":
                        self.waiting_t = time.monotonic() - self.t0
                except httpx.HTTPError:
                    self.codes.append(0)


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory (VmHWM), MB."""
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmHWM"))
    return int(line.split()[1]) / 1024


def _start(bootstrap, prefix, tmp_path, config, name) -> tuple[ServiceProc, Probe]:
    svc = ServiceProc("learner", ["--bootstrap", bootstrap, "--topic-prefix", prefix, "--instance-id", "big",
                                  "--config", str(config), "--liveness-timeout-s", "5",
                                  "--learner.policy-root", str(tmp_path / "policies"),
                                  "--learner.state-dir", str(tmp_path / "learner")], tmp_path / f"{name}.log")
    probe = Probe(svc.url)
    probe.start()
    return svc, probe


def _until_waiting(svc: ServiceProc, probe: Probe, timeout_s: float) -> float:
    deadline = time.monotonic() + timeout_s
    while probe.waiting_t is None:
        assert svc.proc.poll() is None, f"exited {svc.proc.returncode}: {svc.log_path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, svc.log_path.read_text()[-3000:]
        time.sleep(0.2)
    time.sleep(6)   # past the liveness timeout, waiting for groups that never come (no actor)
    probe.stop.set()
    probe.join()
    return probe.waiting_t


def _checked(log: Path) -> list[dict]:
    return [json.loads(x) for x in log.read_text().splitlines() if '"dataset checked at start"' in x]


@pytest.mark.timeout(300)
def test_a_million_rows_start_with_livez_200_throughout_and_a_bad_eval_row_is_left_out(bootstrap, prefix, tmp_path):
    data = tmp_path / "big.jsonl"
    t0 = time.monotonic()
    write_rows(data, ROWS)
    made_s = time.monotonic() - t0
    # and an evaluation set with a bad row (line 2, not JSON): left out, named, the run goes on
    test = tmp_path / "test.jsonl"
    test.write_text("".join(x + "\n" for x in [json.dumps({"question": "3", "answer": "3"}), "{oops"]
                            + [json.dumps({"question": str(d), "answer": str(d)}) for d in range(6)]))
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg["learner"].update(data=str(data), eval_data=str(test), steps=2)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))

    svc, probe = _start(bootstrap, prefix, tmp_path, config, "learner")
    try:
        waiting_s = _until_waiting(svc, probe, 240)
        rss = peak_rss_mb(svc.proc.pid)
    finally:
        assert svc.stop() == 0
    assert probe.codes and set(probe.codes) == {200}, probe.codes
    [checked] = _checked(svc.log_path)
    # the first step's rows checked, not the file's (a restart checking none again: test_row_check.py)
    assert checked["rows"] == ROWS and checked["good"] >= 8 and 8 <= checked["checked_now"] < 100, checked
    run = tmp_path / "learner" / (tmp_path / "learner" / "CURRENT").read_text().strip()
    [bad] = [json.loads(x) for x in (run / "bad_eval_rows.jsonl").read_text().splitlines()]
    assert (bad["split"], bad["where"], bad["field"]) == ("test", f"{test} row 2", "line"), bad
    st = json.loads((run / "state.json").read_text())
    assert st["eval_before"]["n"] == 7 and st["counts"]["bad_eval_rows"] == 1, st["eval_before"]
    print(f"{ROWS} rows written in {made_s:.1f} s; the learner waited for groups {waiting_s:.1f} s after its "   # noqa: T201
          f"start, peak RSS {rss:.0f} MB; /livez polled {len(probe.codes)} times, all 200")

"""bench/chaos.py, small: during a tiny run every kind of service is SIGKILLed in turn and the
broker is SIGKILLed and restarted once; the exactly-once audit must pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from steadyrl.local.ports import free_port_pair
from steadyrl.testing import KINDS, REPO, RunDir, audit_run, explain


@pytest.mark.slow
def test_chaos_every_kind_killed_and_the_broker_restarted_every_prompt_trained_once(tmp_path):
    out = tmp_path / "chaos.json"
    cmd = [sys.executable, "bench/chaos.py", "--seed", "3", "--kills", "6", "--order", "round-robin",
           "--steps", "100", "--budget-s", "220", "--state-dir", str(tmp_path / "state"),
           "--port", str(free_port_pair()), "--port-offset", str(5000 + os.getpid() % 1000), "--out", str(out)]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert run.returncode == 0 and result["passed"], (result["failures"], run.stdout[-3000:])
    audit = result["audit"]
    assert audit["ok"] and all(audit["checks"].values()), audit["checks"]
    assert audit["trained"] == 100 * 8 and not audit["trained_twice"] and audit["lost_count"] == 0
    assert all(result["kills_per_kind"][k] >= 1 for k in KINDS), result["kills_per_kind"]
    assert result["kills"] >= 6 and len(result["broker_restarts"]) == 1
    # every kill was followed by a restart that `up` saw
    assert sum(result["restarts_seen_by_up"].values()) >= result["kills"]
    assert result["wall_s"] < 240
    # the learner's own files, read again here, agree with the bench's audit
    learner = audit_run(RunDir.of_up(tmp_path / "state"), 100, 8)
    assert learner["ok"], explain(learner)
    assert learner["run_id"] == audit["run_id"] and learner["trained"] == audit["trained"]

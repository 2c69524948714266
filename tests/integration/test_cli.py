"""The Kafka-facing CLI commands against a real broker: the reachability check lets them through
at once, and they print their answer with nothing on stderr."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.helpers import ROOT, unique_prefix


def steadyrl(*argv: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if k != "STEADYRL_BOOTSTRAP"}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "steadyrl.cli", *argv], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    return r, time.monotonic() - t0


def test_topics_and_quarantine_on_a_reachable_broker(bootstrap):
    prefix = unique_prefix()
    r, _ = steadyrl("topics", "create", "--bootstrap", bootstrap, "--prefix", prefix)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert f"{prefix}rl.quarantine\tcreated" in r.stdout
    r, seconds = steadyrl("topics", "list", "--bootstrap", bootstrap, "--prefix", prefix)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert f"{prefix}rl.prompts\tpresent\t8/8 partitions" in r.stdout and "MISSING" not in r.stdout
    assert seconds < 20
    r, _ = steadyrl("quarantine", "list", "--bootstrap", bootstrap, "--prefix", prefix)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout == f"no quarantined batches on {prefix}rl.quarantine\n"
    r, _ = steadyrl("quarantine", "show", "nosuch", "--bootstrap", bootstrap, "--prefix", prefix)
    assert r.returncode == 1
    assert r.stderr == "error: no quarantined batch 'nosuch' (see `steadyrl quarantine list`)\n"

"""Runs are ordered by the runs present, not by the wall clock (issue 33): a learner started on
a node whose clock is behind the previous run's start still makes a later run, whose policy the
actor serves (before, its run id sorted first: the actor refused its weights as stale and
answered its prompts 409)."""

from __future__ import annotations

import json
import stat
import sys
import time
from pathlib import Path

import httpx
import yaml

from steadyrl.run import policy_files
from tests.helpers import ROOT, ServiceProc

FAKE_CLOCK = Path(__file__).with_name("fake_clock.py")
BEHIND_S = 3600


def _learner(bootstrap, prefix, tmp_path, config, name, clock_shift_s: float = 0.0) -> ServiceProc:
    python = None
    if clock_shift_s:   # the same interpreter, under a wrapper that sets this process's clock back
        python = tmp_path / f"python-{name}"
        python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_CLOCK}" {clock_shift_s} "$@"\n')
        python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return ServiceProc("learner", ["--bootstrap", bootstrap, "--topic-prefix", prefix, "--instance-id", name,
                                   "--config", str(config), "--learner.resume", "never",
                                   "--learner.policy-root", str(tmp_path / "policies"),
                                   "--learner.state-dir", str(tmp_path / "learner")],
                       tmp_path / f"{name}.log", python=str(python) if python else None)


def _new_run(state_dir: Path, other_than: str = "", timeout_s: float = 60.0) -> str:
    """The run CURRENT names once it is not `other_than`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        current = state_dir / "CURRENT"
        run = current.read_text().strip() if current.exists() else ""
        if run and run != other_than:
            return run
        time.sleep(0.1)
    raise AssertionError(f"no new run in {state_dir}")


def _served(actor: ServiceProc, run: str, timeout_s: float = 60.0) -> dict:
    """The actor's answer to a prompt of `run` (version >= 0), once it serves that run: 503
    while it is behind, 409 (an earlier run than the one served) fails at once."""
    body = {"prompts": [{"prompt_ids": [5, 6]}], "n": 1, "max_new_tokens": 2, "seed": 1,
            "run_id": run, "min_policy_version": 0}
    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.post(f"{actor.url}/generate", json=body, timeout=30)
        assert r.status_code in (200, 503), f"run {run}: {r.status_code} {r.text}"
        if r.status_code == 200:
            return r.json()
        assert time.monotonic() < deadline, f"the actor never served run {run}: {r.text}"
        time.sleep(0.2)


def test_a_run_started_with_the_clock_behind_the_previous_runs_start_is_served(bootstrap, prefix, tmp_path):
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg["learner"].update(eval_data=None)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    actor = ServiceProc("actor", ["--bootstrap", bootstrap, "--topic-prefix", prefix, "--instance-id", "a0",
                                  "--actor.model", "tiny", "--actor.policy-root", str(tmp_path / "policies")],
                        tmp_path / "actor.log")
    first = second = None
    try:
        first = _learner(bootstrap, prefix, tmp_path, config, "learner-1")
        earlier = _new_run(tmp_path / "learner")
        assert _served(actor, earlier)["policy_version"] == 0   # its version 0, announced at its start
        assert first.stop() == 0
        first = None

        # the next learner's node is an hour behind the first one's start
        second = _learner(bootstrap, prefix, tmp_path, config, "learner-2", clock_shift_s=-BEHIND_S)
        later = _new_run(tmp_path / "learner", other_than=earlier)
        assert policy_files.RUN_ID.fullmatch(later) and later > earlier
        assert _served(actor, later)["policy_version"] == 0
        assert actor.metric("steadyrl_actor_policy_rejected_total", {"reason": "stale"}) in (None, 0.0)
        ready = httpx.get(f"{actor.url}/readyz", timeout=5).json()
        assert repr(later) in ready["checks"]["policy"]["detail"], ready
        old = httpx.post(f"{actor.url}/generate", json={"prompts": [{"prompt_ids": [5]}], "n": 1,
                                                         "max_new_tokens": 1, "run_id": earlier}, timeout=30)
        assert old.status_code == 409, old.text   # the first run is now the earlier one
        warned = [json.loads(line) for line in (tmp_path / "learner-2.log").read_text().splitlines()
                  if "the clock is behind the newest run present" in line]
        assert warned and warned[0]["newest_run"] == earlier, warned
    finally:
        for svc in (first, second):
            if svc is not None:
                svc.stop()
        actor.stop()

"""A full disk costs time, never the run (issue 34, point 1), under `steadyrl up` on the tiny model
against the session broker (its data on another volume: `--bootstrap`).

The state folder (learner state, checkpoints, rollout cache, policy versions) is a tmpfs of the
test's own, filled to the brim mid-run for a while and then freed: every writer waits for space
and goes on by itself, the run reaches its last step, the exactly-once audit passes, nothing
restarts, and the wait was reported (log, /readyz `disk`, steadyrl_disk_full_writes_total,
steadyrl_disk_free_bytes). A state folder too small for two checkpoints and two policy
versions stops the run at start: exit 2 naming the folder."""

from __future__ import annotations

import re
import time

import httpx

from steadyrl.testing import audit_pipeline, explain
from tests.integration.test_pipeline import Up, _config
from tests.tmpfs import fill, small_fs

FULL_S = 30.0


def _get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=5)
    except httpx.HTTPError:
        return None


def test_a_state_folder_filled_mid_run_costs_time_not_the_run(bootstrap, tmp_path):
    steps = 40
    config = _config(tmp_path, steps=steps, eval_data=None, checkpoint_every=4)
    with small_fs(tmp_path / "state", "64m") as fs:
        up = Up(bootstrap, tmp_path, config)
        try:
            up.wait_step(8)
            ballast = fill(fs)
            filled_at, step_at_fill = time.time(), up.progress().get("step")
            learner = up.url(8400)
            seen_not_ready = seen_counted = ""
            free_metric = None
            deadline = time.monotonic() + FULL_S
            while time.monotonic() < deadline:
                ready = _get(f"{learner}/readyz")
                if ready is not None and ready.status_code == 503 and "waits for space" in ready.text:
                    seen_not_ready = ready.text
                metrics = _get(f"{learner}/metrics")
                if metrics is not None:
                    m = re.search(r'^steadyrl_disk_full_writes_total\{writer="(\w+)"\} ([0-9.e+]+)$',
                                  metrics.text, re.M)
                    if m and float(m.group(2)) > 0:
                        seen_counted = m.group(0)
                    f = re.search(r'^steadyrl_disk_free_bytes\{path="[^"]*",volume="state_dir"\} ([0-9.e+]+)$',
                                  metrics.text, re.M)
                    free_metric = float(f.group(1)) if f else free_metric
                time.sleep(1.0)
            step_while_full = up.progress().get("step")
            ballast.unlink()
            freed_at = time.time()
            rc = up.wait(300)
        finally:
            up.close()
        out = up.log()
        assert rc == 0, out[-4000:]
        assert "restart #" not in out and "exited with" not in out, out[-4000:]
        assert "no space left to write" in out and "space returned" in out, out[-4000:]
        assert seen_not_ready, "/readyz never said a writer waits for space"
        assert seen_counted, "steadyrl_disk_full_writes_total never rose"
        assert free_metric is not None and free_metric < 1 << 20, free_metric
        run = up.run()
        assert run.state["step"] == steps and run.state["finished"]
        report = audit_pipeline(bootstrap, up.prefix, run, steps, 8, excuse_dlq=False)
        assert report["ok"], explain(report)
        # the time the run lost: the longest gap between steps, less the median step
        times = [row["time"] for row in run.history]
        gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False))
        lost = gaps[-1] - gaps[len(gaps) // 2]
        resumed = min(t for t in times if t >= freed_at)
        print(f"disk full {FULL_S:.0f} s from step {step_at_fill} (step {step_while_full} while full); "  # noqa: T201
              f"first step {resumed - freed_at:.1f} s after the space returned; lost {lost:.1f} s "
              f"(longest gap {gaps[-1]:.1f} s, median {gaps[len(gaps) // 2]:.2f} s, filled at {filled_at:.0f}); "
              f"reported: {seen_counted}; readyz {seen_not_ready[:200]}")


def test_a_state_folder_too_small_for_the_run_is_refused_at_start(bootstrap, tmp_path):
    # the tiny model's weights are 333 KiB: two checkpoints (x3: weights + AdamW's moments) and two
    # versions need 2.6 MiB
    with small_fs(tmp_path / "state", "2m"):
        up = Up(bootstrap, tmp_path, _config(tmp_path, steps=4, eval_data=None))
        rc = up.wait(240)
    out = up.log()
    assert rc == 2, out[-4000:]
    assert "not enough disk space for this run" in out and str(tmp_path / "state" / "learner") in out, out[-4000:]
    assert "restart #" not in out, out[-4000:]

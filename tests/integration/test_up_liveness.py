"""`steadyrl up` acts on a hung service and outlives its own output (issue 46), on the tiny
pipeline against the session broker.

One run: the learner hangs in its evaluation before (failpoint `learner.eval_hang`: the
thread sleeps for good, as on a reward that never returns); its /readyz names the stalled
evaluation, its /livez turns 503, and `up` stops and restarts it (a line naming the failed
liveness, counted as restart #1); the restarted learner evaluates and trains. Meanwhile up's
own output goes to a file on the state volume (`up > run.log`), which is filled for 40 s
mid-run: up drops what it cannot print, says so once space returns, and the run finishes.
Another: up's stdout is a pipe whose reader exits at once; the run finishes all the same."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import yaml

from steadyrl.testing import RunDir, unique_prefix
from tests.helpers import ROOT
from tests.integration.test_pipeline import Up, _config
from tests.tmpfs import fill, small_fs

FULL_S = 40.0
LIVENESS = ("--liveness-period", "1", "--liveness-failures", "3")


def _get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=3)
    except httpx.HTTPError:
        return None


def _tiny(tmp_path, steps: int, **learner) -> object:
    config = _config(tmp_path, steps=steps, **learner)
    cfg = yaml.safe_load(config.read_text())
    cfg["liveness_timeout_s"] = 10.0           # every service: /livez 503 after 10 s without a beat
    config.write_text(yaml.safe_dump(cfg))
    return config


def _fill_last_page(path, strict: bool = True) -> None:
    """Append to `path` until its volume (full) refuses: the slack of its last page used up."""
    with open(path, "ab", buffering=0) as f:
        try:
            for _ in range(4097):
                f.write(b"\n")   # empty lines: none is left cut
        except OSError:
            return
    if strict:
        raise AssertionError(f"{path}: its volume is not full")


def _keep_full(folder, logs, stop: threading.Event) -> None:
    """Until `stop`: take back (in `folder`'s ballast) every page the run frees on its volume (the
    learner prunes checkpoints there) and the slack of each log's last page: the volume stays full."""
    while not stop.wait(0.2):
        fill(folder)
        for path in logs:
            _fill_last_page(path, strict=False)


def test_up_restarts_a_learner_hung_in_its_evaluation_and_outlives_a_full_output_volume(bootstrap, tmp_path):
    steps = 24
    config = _tiny(tmp_path, steps, eval_data="tiny_copy:32", stall_min_s=2.0, checkpoint_every=4)
    marker = tmp_path / "eval-hang.marker"
    with small_fs(tmp_path / "state", "64m") as fs:
        up = Up(bootstrap, tmp_path, config, "--plain", *LIVENESS, log_path=fs / "run.log",
                env={"STEADYRL_FAILPOINT": f"learner.eval_hang:{marker}"})
        learner = up.url(8400)
        try:
            deadline = time.monotonic() + 180
            while not marker.exists():
                assert up.proc.poll() is None and time.monotonic() < deadline, up.log()[-4000:]
                time.sleep(0.5)
            t_hang = time.monotonic()
            stalled = dead = ""
            while not (stalled and dead):     # seen from outside while it hangs
                assert time.monotonic() - t_hang < 60, (stalled, dead, up.log()[-3000:])
                ready, live = _get(f"{learner}/readyz"), _get(f"{learner}/livez")
                if ready is not None and ready.status_code == 503 and "stalled: evaluation" in ready.text:
                    stalled = ready.json()["checks"]["progress"]["detail"]
                if live is not None and live.status_code == 503:
                    dead = live.text
                time.sleep(0.5)
            while "(stopped: liveness failed); restart #1" not in up.log():
                assert up.proc.poll() is None and time.monotonic() - t_hang < 120, up.log()[-4000:]
                time.sleep(0.5)
            restarted_s = time.monotonic() - t_hang
            up.wait_step(6, timeout_s=180)
            more = fs / "refill"
            more.mkdir()
            ballast = fill(fs)
            logs = (up.log_path, up.state / "logs" / "reward-0.log")
            for path in logs:
                _fill_last_page(path)   # its next line needs a page of its own: the next write fails
            full = threading.Event()
            keeper = threading.Thread(target=_keep_full, args=(more, logs, full), daemon=True)
            keeper.start()
            step_at_fill = up.progress().get("step")
            time.sleep(5)
            reward = up.child_pid("reward-0")
            os.kill(reward, signal.SIGKILL)   # up restarts it while it cannot print a line
            time.sleep(FULL_S - 5)
            step_while_full = up.progress().get("step")
            restarted = up.child_pid("reward-0")
            full.set()
            keeper.join()
            ballast.unlink()
            (more / "ballast").unlink(missing_ok=True)
            rc = up.wait(300)
        finally:
            up.close()
            # kept beside the test's files once the volume is gone
            shutil.copytree(up.state / "logs", tmp_path / "logs", dirs_exist_ok=True)
            shutil.copy(up.log_path, tmp_path / "run.log")
        out = up.log()
        reward_log_text = (up.state / "logs" / "reward-0.log").read_text()
        state = RunDir.of_up(up.state).state   # read before the volume goes
    assert rc == 0, out[-4000:]
    assert stalled.startswith("stalled: evaluation at eval before, split test, 0 of 32 rows: "), stalled
    assert '"live":false' in dead and '"doing":"eval before, split test, 0 of 32 rows (step 0)"' in dead, dead
    assert re.search(r"^learner-0 +\| liveness failed: 3 polls in a row over 3 s, the last: /livez 503 ", out, re.M), \
        out[-4000:]
    assert re.search(r"^learner-0 +\| exited with -9 \(stopped: liveness failed\); restart #1 in 1s$", out, re.M), \
        out[-4000:]
    # once: not again when the finished learner stops listening and exits (found: killed mid-exit,
    # restarted, a new run begun, again and again)
    assert len(re.findall(r"^learner-0 +\| (liveness failed|exited with)", out, re.M)) == 2, out[-4000:]
    # what up could not print while the volume was full: dropped, counted, said once space
    # returned; reward-0 was restarted all the same
    lost = [line for line in out.splitlines() if re.search(r"\d+ lines? of output could not be written \(No space "
                                                           r"left on device\) from ", line)]
    assert lost and lost[0].startswith("up | ") and lost[0].endswith(f"dropped; each service's lines are also kept in "
                                                                      f"{up.state / 'logs'}"), out[-4000:]
    assert restarted != reward   # (its line may or may not have been printed: the learner frees space as it prunes)
    # and what could not be kept in its own log file, said there
    assert re.search(r"^steadyrl up \| \d+ lines? of output could not be written \(No space left on device\) from "
                     r".*: dropped from this file$", reward_log_text, re.M), reward_log_text[-3000:]
    assert state["step"] == steps and state["finished"], state
    print(f"hang seen by /readyz and /livez, restarted {restarted_s:.0f} s after it began; volume full {FULL_S:.0f} s "  # noqa: T201
          f"from step {step_at_fill} (step {step_while_full} while full); {lost[0]}")


def test_up_outlives_a_closed_stdout_pipe(bootstrap, tmp_path):
    config = _tiny(tmp_path, 4, eval_data=None)
    state = tmp_path / "state"
    offset = 2000 + (os.getpid() * 11 + int(time.time())) % 3000
    proc = subprocess.Popen([sys.executable, "-m", "steadyrl.cli", "up", "--bootstrap", bootstrap, "--state-dir",
                             str(state), "--prefix", unique_prefix(), "--port-offset", str(offset), "--config",
                             str(config), *LIVENESS], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()             # then the reader exits: `steadyrl up | head -1`
    proc.stdout.close()
    try:
        rc = proc.wait(240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(10)
    assert first, "up printed nothing"
    run = RunDir.of_up(state)
    assert rc == 0 and run.state["step"] == 4 and run.state["finished"], (rc, run.state)
    assert "restart #" not in "".join(p.read_text() for p in (state / "logs").glob("*.log"))

"""`steadyrl up` on a terminal (a pseudo-TTY): the live panel in place of the services' JSON
lines, every line still in `<state>/logs/<instance>.log`, the SUMMARY after the panel (issue 38)."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time

import yaml

from tests.helpers import ROOT, unique_prefix

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")


def test_up_on_a_terminal_shows_the_panel_and_keeps_the_json_in_the_logs(bootstrap, tmp_path):
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg["learner"].update(steps=5, eval_data="tiny_copy:16")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    state, offset = tmp_path / "state", 2000 + (os.getpid() * 7 + int(time.time())) % 3000
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "120", "LINES": "40"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen([sys.executable, "-m", "steadyrl.cli", "up", "--bootstrap", bootstrap, "--state-dir",
                             str(state), "--prefix", unique_prefix(), "--port-offset", str(offset), "--config",
                             str(tmp_path / "config.yaml")], cwd=ROOT, stdin=subprocess.DEVNULL, stdout=slave,
                            stderr=slave, env=env, start_new_session=True)
    os.close(slave)
    raw = bytearray()
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if select.select([master], [], [], 1.0)[0]:
                try:
                    chunk = os.read(master, 65536)
                except OSError:   # EIO: every holder of the terminal's other side has closed it
                    break
                if not chunk:
                    break
                raw += chunk
            elif proc.poll() is not None:
                break
        rc = proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        os.close(master)
    out = ANSI.sub("", raw.decode(errors="replace"))
    assert rc == 0, out[-4000:]
    assert "steadyrl up - run r" in out and "5/5" in out and "ETA" in out and "(last batch)" in out, out[-4000:]
    assert "breaker" in out and "crashes absorbed" in out and "accuracy" in out
    assert '"level"' not in out and '{"ts"' not in out, "JSON log lines reached the terminal"
    assert out.rindex("╰") < out.index("| SUMMARY test accuracy"), "SUMMARY before the panel stopped"
    assert "learner-0 finished its run" in out and out.rstrip().endswith("stopped")
    logged = (state / "logs" / "learner-0.log").read_text()
    assert '"msg": "step"' in logged and "SUMMARY test accuracy" in logged

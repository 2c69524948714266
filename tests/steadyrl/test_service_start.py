"""A service whose HTTP port another process holds stops at start with exit 2 naming the port
(a restart would not free it: it used to exit 1 with a traceback, and `up` restarted it without
end); an unknown evaluation scorer stops the learner the same way (issue 33)."""

from __future__ import annotations

import socket
import subprocess
import sys

from tests.helpers import ROOT


def test_a_taken_metrics_port_exits_2_naming_it():
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        r = subprocess.run([sys.executable, "-m", "steadyrl.services.reward.server", "--metrics-port", str(port)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    finally:
        holder.close()
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert f"metrics_port {port}: 127.0.0.1:{port} is already in use" in r.stderr and "Traceback" not in r.stderr


def test_an_unknown_eval_scorer_exits_2_naming_it(tmp_path):
    r = subprocess.run([sys.executable, "-m", "steadyrl.services.learner", "--bootstrap", "127.0.0.1:9",
                        "--learner.eval-scorer", "no_such_scorer"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "learner.eval_scorer" in r.stderr and "no_such_scorer" in r.stderr, r.stderr[-2000:]

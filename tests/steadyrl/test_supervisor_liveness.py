"""`steadyrl up` watches each service's /livez (issue 46): a child whose /livez fails
`failures` polls in a row -- answering 503, or not answering -- is stopped and restarted,
counted with the other restarts, with a line naming the last answer; a child still starting
(never ready yet) is not judged until `start_s`. Real child processes serving real HTTP on
127.0.0.1; the timings are shortened (Liveness)."""

import io
import sys
import time

from steadyrl.local.ports import free_port
from steadyrl.local.supervisor import Child, Liveness, Supervisor

#: A service stand-in: /readyz answers READY; /livez 200 for 1 s, then (first life only: the
#: marker file) BAD: "503" or "hang" (no answer). SIGTERM is ignored, as by a loop that hangs.
SERVER = r'''
import http.server, os, signal, sys, time
port, marker, bad, ready = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4] == "1"
first = not os.path.exists(marker)
open(marker, "a").write("started\n")
t0 = time.monotonic()
signal.signal(signal.SIGTERM, signal.SIG_IGN)

class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        if self.path == "/readyz":
            code = 200 if ready else 503
        else:
            good = not first or time.monotonic() - t0 < 1.0
            if not good and bad == "hang":
                time.sleep(30)
            code = 200 if good else 503
        live = b"true" if code == 200 else b"false"
        body = b'{"live": %s, "doing": "eval before, split test, 0 of 64 rows"}' % live
        self.send_response(code); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)

print("listening", flush=True)
http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def _child(name, tmp_path, bad, ready=True):
    port = free_port()
    return Child(name, [sys.executable, "-c", SERVER, str(port), str(tmp_path / f"{name}.marker"), bad,
                        "1" if ready else "0"], port)


def test_a_child_whose_livez_fails_is_restarted_and_one_still_starting_is_not(tmp_path):
    failing, hanging = _child("learner-0", tmp_path, "503"), _child("actor-0", tmp_path, "hang")
    starting = _child("reward-0", tmp_path, "503", ready=False)    # never ready, /livez 503 after 1 s
    out = io.StringIO()
    sup = Supervisor([failing, hanging, starting], out=out, grace_s=1.0,
                     liveness=Liveness(period_s=0.3, failures=3, start_s=120, timeout_s=0.5))
    try:
        sup.start_all()
        deadline = time.monotonic() + 60
        while not (failing.restarts and hanging.restarts and failing.ready_seen and hanging.ready_seen):
            assert time.monotonic() < deadline, out.getvalue()
            sup.watch_once()
            time.sleep(0.1)
        for _ in range(20):                                          # the new processes stay up
            sup.watch_once()
            time.sleep(0.1)
    finally:
        sup.stop_all()
    text = out.getvalue()
    assert (failing.restarts, failing.liveness_restarts) == (1, 1), text
    assert (hanging.restarts, hanging.liveness_restarts) == (1, 1), text
    assert starting.restarts == 0 and not starting.ready_seen, text   # still starting: not judged
    assert ("learner-0 | liveness failed: 3 polls in a row over 1 s, the last: /livez 503 {\"live\": false, "
            "\"doing\": \"eval before, split test, 0 of 64 rows\"}; stopping it (SIGTERM, SIGKILL after 1 s)") in text
    assert ("actor-0   | liveness failed: 3 polls in a row over 1 s, the last: /livez did not answer within "
            "0.5 s") in text
    # SIGTERM ignored (a hung loop): SIGKILL after the grace; restarted whatever the status, counted
    assert "learner-0 | exited with -9 (stopped: liveness failed); restart #1 in 1s" in text, text
    assert (tmp_path / "learner-0.marker").read_text() == "started\nstarted\n"


def test_failures_0_watches_nothing(tmp_path):
    child = _child("learner-0", tmp_path, "503")
    sup = Supervisor([child], out=io.StringIO(), grace_s=1.0, liveness=Liveness(period_s=0.2, failures=0))
    try:
        sup.start_all()
        for _ in range(25):
            sup.watch_once()
            time.sleep(0.1)
        assert sup._poller is None and child.restarts == 0 and child.live_failures == 0
    finally:
        sup.stop_all()


def test_a_child_never_ready_is_judged_start_s_after_its_start(tmp_path):
    child = _child("learner-0", tmp_path, "503", ready=False)
    out = io.StringIO()
    sup = Supervisor([child], out=out, grace_s=1.0,
                     liveness=Liveness(period_s=0.2, failures=2, start_s=1.5, timeout_s=0.5))
    try:
        sup.start_all()
        t0 = time.monotonic()
        while not child.restarts:
            assert time.monotonic() - t0 < 30, out.getvalue()
            sup.watch_once()
            time.sleep(0.05)
        took = time.monotonic() - t0
    finally:
        sup.stop_all()
    assert child.liveness_restarts == 1 and not child.ready_seen
    assert took >= 1.5, took                                          # not before start_s


def test_up_reads_its_liveness_flags_and_refuses_bad_ones():
    import argparse

    import pytest

    from steadyrl.cli import CliError, build_parser
    from steadyrl.cli.up import liveness

    args = build_parser().parse_args(["up", "--liveness-period", "2", "--liveness-failures", "4",
                                      "--liveness-start", "30"])
    assert liveness(args) == Liveness(period_s=2.0, failures=4, start_s=30.0, timeout_s=2.0)
    assert liveness(build_parser().parse_args(["up"])) == Liveness()   # the Kubernetes manifests' probes
    with pytest.raises(CliError) as e:
        liveness(argparse.Namespace(liveness_period=0.0, liveness_failures=6, liveness_start=600.0))
    assert e.value.code == 2 and "--liveness-period 0 (> 0)" in str(e.value)


def test_livez_says_doing_and_stays_200_once_stopping():
    """A service on its way out (told to stop, or its loop ended: the learner closing its clients
    after its run) is not hung: found when up killed a learner that had finished, mid-exit, and a
    new run began."""
    from fastapi.testclient import TestClient

    from steadyrl.http import Health, make_app

    health = Health(liveness_timeout_s=0.05)
    health.doing = lambda: "eval after, split test, 32 of 64 rows (step 24)"
    client = TestClient(make_app("learner", health))
    time.sleep(0.1)
    r = client.get("/livez")
    assert r.status_code == 503 and r.json()["doing"] == "eval after, split test, 32 of 64 rows (step 24)"
    health.stopping = True
    r = client.get("/livez")
    assert r.status_code == 200 and r.json()["stopping"] is True and r.json()["live"] is True


def test_a_child_that_stops_listening_is_not_judged(tmp_path):
    """Nothing listening (a process starting, or exiting after its HTTP server stopped) is not a
    failed poll; its exit is what the supervisor watches."""
    quiet = Child("learner-0", [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                  free_port())
    sup = Supervisor([quiet], out=io.StringIO(), grace_s=1.0,
                     liveness=Liveness(period_s=0.2, failures=2, start_s=0.0, timeout_s=0.5))
    try:
        sup.start_all()
        for _ in range(25):
            sup.watch_once()
            time.sleep(0.1)
        assert quiet.restarts == 0 and quiet.live_failures == 0 and quiet.stopping_since is None
    finally:
        sup.stop_all()

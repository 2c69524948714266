"""`steadyrl status`: where a run stands, from its files, without the stack running (issue 38)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from steadyrl.cli import main
from steadyrl.cli.up import learner_url, write_record
from steadyrl.local.ports import free_port
from tests.steadyrl.testing.rundirs import write_run

RUN_ID = "r20260101T000000-abcd"


def test_status_reads_the_run_of_a_state_dir(tmp_path, capsys):
    run = write_run(tmp_path / "learner", steps=3, finished=False, counts={"bad_rows": 2, "dlq": 0})
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "LATEST").write_text("step_000003\n")
    offset = free_port() - 8400   # nothing answers there: the run is not running
    assert main(["status", "--state-dir", str(tmp_path), "--port-offset", str(offset)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "run r20260101T000000-abcd: step 3, not running"
    assert out[1].startswith("last step: reward 0.300, 0.5 s, ")
    assert out[2:4] == ["last checkpoint: step_000003", "in flight 0, held 0; counts: bad_rows 2"]


def test_status_without_a_run_says_so_once_and_names_the_state_dir_flag(tmp_path, capsys):
    assert main(["status", "--state-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: no run under {tmp_path / 'learner'} (has `steadyrl up` run with this --state-dir? "
                   f"pass the one up used: `steadyrl status --state-dir DIR`)")
    assert "CURRENT" not in err


class _Learner(BaseHTTPRequestHandler):
    def do_GET(self):   # noqa: N802 - http.server's name
        body = json.dumps({"run_id": RUN_ID, "step": 2, "steps": 5, "phase": "training"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_status_asks_the_learner_at_the_port_up_recorded(tmp_path, capsys):
    """`up --port-offset N` records its ports in <state>/up.json: status finds the live learner
    without being given the same --port-offset (the walk-through saw "not running" mid-run)."""
    write_run(tmp_path / "learner", steps=2, finished=False)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Learner)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        offset = server.server_address[1] - 8400
        record = json.loads(write_record(tmp_path, offset, {"rollout": 2}, "127.0.0.1:9092").read_text())
        assert record["port_offset"] == offset and record["ports"]["rollout-1"] == 8201 + offset
        assert learner_url(tmp_path) == f"http://127.0.0.1:{server.server_address[1]}"
        assert main(["status", "--state-dir", str(tmp_path)]) == 0
        assert capsys.readouterr().out.splitlines()[0] == f"run {RUN_ID}: step 2/5, running (training)"
    finally:
        server.shutdown()
        server.server_close()


def test_the_learner_url_without_a_record_or_with_an_offset_given(tmp_path):
    assert learner_url(tmp_path) == "http://127.0.0.1:8400"
    write_record(tmp_path, 100, {}, "127.0.0.1:9092")
    assert learner_url(tmp_path) == "http://127.0.0.1:8500"
    assert learner_url(tmp_path, 0) == "http://127.0.0.1:8400"   # an offset given wins

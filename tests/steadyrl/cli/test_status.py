"""`steadyrl status`: where a run stands, from its files, without the stack running (issue 38)."""

from steadyrl.broker import free_port
from steadyrl.cli import main
from tests.steadyrl.testing.rundirs import write_run


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


def test_status_without_a_run_says_so(tmp_path, capsys):
    assert main(["status", "--state-dir", str(tmp_path)]) == 2
    assert "no run under" in capsys.readouterr().err

"""Each service's output is kept whole in <state>/logs/<instance>.log and `steadyrl logs` prints
it; a progress bar redrawn with carriage returns shows as its last state (issue 38:
transformers' bars reached the terminal as single lines of up to 1 626 characters)."""

import io
import subprocess
import sys

import pytest

from steadyrl.cli import main
from steadyrl.local.supervisor import _pump


def test_the_pump_keeps_whole_lines_in_the_file_and_the_last_redraw_on_the_terminal(tmp_path):
    out, log = io.StringIO(), tmp_path / "logs" / "learner-0.log"
    log.parent.mkdir()
    bar = b"Loading:   0%|          | 0/272\rLoading:  50%|#####     | 136/272\rLoading: 100%|##########| 272/272\n"
    _pump("learner-0", io.BytesIO(b'{"msg": "step", "step": 1}\n' + bar + b"no newline at the end"), out, log)
    assert out.getvalue().splitlines() == ['learner-0 | {"msg": "step", "step": 1}',
                                           "learner-0 | Loading: 100%|##########| 272/272",
                                           "learner-0 | no newline at the end"]
    assert log.read_bytes() == b'{"msg": "step", "step": 1}\n' + bar + b"no newline at the end\n"


def test_a_supervised_child_writes_its_log_file(tmp_path):
    from steadyrl.local.supervisor import Child, Supervisor

    sup = Supervisor([Child("reward-0", [sys.executable, "-c", "print('hello'); import sys; "
                                          "print('oops', file=sys.stderr)"], port=1)],
                     out=io.StringIO(), log_dir=tmp_path / "logs")
    sup._start(sup.children[0])
    sup.children[0].proc.wait(30)
    for t in sup.children[0].threads:
        t.join(10)
    assert sorted((tmp_path / "logs" / "reward-0.log").read_text().splitlines()) == ["hello", "oops"]


def test_steadyrl_logs_prints_the_tail_and_names_the_known_instances(tmp_path, capsys):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "actor-0.log").write_text("".join(f"line {i}\n" for i in range(100)))
    assert main(["logs", "actor-0", "--state-dir", str(tmp_path), "-n", "3"]) == 0
    assert capsys.readouterr().out == "line 97\nline 98\nline 99\n"
    assert main(["logs", "learner-0", "--state-dir", str(tmp_path)]) == 2
    assert "no log of 'learner-0' in " in (err := capsys.readouterr().err) and "there are actor-0" in err
    r = subprocess.run([sys.executable, "-m", "steadyrl.cli", "logs", "x", "--state-dir", str(tmp_path / "none")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "has `steadyrl up` run with this --state-dir?" in r.stderr


@pytest.mark.parametrize("argv", [["--help"]])
def test_help_lists_logs(argv, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert "logs" in capsys.readouterr().out
